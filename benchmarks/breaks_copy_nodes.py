"""Host time of a breakable graph's call with and without its segments' own copy nodes (CUDA
only; RESULTS.md, session 71): ``tr.graph(..., breaks=)`` copies the call's tensors into its
buffers by the first segment's nodes, and each break's new tensors into the buffers of the
segment after it by that segment's nodes, pointed at each call's tensors
(``_compat/copy_nodes.py``), instead of a copy launch each. The same model is graphed twice in one
process, once with the driver's copy nodes hidden at its capture (the copying way), and timed
call by call interleaved, with the whole-callable ``tr.graph`` of the same work (the break
captured too: it can be) as the anchor: host us of one call, a synchronize before each
(``_paired.interleaved(sync_each=True)``), and the paired difference.

Rows: a 3-layer MLP b8 with one break of device work between its layers; the same with
``sizes=[2, 4, 8]`` called with 5 rows (a padded call: 5 rows' bytes); the same with a second
tensor argument that only the break reads; five layers with a break between each two (4 breaks).

Usage: ``PYTHONPATH=. python benchmarks/breaks_copy_nodes.py [--rounds 300]``
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import torch.nn as nn

import torchreplay as tr
from torchreplay._compat import copy_nodes
from _paired import interleaved
from piece_copy_nodes import Split, rounds

DEV = "cuda"


def doubled_tanh(x: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
    """The break: device work only."""
    y = torch.tanh(x) * 2
    return y if shift is None else y + shift


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 128)
        self.b = nn.Linear(128, 32)

    def forward(self, x: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
        return self.b(doubled_tanh(torch.relu(self.a(x)), shift))


class DoubledTanh(nn.Module):
    """The same break as a module, named in ``breaks=`` by its class."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return doubled_tanh(x)


def deep() -> nn.Module:
    """Five layers, the break between each two: 5 segments, 4 breaks."""
    return Split(DoubledTanh(), depth=5)


def graphed(model, args, nodes: bool, **kw):
    saved = list(copy_nodes._driver)
    if not nodes:
        copy_nodes._driver[:] = [None]  # hidden at this graph's capture only
    try:
        g = tr.graph(model, *args, **kw)
    finally:
        copy_nodes._driver[:] = saved
    assert (g.stats.graph_copies > 0) == nodes, g.stats.explain()
    return g


def break_nodes(g) -> int:
    """The breaks' outputs the segments after them copy in by their own nodes (one entry)."""
    (entry,) = g.runtime._entries.values()
    return sum(len(p.nodes) for p in entry.graphs if p is not None)


def main() -> None:
    n_rounds = rounds()
    rows = [
        ("MLP b8, one break", Net, 8, {}, False),
        ("MLP sizes=[2,4,8], 5 rows, one break", Net, 5, {"sizes": [2, 4, 8]}, False),
        ("MLP b8, one break, a second argument the break reads", Net, 8, {}, True),
        ("5 layers b8, 4 breaks", deep, 8, {}, False),
    ]
    for name, make, n, kw, shifted in rows:
        kw = {"breaks": [DoubledTanh if make is deep else doubled_tanh], **kw}
        torch.manual_seed(0)
        model = make().to(DEV).eval()
        sample = [torch.randn(8 if "sizes" in kw else n, 64, device=DEV)] + ([torch.randn(128, device=DEV)] if shifted else [])
        with_nodes = graphed(model, sample, True, **kw)
        without = graphed(model, sample, False, **kw)
        whole = tr.graph(model, *sample, **{k: v for k, v in kw.items() if k != "breaks"})
        calls = [[torch.randn(n, 64, device=DEV)] + ([torch.randn(128, device=DEV)] if shifted else [])
                 for _ in range(4)]

        def call(f):
            it = iter(range(1 << 30))
            return lambda: f(*calls[next(it) % 4])

        with torch.no_grad():
            for f in (with_nodes, without, whole):
                torch.testing.assert_close(f(*calls[1]), model(*calls[1]), rtol=1e-4, atol=1e-4)
            print(f"{name}: copied by nodes: {with_nodes.stats.graph_copies} input(s), "
                  f"{break_nodes(with_nodes)} break output(s); without: {without.stats.graph_copies}, "
                  f"{break_nodes(without)}")
            interleaved({"breaks=, copy nodes": call(with_nodes), "breaks=, copy launch": call(without),
                         "tr.graph, whole (anchor)": call(whole)}, rounds=n_rounds, calls=10, sync_each=True)


if __name__ == "__main__":
    main()
