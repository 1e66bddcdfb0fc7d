"""Where the host time of a chain of ``make_graphed_callables`` goes, ours against torch's
(CUDA only; RESULTS.md, session 33).

The ``input_grads_cost.py`` chain: eight small layers (Linear 256 + Tanh, batch 8) graphed by
one call, chained, one training step per call (gradients set to None, forward through the
chain, ``.sum().backward()``). Printed:

1. the forward and the backward apart, host us per step, interleaved (a synchronize before
   each step, so the queue never throttles the host);
2. ours with its parts timed by wrappers (each wrapper adds well under a microsecond): how
   much of a forward call and of a backward node is which step of ours, and what is left for
   autograd and the engine;
3. ``torch.profiler`` self CPU time per step of the top events for each.

``--resnet50``: one callable, torchvision's ResNet-50 at batch 1, in place of the chain.

Usage: ``PYTHONPATH=. python benchmarks/mgc_host_profile.py [--resnet50]``
"""
from __future__ import annotations

import collections
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import torch.nn as nn

import torchreplay as tr
from torchreplay import _compat
from torchreplay.core import io, outputs, pool
from torchreplay.training import graphed_callable as gc_mod
from torchreplay.training import pair

DEPTH, WIDTH, BATCH = 8, 256, 8


RESNET = "--resnet50" in sys.argv  # one callable: torchvision's ResNet-50, batch 1


def chain(graph):
    torch.manual_seed(0)
    if RESNET:
        import torchvision

        layers = [torchvision.models.resnet50().cuda()]
        samples = [(torch.randn(1, 3, 224, 224, device="cuda"),)]
        x = torch.randn(1, 3, 224, 224, device="cuda")
    else:
        layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()).cuda() for _ in range(DEPTH)]
        samples = [
            (torch.randn(BATCH, WIDTH, device="cuda", requires_grad=k > 0),) for k in range(DEPTH)
        ]
        x = torch.randn(BATCH, WIDTH, device="cuda")
    graphed = list(graph(tuple(layers), tuple(samples)))
    params = [p for layer in layers for p in layer.parameters()]
    return graphed, params, x


def phases(layers, params, x):
    """One step split: (forward host us, backward host us)."""
    for p in params:
        p.grad = None
    t0 = time.perf_counter()
    h = x
    for layer in layers:
        h = layer(h)
    loss = h.sum()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    return (t1 - t0) * 1e6, (t2 - t1) * 1e6


chains = {
    "torch MGC": chain(torch.cuda.make_graphed_callables),
    "static": chain(lambda m, s: tr.make_graphed_callables(m, s, outputs="static")),
    "checked": chain(tr.make_graphed_callables),
}
for c in chains.values():
    for _ in range(20):
        phases(*c)
torch.cuda.synchronize()
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: "
      f"{'ResNet-50 b1' if RESNET else f'{DEPTH} layers'}")

# 1. forward and backward apart
names = list(chains)
fwd = {k: [] for k in names}
bwd = {k: [] for k in names}
for r in range(300):
    for k in names[r % len(names):] + names[:r % len(names)]:
        torch.cuda.synchronize()
        f, b = phases(*chains[k])
        fwd[k].append(f)
        bwd[k].append(b)
torch.cuda.synchronize()
print("host us per step (median, p25, min); a synchronize before each step")
for k in names:
    for label, s in (("forward", fwd[k]), ("backward", bwd[k])):
        q = sorted(s)
        print(f"  {k:10s} {label:8s} med {statistics.median(q):7.1f}  p25 {q[len(q) // 4]:7.1f}  "
              f"min {q[0]:7.1f}")

# 2. ours, parts timed by wrappers
spent: collections.Counter[str] = collections.Counter()
count: collections.Counter[str] = collections.Counter()


def timed(owner, attr, label):
    original = getattr(owner, attr)
    perf = time.perf_counter_ns

    def wrapper(*a, **kw):
        t = perf()
        try:
            return original(*a, **kw)
        finally:
            spent[label] += perf() - t
            count[label] += 1
    setattr(owner, attr, wrapper)
    return original


