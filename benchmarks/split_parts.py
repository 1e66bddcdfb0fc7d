"""Where the first split's fixed cost lives in the piecewise runtime alone (issue 10, k = 2).

``compile-split-cost`` puts the first split at about 26 us of host time and each later one at
about 17 (session 72), so about 9 us come with the first eager step and not with later ones.
This times the runtime without Dynamo or Inductor on hand-built programs of the same work (a
chain of 12 Linear(1024)+GELU at batch 8, as one graph or cut in equal parts), in one process, interleaved, host
us per call in bursts of 10 calls after a synchronize (the first of each burst dropped):

- ``[G]``: the whole chain, one graph;
- ``[G, G]``: the two halves as two graphed pieces (a second launch, no eager step);
- ``[G, E, G]`` with the eager step: ``ref`` (returns a tensor made once: no allocation, no
  kernel; the next graph's node points at it), ``empty`` (``torch.empty_like``: an allocation,
  freed after the next graph), ``clone`` (``Tensor.clone``: an allocation and a kernel);
- ``[G, E, G, E, G]`` with ``clone``: a second split, for the per-split cost past the first;
- the ``clone`` alone, outside any runtime.

``--pressure``: before each timed call, a call of a small ``torch.compile``d function (its
guards, frames and an op on a CPU tensor: about what Dynamo's frame does around ``tr.compile``'s
runtime), each runtime call timed alone: does the first split cost more than the second when
the CPU's caches are shared with such work (the hypothesis of session 70)?

Usage: ``PYTHONPATH=. python benchmarks/split_parts.py [--rounds 300] [--pressure]`` (CUDA only).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from torchreplay.config import GraphConfig  # noqa: E402
from torchreplay.core.pool import Pool  # noqa: E402
from torchreplay.pieces.program import Input, Piece, Program  # noqa: E402
from torchreplay.pieces.runtime import PiecewiseRuntime  # noqa: E402

WIDTH, BATCH, DEPTH = 1024, 8, 12  # (12: split in 1, 2 or 3 graphs of equal work)


def chain():
    def run(x, *params):
        for w in params:
            x = torch.nn.functional.gelu(x @ w)
        return (x,)
    return run


def build(layout: str, ws: list[torch.Tensor], step: str) -> PiecewiseRuntime:
    """``layout``: G, GG, GEG or GEGEG; the weights are static inputs 1..DEPTH."""
    made = torch.randn(BATCH, WIDTH, device="cuda")
    steps = {
        "ref": lambda h: (made,),
        "empty": lambda h: (torch.empty_like(h),),
        "clone": lambda h: (h.clone(),),
    }
    inputs = (Input("x", "tensor"), *(Input(f"w{i}", "static") for i in range(DEPTH)))
    graphs = layout.count("G")
    per = DEPTH // graphs
    pieces, slot, value = [], len(inputs), 0
    for k, kind in enumerate(layout):
        if kind == "G":
            g = layout[:k].count("G")
            wslots = tuple(range(1 + g * per, 1 + (g + 1) * per))
            pieces.append(Piece(chain(), (value, *wslots), (slot,), True, f"piece {k}"))
        else:
            pieces.append(Piece(steps[step], (value,), (slot,), False, f"step {k}"))
        value, slot = slot, slot + 1
    program = Program(inputs, pieces, (value,))
    return PiecewiseRuntime(program, name=f"{layout}-{step}", config=GraphConfig(), pool=Pool())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--pressure", action="store_true")
    a = ap.parse_args()
    cpu = torch.randn(64)
    noise = torch.compile(lambda t: (t * 2 + 1).sum(), backend="eager", dynamic=False) if a.pressure else None
    if noise is not None:
        noise(cpu)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    torch.manual_seed(0)
    ws = [torch.randn(WIDTH, WIDTH, device="cuda") / WIDTH ** 0.5 for _ in range(DEPTH)]
    x = torch.randn(BATCH, WIDTH, device="cuda")
    ref = chain()(x, *ws)[0]
    h = torch.randn(BATCH, WIDTH, device="cuda")
    fs = {}
    with torch.no_grad():
        for layout, step in [("G", "-"), ("GG", "-"), ("GEG", "ref"), ("GEG", "empty"), ("GEG", "clone"),
                             ("GEGEG", "clone")]:
            rt = build(layout, ws, step)
            out = rt(x, *ws)[0]
            if step in ("-", "clone"):
                torch.testing.assert_close(out, ref)
            fs[f"{layout} {step}"] = (lambda rt=rt: rt(x, *ws))
        fs["clone alone"] = lambda: h.clone()
        times = {k: [] for k in fs}
        for _ in range(a.rounds):
            for k, f in fs.items():
                torch.cuda.synchronize()
                f()
                if noise is not None:  # each call timed alone, after the compiled function
                    for _ in range(10):
                        noise(cpu)
                        t0 = time.perf_counter_ns()
                        f()
                        times[k].append((time.perf_counter_ns() - t0) / 1e3)
                    continue
                t0 = time.perf_counter_ns()
                for _ in range(10):
                    f()
                times[k].append((time.perf_counter_ns() - t0) / 10e3)
        torch.cuda.synchronize()
    base = statistics.median(times["G -"])
    for k, ts in times.items():
        med = statistics.median(ts)
        print(f"  {k:14s} min {min(ts):7.2f}  med {med:7.2f}  vs [G] {med - base:+7.2f}")


if __name__ == "__main__":
    main()
