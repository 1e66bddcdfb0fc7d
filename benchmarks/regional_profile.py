"""Where the host time of a regional training step goes (RESULTS.md, session 28): the
``regional_compile.py --train`` model (12 residual blocks, batch 8) with ``tr.compile`` of each
block and with reduce-overhead of each block (a step marked per call). For each: the CUDA
runtime calls one step makes (``torch.profiler``) and a ``cProfile`` of 30 steps, the functions
with the most own time. Needs CUDA.

Usage: ``PYTHONPATH=. python benchmarks/regional_profile.py [--top N]``
"""
from __future__ import annotations

import cProfile
import collections
import io
import pstats
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
import torchreplay as tr  # noqa: E402
from regional_compile import BATCH, BLOCKS, WIDTH, chain, fresh_copy, marked  # noqa: E402
from torchreplay.models.blocks import ResidualBlock  # noqa: E402

STEPS = 30


def runtime_calls(run) -> dict[str, str]:
    """The CUDA runtime and driver calls of one step, by name (launches, copies, events):
    how many, and their mean host us."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    counts: collections.Counter[str] = collections.Counter()
    spent: collections.Counter[str] = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith(("cuda", "cu")):
            counts[e.name] += 1
            spent[e.name] += e.cpu_time_total
    return {k: f"{n} x {spent[k] / n:.1f} us" for k, n in counts.most_common(12)}


def main() -> None:
    top = int(sys.argv[sys.argv.index("--top") + 1]) if "--top" in sys.argv else 30
    torch.manual_seed(0)
    ref = nn.Sequential(*[ResidualBlock(WIDTH) for _ in range(BLOCKS)]).cuda().train()
    x = torch.randn(BATCH, WIDTH, device="cuda", requires_grad=True)
    builds = {
        "eager": lambda m: m,
        "tr.compile, each block": lambda m: chain([tr.compile(b, cache_dir=None) for b in m]),
        "reduce-overhead, each block, step marked": lambda m: marked(chain(
            [torch.compile(b, mode="reduce-overhead") for b in m])),
    }
    for k, (name, build) in enumerate(builds.items()):
        model = fresh_copy(ref, f"p{k}")
        fn = build(model)
        params = list(model.parameters())

        def run():
            fn(x).square().mean().backward()
            for p in params:
                p.grad = None
            x.grad = None

        for _ in range(5):
            run()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(STEPS):
            run()
        host = (time.perf_counter() - t0) / STEPS * 1e6
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(STEPS):
            fn(x)
        forward = (time.perf_counter() - t0) / STEPS * 1e6
        torch.cuda.synchronize()
        print(f"\n=== {name}: {host:.0f} us host per step, {forward:.0f} of it the forward "
              f"(unsynchronized, {STEPS} steps)")
        print("CUDA calls per step:", runtime_calls(run))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(STEPS):
            run()
        prof.disable()
        torch.cuda.synchronize()
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(top)
        stats.sort_stats("cumulative").print_stats("torchreplay|_functorch|_dynamo|_inductor", top)
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip()))


if __name__ == "__main__":
    main()
