"""Host time of a compiled call with and without the graphs' own copy nodes (CUDA only;
RESULTS.md, session 63): ``tr.compile`` copies the call's tensors into its first graph's
buffers, and an eager step's value into the next graph's buffer, by nodes of those graphs
pointed at each call's tensors (``_compat/copy_nodes.py``, ``pieces/entries.py``), instead of
a copy launch each. The same model is compiled twice in one process, once with the driver's
copy nodes hidden at its capture (the copying way), and timed call by call interleaved, with
``torch.compile(mode="reduce-overhead")`` as the anchor: host us of one call, a synchronize
before each (``_paired.interleaved(sync_each=True)``), and the paired difference.

Rows: a 3-layer MLP b8 (one graph, one input copy); the same with ``sizes=[2, 4, 8]`` called
with 5 rows (a padded call: 5 rows' bytes); the MLP cut by ``torch.clone`` named as the
splitting op between each two of eight layers (each eager step's new tensor copied into the
next graph).

Usage: ``PYTHONPATH=. python benchmarks/piece_copy_nodes.py [--rounds 300]``
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import torch.nn as nn

import torchreplay as tr
from torchreplay._compat import copy_nodes
from _paired import interleaved

DEV = "cuda"


class Split(nn.Module):
    """``depth`` linear layers, ``between`` after each but the last (default: eight, and
    ``torch.clone``: 8 graphs, 7 eager steps; ``breaks_copy_nodes.py``: a break module)."""

    def __init__(self, between=torch.clone, depth: int = 8) -> None:
        super().__init__()
        self.between = between
        self.first = nn.Linear(64, 128)
        self.layers = nn.ModuleList(nn.Linear(128, 128) for _ in range(depth - 2))
        self.last = nn.Linear(128, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.between(torch.relu(self.first(x)))
        for layer in self.layers:
            h = self.between(torch.relu(layer(h)))
        return self.last(h)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))


def compiled(make, x, nodes: bool, **kw):
    torch.manual_seed(0)
    model = make().to(DEV).eval()
    # a class of its own: tr.compile shares one backend (one runtime, graphs per instance)
    # between instances of a class, and this method's graphs must be captured apart
    model.__class__ = type(f"{type(model).__name__}_{'nodes' if nodes else 'launches'}", (type(model),), {})
    c = tr.compile(model, **kw)
    saved = list(copy_nodes._driver)
    if not nodes:
        copy_nodes._driver[:] = [None]  # hidden at this model's capture only
    try:
        with torch.no_grad():
            for _ in range(3):  # (until its graphs are captured: not at a first call's compile)
                c(x)
                if c.backend.runtimes and c.backend.runtimes[0].stats.captures:
                    break
    finally:
        copy_nodes._driver[:] = saved
    (rt,) = c.backend.runtimes
    assert rt.stats.captures and (rt.stats.graph_copies > 0) == nodes, rt.stats.explain()
    return c, rt


def eager_nodes(rt) -> int:
    return sum(len(g.nodes) for e in rt._entries.values() for g in e.graphs if g is not None)


def rounds() -> int:
    """``--rounds`` from the command line (default 300), once the setup is printed."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=300)
    a = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, copy nodes: {copy_nodes.available()}")
    return a.rounds


def main() -> None:
    n_rounds = rounds()
    rows = [
        ("MLP b8", mlp, 8, {}),
        ("MLP sizes=[2,4,8], 5 rows", mlp, 5, {"sizes": [2, 4, 8]}),
        ("8 layers split by torch.clone (k = 8)", Split, 8, {"splitting_ops": ["torch.clone"]}),
    ]
    for name, make, n, kw in rows:
        torch._dynamo.reset()
        x = torch.randn(n, 64, device=DEV)
        with_nodes, rt1 = compiled(make, x, True, **kw)
        without, rt2 = compiled(make, x, False, **kw)
        torch.manual_seed(0)
        ro_model = make().to(DEV).eval()
        ro = torch.compile(ro_model, mode="reduce-overhead")
        xs = [torch.randn(n, 64, device=DEV) for _ in range(4)]

        def call(f):
            it = iter(range(1 << 30))
            return lambda: f(xs[next(it) % 4])

        with torch.no_grad():
            for f in (with_nodes, without, ro):
                for _ in range(5):
                    f(xs[0])
            for f in (with_nodes, without):
                torch.testing.assert_close(f(xs[1]), ro_model(xs[1]), rtol=2e-3, atol=2e-3)
            print(f"{name}: copied by nodes: {rt1.stats.graph_copies} input(s), "
                  f"{eager_nodes(rt1)} eager value(s); without: {rt2.stats.graph_copies}, {eager_nodes(rt2)}")
            interleaved({"tr.compile, copy nodes": call(with_nodes), "tr.compile, copy launches": call(without),
                         "reduce-overhead": call(ro)}, rounds=n_rounds, calls=10, sync_each=True)


if __name__ == "__main__":
    main()
