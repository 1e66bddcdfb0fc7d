"""Host time of a ``make_graphed_callables`` call with the forward graph's own copy of its
argument (session 68: the copy is the graph's first node, pointed at the call's tensor) against
the same model built with a copy launch per call (``Inputs.copied_by_graph`` returning nothing,
as before session 68), interleaved in one process, paired differences.

Rows: a forward under ``torch.no_grad()`` (copy-in, replay, outputs), and forward + backward
of a tuple of four layers (each copies its argument in, and its backward the incoming
gradient: "and the backward's" has that copy as the backward graph's first node too; the last
layer's gradient, ``h.sum()``'s, is expanded and still copied by a launch). torch's
``make_graphed_callables`` of the same layers is the reference.

Usage: ``python benchmarks/training_copy_nodes.py``."""
import copy

import torch
import torch.nn as nn

import torchreplay as tr
from torchreplay.core import io
from torchreplay.training import callables

from _paired import interleaved


def layers(seed: int = 0) -> tuple[nn.Module, ...]:
    torch.manual_seed(seed)
    return tuple(nn.Sequential(nn.Linear(512, 512), nn.GELU()).cuda() for _ in range(4))


def build(nodes: str):
    """``nodes``: "none" (a copy launch per call, as before session 68), "forward" (session 68:
    the forward's copies are its nodes, the backward launches its copy) or "both"."""
    mods = layers()
    sample = tuple((torch.randn(8, 512, device="cuda", requires_grad=True),) for _ in mods)
    real_fwd, real_bwd = io.Inputs.copied_by_graph, callables.graph_copyable
    if nodes == "none":  # (this script's switches)
        io.Inputs.copied_by_graph = lambda self: []
    if nodes != "both":
        callables.graph_copyable = lambda statics: False
    try:
        return tr.make_graphed_callables(mods, sample)
    finally:
        io.Inputs.copied_by_graph, callables.graph_copyable = real_fwd, real_bwd


with_launch, with_nodes, with_both = build("none"), build("forward"), build("both")
assert all(m.forward.stats.graph_copies == 1 for m in with_nodes)
assert all(m.forward.stats.graph_copies == 0 for m in with_launch)
assert all(m.forward.stats.grad_copies == 1 for m in with_both)
assert all(m.forward.stats.grad_copies == 0 for m in with_nodes)
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
                 "and the backward's": make(with_both),
                 "torch make_graphed_callables": make(torchs)}, rounds=200, calls=20, width=30)
