"""The ``resnet50-train`` bench row at batch 1, ``make_graphed_callables`` + eager AdamW, split
into its parts (CUDA only; RESULTS.md, session 33): gradients set to None, forward and loss,
backward, ``opt.step()``, each timed with a synchronize before and after (us, median of
interleaved steps), torch's tool against ours in one process.

Usage: ``PYTHONPATH=. python benchmarks/mgc_adamw_split.py``
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import torchvision

import torchreplay as tr


def build(graph):
    torch.manual_seed(0)
    model = torchvision.models.resnet50().cuda()
    params = list(model.parameters())
    sample = torch.randn(1, 3, 224, 224, device="cuda")
    graphed = graph(model, (sample,))
    return graphed, params, torch.optim.AdamW(params, lr=1e-4)


x = torch.randn(1, 3, 224, 224, device="cuda")
target = torch.randint(0, 1000, (1,), device="cuda")
methods = {
    "torch MGC": build(torch.cuda.make_graphed_callables),
    "ours": build(tr.make_graphed_callables),
}
parts = ("zero", "forward", "backward", "opt.step", "whole (no sync inside)")
times = {k: {p: [] for p in parts} for k in methods}


def step(model, params, opt, t):
    def timed(label, f):
        torch.cuda.synchronize()
        s = time.perf_counter()
        out = f()
        torch.cuda.synchronize()
        if t is not None:
            t[label].append((time.perf_counter() - s) * 1e6)
        return out

    def zero():
        for p in params:
            p.grad = None

    timed("zero", zero)
    loss = timed("forward", lambda: torch.nn.functional.cross_entropy(model(x), target))
    timed("backward", loss.backward)
    timed("opt.step", opt.step)
    torch.cuda.synchronize()
    s = time.perf_counter()
    zero()
    torch.nn.functional.cross_entropy(model(x), target).backward()
    opt.step()
    torch.cuda.synchronize()
    if t is not None:
        t["whole (no sync inside)"].append((time.perf_counter() - s) * 1e6)


for k, m in methods.items():
    for _ in range(10):
        step(*m, None)
names = list(methods)
for r in range(100):
    for k in names[r % 2:] + names[:r % 2]:
        step(*methods[k], times[k])
print(torch.cuda.get_device_name(), torch.__version__, "ResNet-50 b1, us (median of 100, synchronized)")
for p in parts:
    print(f"  {p:24s} " + "  ".join(f"{k} {statistics.median(times[k][p]):8.1f}" for k in names))
g_t = [p.grad for p in methods["torch MGC"][1]]
g_o = [p.grad for p in methods["ours"][1]]
print("grad strides equal to the parameter's:",
      {k: all(g.stride() == p.stride() for g, p in zip(gs, methods[k][1]))
       for k, gs in (("torch MGC", g_t), ("ours", g_o))})
