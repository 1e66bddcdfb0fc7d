"""A custom op's output handed to the next graph where it is (the handoff, ``pieces/handoff.py``)
against copied in by that graph's own first node (``_compat/copy_nodes.py``), as an eager
step's value that is no custom op's already is (CUDA only; issue 10's split cost at k = 2).

The handoff runs the op with its allocations in a private pool (three calls of the caching
allocator around it) and checks, before the next graph, that the output is where the graph reads
it (address, shape, strides, dtype). A copy node costs neither: the next graph copies the op's
output into its own buffer, and a call points the node at it (nothing to do when the caching
allocator gave the same block again), at the price of that copy on the GPU and of the buffer.

The benchmark's MLP (``compile-split-cost``'s: 8 x Linear(1024)+GELU, batch 8) cut into k = 1
and k = 2 pieces by a custom op returning a new tensor, compiled with ``tr.compile``: k = 2
once with the handoff (``pieces/handoff.NODE_BYTES`` at 0 at its first call) and once with the copy node (the default for these 32 KiB values since session 72; the bound raised at its first call for certain); host us a call (a synchronize before each), interleaved, and the split cost of each (k = 2 minus k = 1, paired).

Then the same calls back to back (no synchronize between them): where the GPU is the bound,
that is its time a call, and the node's copy shows in it. ``--batch``: other sizes of the op's
value, to set ``NODE_BYTES`` from measurement.

Usage: ``PYTHONPATH=. python benchmarks/handoff_vs_node.py [--rounds 300] [--batch 8]``
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch

import torchreplay as tr
from torchreplay.bench.compile import BATCH, DEPTH, WIDTH, own_frame
from torchreplay.models.blocks import SPLIT_STYLES, SplitMLP
from torchreplay.pieces import handoff as handoff_mod
from torchreplay.pieces.handoff import Handoff
from _paired import interleaved, paired_quantiles


def compiled(k: int, handoff: bool, x: torch.Tensor):
    torch.manual_seed(0)
    model = SplitMLP(k, DEPTH, WIDTH, style="returns").cuda().eval()
    c = tr.compile(own_frame(model, f"split_{k}_{'handoff' if handoff else 'node'}"),
                   splitting_ops=[SPLIT_STYLES["returns"]])
    saved = handoff_mod.NODE_BYTES  # (read at the first call's capture: the way is kept)
    handoff_mod.NODE_BYTES = 0 if handoff else 1 << 40
    try:
        torch.testing.assert_close(c(x), model(x))
    finally:
        handoff_mod.NODE_BYTES = saved
    (rt,) = c.backend.runtimes
    nodes = sum(len(g.nodes) for e in rt._entries.values() for g in e.graphs if g is not None)
    handed = sum(type(buf) is Handoff for e in rt._entries.values() for g in e.graphs if g is not None
                 for _, buf in g.copies)
    print(f"k = {k}, handoff {handoff}: values handed off {handed}, eager values by node {nodes}, "
          f"captures {rt.stats.captures}")
    return c


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--batch", type=int, default=BATCH,
                    help="rows of the op's value (width 1024, float32: 4 KiB a row; 256 rows: 1 MiB)")
    a = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; the op's value "
          f"{a.batch * WIDTH * 4 / 1024:.0f} KiB")
    x = torch.randn(a.batch, WIDTH, device="cuda")
    with torch.no_grad():
        fs = {"k = 1": compiled(1, True, x), "k = 2, handoff": compiled(2, True, x),
              "k = 2, copy node": compiled(2, False, x)}
        for f in fs.values():
            for _ in range(5):
                f(x)
        calls = {k: (lambda f=f: f(x)) for k, f in fs.items()}
        print("host us a call (a synchronize before each):")
        host = interleaved(calls, rounds=a.rounds, calls=10, sync_each=True)
        print("us a call back to back (the GPU's time where it is the bound):")
        back = interleaved(calls, rounds=a.rounds, calls=10)
    for what, s in (("host", host), ("back to back", back)):
        for k in ("k = 2, handoff", "k = 2, copy node"):
            med, p25, p75 = paired_quantiles(s[k], s["k = 1"])
            print(f"split cost, {what}, {k}: median {med:+.2f} us (p25 {p25:+.2f}, p75 {p75:+.2f})")


if __name__ == "__main__":
    main()
