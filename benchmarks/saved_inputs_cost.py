"""What saving the caller's tensors at each graphed training call costs (CUDA only).

Since session 59 the autograd node of a ``make_graphed_callables`` call saves the call's own
tensor arguments (``save_for_backward``) so that a backward its backward graph cannot compute
(``create_graph=True``, a second backward, overwritten activations) can run the forward again
(training/recompute.py). Measured here on the chain of ``input_grads_cost.py`` (eight Linear 256
+ Tanh layers at batch 8, graphed by one call, one training step = forward through the chain and
``.sum().backward()``, a synchronize before each step): the node as it is against the node
without the save (its forward replaced in this process), interleaved, host us per step, and
torch's tool as the anchor. Then the cost of a recomputed backward: a gradient-penalty step
(``create_graph=True``) graphed against eager, and the same step graphed whole by
``tr.graph_step`` (the double backward inside the one graph).

Usage: ``PYTHONPATH=. python benchmarks/saved_inputs_cost.py``
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import torch.nn as nn

import torchreplay as tr
from _paired import interleaved as _interleaved
from torchreplay.training import graphed_callable as gc_mod

DEPTH, WIDTH, BATCH = 8, 256, 8


def chain(graph):
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()).cuda() for _ in range(DEPTH)]
    samples = [(torch.randn(BATCH, WIDTH, device="cuda", requires_grad=k > 0),) for k in range(DEPTH)]
    return list(graph(tuple(layers), tuple(samples))), torch.randn(BATCH, WIDTH, device="cuda")


def stepper(layers, x, variant=None):
    params = [p for layer in layers for p in layer.parameters()]
    saving = gc_mod._GraphedFunction.__dict__["forward"]
    use = variant if variant is not None else saving

    def step():
        gc_mod._GraphedFunction.forward = use  # (in every method: the same cost)
        for p in params:
            p.grad = None
        h = x
        for layer in layers:
            h = layer(h)
        h.sum().backward()
        gc_mod._GraphedFunction.forward = saving
    return step


@staticmethod
def _forward_without_save(ctx, runner, outs, *tensors):  # the node before session 59
    ctx.set_materialize_grads(False)
    ctx.runner = runner
    return outs


def interleaved(methods, rounds=200, calls=20):
    """Each call timed alone, after a synchronize (_paired.py)."""
    return _interleaved(methods, rounds, calls, width=34, sync_each=True)


ours_layers, x = chain(tr.make_graphed_callables)
torch_layers, x_t = chain(torch.cuda.make_graphed_callables)
methods = {
    "ours, without the save": stepper(ours_layers, x, _forward_without_save),
    "ours (saves the call's tensors)": stepper(ours_layers, x),
    "torch MGC": stepper(torch_layers, x_t),
}
for f in methods.values():
    for _ in range(20):
        f()
print(f"== host us per training step, chain of {DEPTH} graphed layers ({WIDTH}, batch {BATCH})")
interleaved(methods)

# a gradient-penalty step: every backward of it is recomputed (create_graph, then the loss again)
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1)).cuda()
ref = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1)).cuda()
ref.load_state_dict(net.state_dict())
tr.make_graphed_callables(net, (torch.randn(32, 64, device="cuda"),))
xp = torch.randn(32, 64, device="cuda")


def penalty(m):
    def step():
        for p in m.parameters():
            p.grad = None
        loss = m(xp).pow(2).mean()
        gs = torch.autograd.grad(loss, list(m.parameters()), create_graph=True)
        (loss + sum(g.pow(2).sum() for g in gs)).backward()
    return step


def plain(m):
    def step():
        for p in m.parameters():
            p.grad = None
        m(xp).pow(2).mean().backward()
    return step


pm = {"eager, penalty step": penalty(ref), "graphed, penalty step (recomputed)": penalty(net),
      "eager, plain step": plain(ref), "graphed, plain step": plain(net)}
# the whole penalty step in one graph (tr.graph_step): the double backward is more kernels in it
whole = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1)).cuda()
whole.load_state_dict(ref.state_dict())
try:
    def penalty_of(x):
        for p in whole.parameters():
            p.grad = None
        loss = whole(x).pow(2).mean()
        gs = torch.autograd.grad(loss, list(whole.parameters()), create_graph=True)
        total = loss + sum(g.pow(2).sum() for g in gs)
        total.backward()
        return total
    stepped = tr.graph_step(penalty_of, xp)
    pm["graph_step, penalty step (one graph)"] = lambda: stepped(xp)
except Exception as exc:  # (a row that cannot run is reported, not fatal)
    print(f"graph_step of the penalty step failed: {type(exc).__name__}: {exc}")
import logging
logging.getLogger("torchreplay").setLevel(logging.ERROR)  # the recompute's one warning
for f in pm.values():
    for _ in range(10):
        f()
print("== gradient penalty (create_graph=True) on a 3-layer MLP, host us per step")
interleaved(pm, rounds=60, calls=10)
