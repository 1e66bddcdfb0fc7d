"""Where the host time of a training step with breaks goes, by wall-clock timers around our own
parts (no profiler: Python 3.12's cProfile follows the autograd thread too). HF Llama (4 layers,
hidden 512, b4 x 64, fp32) broken at SDPA's kernel op, as in ``breaks_training_profile.py``.
Per step, host us: the forward (the model's call), of which the segments' graphed forwards and
the break calls; the backward (``loss.backward()``), of which the segments' graphed backwards
(our Python, on the autograd thread); and the same split for the model graphed whole.

Usage: ``PYTHONPATH=. python benchmarks/breaks_training_parts.py``
"""
import collections
import copy
import statistics
import time

import torch
import torch.nn.functional as F

import torchreplay as tr
from torchreplay.breaks import training as bt
from torchreplay.training import graphed_callable as gc
from _llama_train import BREAK, llama_and_tokens

base, ids = llama_and_tokens()
spent: collections.Counter = collections.Counter()
calls: collections.Counter = collections.Counter()


def timed(cls, name, key):
    original = getattr(cls, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            spent[key] += time.perf_counter() - t
            calls[key] += 1

    setattr(cls, name, wrapper)


models = {"whole graph": copy.deepcopy(base), "breaks": copy.deepcopy(base)}
tr.make_graphed_callables(models["whole graph"], (ids,))
tr.make_graphed_callables(models["breaks"], (ids,), breaks=[BREAK])
from torchreplay.core import io, outputs, pool as pool_mod  # noqa: E402
from torchreplay.training import pair  # noqa: E402

timed(gc.GraphedCallable, "__call__", "graphed forwards (our call)")
timed(gc.GraphedCallable, "_attach", "  fwd: node window and order")
timed(io.Inputs, "copy_in", "  fwd: copy-in")
timed(outputs.Outputs, "emit", "  fwd+bwd: Outputs.emit")
timed(pool_mod.Pool, "before_replay", "  fwd+bwd: pool.before_replay")
timed(pair.InputGrads, "hand", "  bwd: hand the gradients")
timed(gc, "_graphed_apply", "  fwd: autograd apply")
timed(gc, "follow_stream", "  bwd: follow_stream")


class Replays:
    """Times a runner's graph launches (instance attributes, bound C methods)."""

    def __init__(self, fn, key):
        self.fn, self.key = fn, key

    def __call__(self):
        t = time.perf_counter()
        try:
            return self.fn()
        finally:
            spent[self.key] += time.perf_counter() - t
            calls[self.key] += 1


runners = [models["whole graph"].forward, *models["breaks"].forward.segments]
for r in runners:
    r._fwd_replay = Replays(r._fwd_replay, "  fwd: graph launch")
    r._bwd_replay = Replays(r._bwd_replay, "  bwd: graph launch")
timed(gc.GraphedCallable, "_backward", "graphed backwards (our Python)")
timed(bt.BreakTraining, "_call_break", "break calls")
STEPS = 200
for name, m in models.items():
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    fwd, bwd, rest = [], [], []
    for i in range(STEPS + 20):
        if i == 20:
            spent.clear()
            calls.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(m(ids).logits.flatten(0, 1), ids.flatten())
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if i >= 20:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            rest.append(t3 - t2)
    print(f"== {name}: host us per step (median): forward+loss {statistics.median(fwd) * 1e6:.0f}, "
          f"backward {statistics.median(bwd) * 1e6:.0f}, optimizer step {statistics.median(rest) * 1e6:.0f}")
    for key, s in sorted(spent.items()):
        print(f"   {key}: {s / STEPS * 1e6:.0f} us per step (mean), {calls[key] // STEPS} calls of {s / calls[key] * 1e6:.1f} us")
    spent.clear()
    calls.clear()
