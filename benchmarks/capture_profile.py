#!/usr/bin/env python3
"""Where the piecewise runtime's capture time goes: the built-in Llama (max batch 512) through
``tr.compile(sizes=default_sizes())`` (67 sizes), as ``cache_start.py --models llama-67`` starts it.

Three builds in one process, each timed from ``tr.compile`` to the first output: the first pays
Inductor's compile and every first use (kernels loaded, cuBLAS heuristics per shape); the second
finds Inductor's in-process caches and the loaded kernels, so its time is Dynamo, our backend and
the captures; the third runs the second's under cProfile. Printed: the seconds, the backend's
compile and capture seconds, the graphs captured, and the profile's top functions by own time
and by cumulative time. ``--first-only`` profiles the first build and stops: run it after a
plain run, in a new process, to see a warm start (Inductor's cache on disk, nothing loaded).
Usage: ``python benchmarks/capture_profile.py [--sizes N] [--first-only]`` (CUDA only).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import torchreplay as tr
from torchreplay.models.llama import LlamaConfig, build_llama
from torchreplay.sizes.plan import default_sizes


def build_and_call(model, cfg, sizes):
    torch._dynamo.reset()
    dev = torch.device("cuda")
    args = (torch.randint(0, cfg.vocab_size, (8, 1), device=dev),
            torch.full((8,), cfg.max_seq_len // 2, dtype=torch.long, device=dev))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    c = tr.compile(model, sizes=sizes)
    with torch.no_grad():
        for _ in range(3):
            c(*args)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    runtimes = c.backend.runtimes
    graphs = sum(r.stats.captures for r in runtimes)
    capture = sum(r.stats.capture_seconds for r in runtimes)
    print(f"  {seconds:.2f} s to the first output; backend compile {c.backend.compile_seconds:.2f} s, "
          f"capture {capture:.2f} s; {len(runtimes)} runtimes, {graphs} captures", flush=True)
    return c


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", type=int, default=0, help="the first N of default_sizes() (0: all)")
    p.add_argument("--first-only", action="store_true", help="profile the first build alone")
    a = p.parse_args()
    sizes = default_sizes()
    if a.sizes:
        sizes = sizes[: a.sizes]
    cfg = LlamaConfig(max_batch=512)
    model = build_llama(cfg, torch.device("cuda"))
    print(f"built-in Llama, {len(sizes)} sizes")
    pr = cProfile.Profile()
    if a.first_only:
        print("first build, profiled:")
    else:
        print("first build:")
        build_and_call(model, cfg, sizes)
        print("second build (Inductor's in-process caches warm, kernels loaded):")
        build_and_call(model, cfg, sizes)
        print("third build, profiled:")
    pr.enable()
    c = build_and_call(model, cfg, sizes)
    pr.disable()
    del c
    for key in ("tottime", "cumulative"):
        st = io.StringIO()
        pstats.Stats(pr, stream=st).sort_stats(key).print_stats(40)
        print(st.getvalue()[-9000:])


if __name__ == "__main__":
    main()
