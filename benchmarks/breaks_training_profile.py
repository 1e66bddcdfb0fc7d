"""Where the host time of a training step with breaks goes: HF Llama (4 layers, hidden 512, b4 x
64, fp32) broken at SDPA's kernel op, as in ``breaks_training.py``. Host time per step (no
synchronize inside the loop) for eager, the model graphed whole, and with breaks; then a
cProfile of the steps with breaks, by own time and by cumulative time.

Usage: ``PYTHONPATH=. python benchmarks/breaks_training_profile.py [--steps 200] [--rounds 15]``
(``--steps 0``: the timings alone)
"""
import argparse
import copy
import cProfile
import io
import pstats
import sys

import torch

import torchreplay as tr
from _llama_train import BREAK, block, llama_and_tokens, stepper

print(f"torchreplay from {tr.__file__}")

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=200)
p.add_argument("--top", type=int, default=45)
p.add_argument("--rounds", type=int, default=15)
p.add_argument("--counts", action="store_true", help="how often checked outputs were made anew")
a = p.parse_args()
base, ids = llama_and_tokens()
models = {"eager": copy.deepcopy(base), "whole graph": copy.deepcopy(base), "breaks": copy.deepcopy(base)}
tr.make_graphed_callables(models["whole graph"], (ids,))
tr.make_graphed_callables(models["breaks"], (ids,), breaks=[BREAK])
if a.steps:
    print(tr.explain(models["breaks"]))
steps = {k: stepper(m, ids) for k, m in models.items()}
for s in steps.values():
    for _ in range(5):
        s()
torch.cuda.synchronize()
host = {k: [] for k in steps}
done = {k: [] for k in steps}
for r in range(a.rounds):
    for k, s in steps.items():
        h, d = block(s)
        host[k].append(h)
        done[k].append(d)
for k in steps:
    h, d = sorted(host[k]), sorted(done[k])
    print(f"{k:12s} us/step: host min {h[0]:7.0f} median {h[len(h) // 2]:7.0f}; synchronized min {d[0]:7.0f} median {d[len(d) // 2]:7.0f}")
if a.counts:
    from _counts import new_tensor_counts

    print("breaks, 100 steps: new tensors made by", new_tensor_counts(steps["breaks"]) or "nothing")
if not a.steps:
    sys.exit(0)
runner = models["breaks"].forward
segs = runner.segments
print(f"{len(segs)} segments; params per segment:", [len(getattr(g, '_params', ()) or ()) for g in segs])
prof = cProfile.Profile()
step = steps["breaks"]
torch.cuda.synchronize()
prof.enable()
for _ in range(a.steps):
    step()
torch.cuda.synchronize()
prof.disable()
for key in ("tottime", "cumulative"):
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats(key).print_stats(a.top)
    print(f"== cProfile of {a.steps} steps with breaks, by {key}")
    print("\n".join(l for l in out.getvalue().splitlines() if l.strip())[:12000])
