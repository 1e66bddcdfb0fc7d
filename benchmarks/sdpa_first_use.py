#!/usr/bin/env python3
"""What the built-in Llama's masked attention costs the first time a process meets a shape.

A warm start of ``tr.compile(sizes=67 sizes)`` spent 2.9 s in ``scaled_dot_product_attention``
at sizes it met for the first time (0.1 s once seen). This measures that cost apart from any
graph: in a fresh process per backend choice, the decode attention of the built-in Llama
(bfloat16, q ``[B, 4, 4, 64]`` over a ``[B, 4, 1024, 64]`` cache, a boolean mask
``[B, 1, 1, 1024]``) is called at ``N`` batch sizes, each size twice; printed per backend: the
kernel torch picked, and the host milliseconds of the first and the second call at each size
(median over sizes), synchronized.

Usage: ``python benchmarks/sdpa_first_use.py [--sizes N]`` (CUDA only).
"""
from __future__ import annotations

import argparse
import subprocess
import sys

CHILD = r'''
import statistics, sys, time
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
backend, n = sys.argv[1], int(sys.argv[2])
dev = torch.device("cuda")
choice = None if backend == "default" else [getattr(SDPBackend, backend)]
def call(B):
    q = torch.randn(B, 4, 4, 64, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, 4, 1024, 64, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    mask = torch.rand(B, 1, 1, 1024, device=dev) < 0.9
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if choice is None:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    else:
        with sdpa_kernel(choice):
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3
torch.zeros(1, device=dev); torch.cuda.synchronize()
try:
    call(512)  # process-wide first use (handles, libraries) apart
except RuntimeError as e:
    print(f"{backend:>18}: cannot run this call ({str(e).splitlines()[0][:80]})")
    sys.exit(0)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    call(3)
kernels = sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                  and "elementwise" not in e.name and "distribution" not in e.name})
first, second = [], []
for B in range(1, n + 1):
    if B == 3:
        continue
    first.append(call(B)); second.append(call(B))
print(f"{backend:>18}: first call at a new size {statistics.median(first):7.2f} ms "
      f"(max {max(first):.2f}), second {statistics.median(second):6.2f} ms; kernels: "
      f"{'; '.join(k[:60] for k in kernels)[:200]}")
'''


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", type=int, default=24)
    a = p.parse_args()
    for backend in ("default", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        subprocess.run([sys.executable, "-c", CHILD, backend, str(a.sizes)], check=False)


if __name__ == "__main__":
    main()
