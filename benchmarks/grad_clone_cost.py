"""Host cost of handing a backward's parameter gradients out as fresh tensors (CUDA only;
RESULTS.md, session 33).

A graphed backward leaves its gradients in static buffers; a parameter whose ``.grad`` is None
gets a copy (training/pair.py ``InputGrads.hand``). Timed here, host us per call (median of 15
x 200 calls), for ResNet-50's 161 parameter shapes, its first 20, and one Linear's 2:

- ``_foreach_mul(ts, 1.0)`` (what ``_compat.foreach_clone`` does): one allocation per tensor;
- one flat allocation, views of it (``torch.split`` + ``view``), one ``_foreach_copy_``;
- ``clone()`` per tensor.

Usage: ``PYTHONPATH=. python benchmarks/grad_clone_cost.py``
"""
from __future__ import annotations

import statistics
import time

import torch
import torchvision


def per_call_us(f, calls: int = 200, samples: int = 15) -> float:
    for _ in range(20):
        f()
    torch.cuda.synchronize()
    out = []
    for _ in range(samples):
        t = time.perf_counter()
        for _ in range(calls):
            f()
        out.append((time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def flat_views(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    flat = torch.empty(sum(t.numel() for t in ts), dtype=ts[0].dtype, device=ts[0].device)
    views = [v.view(t.shape) for v, t in zip(flat.split([t.numel() for t in ts]), ts)]
    torch._foreach_copy_(views, ts)
    return views


def flat_views_cached(ts: list[torch.Tensor], numels: list[int], shapes: list[torch.Size], total: int):
    flat = torch.empty(total, dtype=ts[0].dtype, device=ts[0].device)
    views = [v.view(s) for v, s in zip(flat.split(numels), shapes)]
    torch._foreach_copy_(views, ts)
    return views


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__)
    params = [p.detach().clone() for p in torchvision.models.resnet50().cuda().parameters()]
    linear = [torch.randn(256, 256, device="cuda"), torch.randn(256, device="cuda")]
    for label, ts in (("ResNet-50, 161", params), ("ResNet-50's first 20", params[:20]), ("Linear(256), 2", linear)):
        numels = [t.numel() for t in ts]
        shapes = [t.shape for t in ts]
        total = sum(numels)
        rows = {
            "_foreach_mul(ts, 1.0)": lambda ts=ts: torch._foreach_mul(ts, 1.0),
            "flat + split views + _foreach_copy_": lambda ts=ts: flat_views(ts),
            "same, numels and shapes kept": lambda ts=ts, n=numels, s=shapes, t=total: flat_views_cached(ts, n, s, t),
            "clone() each": lambda ts=ts: [t.clone() for t in ts],
        }
        for k, f in rows.items():
            got = f()
            assert all(torch.equal(a, b) for a, b in zip(got, ts))
        print(f"{label} tensors:")
        for _ in range(2):  # twice, interleaved by row, to see the noise
            for k, f in rows.items():
                print(f"  {k:38s} {per_call_us(f):8.1f} us")


if __name__ == "__main__":
    main()
