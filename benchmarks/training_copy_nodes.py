"""Host time of a ``make_graphed_callables`` call with the forward graph's own copy of its
argument (session 68: the copy is the graph's first node, pointed at the call's tensor) against
the same model built with a copy launch per call (``Inputs.copied_by_graph`` returning nothing,
as before session 68), interleaved in one process, paired differences.

Rows: a forward under ``torch.no_grad()`` (copy-in, replay, outputs), and forward + backward
of a tuple of four layers (each copies its argument in). torch's ``make_graphed_callables`` of
the same layers is the reference.

Usage: ``python benchmarks/training_copy_nodes.py``."""
import copy

import torch
import torch.nn as nn

import torchreplay as tr
from torchreplay.core import io

from _paired import interleaved


def layers(seed: int = 0) -> tuple[nn.Module, ...]:
    torch.manual_seed(seed)
    return tuple(nn.Sequential(nn.Linear(512, 512), nn.GELU()).cuda() for _ in range(4))


def build(copies: bool):
    mods = layers()
    if copies:
        return tr.make_graphed_callables(mods, tuple((torch.randn(8, 512, device="cuda", requires_grad=True),) for _ in mods))
    real = io.Inputs.copied_by_graph
    io.Inputs.copied_by_graph = lambda self: []  # (this script's switch: a copy launch per call)
    try:
        return tr.make_graphed_callables(mods, tuple((torch.randn(8, 512, device="cuda", requires_grad=True),) for _ in mods))
    finally:
        io.Inputs.copied_by_graph = real


with_nodes, with_launch = build(True), build(False)
assert all(m.forward.stats.graph_copies == 1 for m in with_nodes)
assert all(m.forward.stats.graph_copies == 0 for m in with_launch)
torchs = torch.cuda.make_graphed_callables(
    copy.deepcopy(layers()), tuple((torch.randn(8, 512, device="cuda", requires_grad=True),) for _ in range(4)))
x = torch.randn(8, 512, device="cuda", requires_grad=True)


def forward_only(model):
    def run():
        with torch.no_grad():
            model[0](x)
    return run


def step(model):
    def run():
        h = x
        for m in model:
            h = m(h)
        h.sum().backward()
    return run


for label, make in (("one forward, no_grad", forward_only), ("four layers, forward + backward", step)):
    print(label)
    interleaved({"copy launch (before)": make(with_launch), "graph's own copy node": make(with_nodes),
                 "torch make_graphed_callables": make(torchs)}, rounds=200, calls=20, width=30)