G = gc_mod.GraphedCallable
wrapped = [
    (G, "__call__", "forward call (all)"),
    (G, "_run", "  _run"),
    (io.Inputs, "copy_in", "    copy_in"),
    (pool.Pool, "before_replay", "    pool.before_replay (fwd+bwd)"),
    (outputs.Outputs, "emit", "    outputs.emit"),
    (G, "_attach", "    _attach (window, sequence nr)"),
    (G, "_backward", "backward node body (all)"),
    (pair.InputGrads, "hand", "    InputGrads.hand"),
    (_compat, "foreach_clone", "      foreach_clone"),
    (pool.Pool, "close_window", "    pool.close_window"),
    (outputs.Outputs, "_new_tensors", "    Outputs._new_tensors (fwd+bwd)"),
    (gc_mod, "one_at_a_time", "    one_at_a_time (incl. _run)"),
    (pool.Pool, "awaits", "    pool.awaits"),
]
why: collections.Counter[str] = collections.Counter()
unheld_original = outputs._unheld


def unheld_why(handed, versions, storages, handles, uses):
    """outputs._unheld, counting which of its conditions said "held" first."""
    ok = unheld_original(handed, versions, storages, handles, uses)
    if not ok:
        t = handed[0]
        for name, bad in (
            ("refcount", sys.getrefcount(t) - 1 != outputs._FREE_REFS),
            ("version", t._version != versions[0]),
            ("use count", outputs._tensor_use_count(t) != 1),
            ("requires_grad", t.requires_grad),
            ("grad", t.grad is not None),
            ("__dict__", bool(t.__dict__)),
        ):
            if bad:
                why[f"{name} (refs {sys.getrefcount(t)}, free {outputs._FREE_REFS})"] += 1
                break
        else:
            why["a storage"] += 1
    return ok


outputs._unheld = unheld_why
originals = [(o, a, timed(o, a, label)) for o, a, label in wrapped]
apply_spent = []
apply_original = gc_mod._GraphedFunction.apply


def apply_timed(*a):
    t = time.perf_counter_ns()
    out = apply_original(*a)
    apply_spent.append(time.perf_counter_ns() - t)
    return out


gc_mod._GraphedFunction.apply = apply_timed
for k in [n for n in names if n != "torch MGC"]:
    spent.clear()
    count.clear()
    why.clear()
    apply_spent.clear()
    # the graphed layers hold bound methods captured at capture: rebind through the class
    graphed, params, x = chains[k]
    steps = 300
    f_total = b_total = 0.0
    for _ in range(steps):
        torch.cuda.synchronize()
        f, b = phases(graphed, params, x)
        f_total += f
        b_total += b
    print(f"--- {k}: us per step ({steps} steps, wrappers on); forward {f_total / steps:.1f}, "
          f"backward {b_total / steps:.1f}")
    for label in [w[2] for w in wrapped]:
        if count[label]:
            print(f"  {label:40s} {spent[label] / 1e3 / steps:8.1f}  ({count[label] // steps} calls)")
    print(f"  {'    _GraphedFunction.apply':40s} {sum(apply_spent) / 1e3 / steps:8.1f}")
    print(f"  reuse refused: {dict(why)}")
gc_mod._GraphedFunction.apply = apply_original
outputs._unheld = unheld_original
for owner, attr, original in originals:
    setattr(owner, attr, original)

# 3. torch.profiler, self CPU per step
from torch.profiler import ProfilerActivity, profile  # noqa: E402

for k in names:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(50):
            phases(*chains[k])
        torch.cuda.synchronize()
    print(f"--- {k}: torch.profiler, self CPU us per step (50 steps)")
    rows = collections.Counter()
    calls = collections.Counter()
    for e in prof.key_averages():
        rows[e.key] += e.self_cpu_time_total
        calls[e.key] += e.count
    for key, us in rows.most_common(18):
        print(f"  {key[:60]:60s} {us / 50:8.1f}  ({calls[key] // 50} per step)")
