"""Old against new library code in one process, interleaved: the training step of
``breaks_training_profile.py`` (HF Llama 4 x 512, b4 x 64, broken at SDPA's kernel op; and the
model graphed whole) built with each of two copies of ``torchreplay``. Each copy is imported
into its own set of modules (``sys.modules`` swapped before each timed block, so a lazy import
finds its own copy), so both run in the same process on the same machine state. The host
figures of separate processes drift more than the changes measured here.

Usage: ``python benchmarks/breaks_training_ab.py --old DIR [--new .] [--rounds 40]``, where DIR
holds an older ``torchreplay`` package (``git archive REV torchreplay | tar -x -C DIR``).
"""
import argparse
import copy
import os
import statistics
import sys

import torch

from _llama_train import BREAK, block, llama_and_tokens, stepper

p = argparse.ArgumentParser()
p.add_argument("--old", required=True)
p.add_argument("--new", default=".")
p.add_argument("--rounds", type=int, default=40)
a = p.parse_args()


def load(path: str):
    """Import the ``torchreplay`` under ``path`` fresh; return it and its modules."""
    for k in [k for k in sys.modules if k == "torchreplay" or k.startswith("torchreplay.")]:
        del sys.modules[k]
    sys.path.insert(0, os.path.abspath(path))
    try:
        import torchreplay
    finally:
        sys.path.pop(0)
    return torchreplay, {k: v for k, v in sys.modules.items() if k == "torchreplay" or k.startswith("torchreplay.")}


def use(mods: dict) -> None:
    for k in [k for k in sys.modules if k == "torchreplay" or k.startswith("torchreplay.")]:
        del sys.modules[k]
    sys.modules.update(mods)


base, ids = llama_and_tokens()


runs = {}  # (lib, method) -> (modules, step)
for lib, path in (("old", a.old), ("new", a.new)):
    tr, mods = load(path)
    print(f"{lib}: torchreplay from {tr.__file__}")
    whole, brk = copy.deepcopy(base), copy.deepcopy(base)
    tr.make_graphed_callables(whole, (ids,))
    tr.make_graphed_callables(brk, (ids,), breaks=[BREAK])
    runs[(lib, "whole graph")] = (mods, stepper(whole, ids))
    runs[(lib, "breaks")] = (mods, stepper(brk, ids))
runs[("-", "eager")] = ({}, stepper(copy.deepcopy(base), ids))
for mods, s in runs.values():
    if mods:
        use(mods)
    for _ in range(5):
        s()
torch.cuda.synchronize()
host = {k: [] for k in runs}
keys = list(runs)
for r in range(a.rounds):
    for k in keys[r % len(keys):] + keys[:r % len(keys)]:
        mods, s = runs[k]
        if mods:
            use(mods)
        host[k].append(block(s)[0])
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; host us per step, {a.rounds} rounds of 10 steps")
for k, v in host.items():
    print(f"  {k[0]:4s} {k[1]:12s} min {min(v):7.0f}  median {statistics.median(v):7.0f}")
for m in ("breaks", "whole graph"):
    d = sorted(n - o for n, o in zip(host[("new", m)], host[("old", m)]))
    print(f"  new - old, {m}: paired median {d[len(d) // 2]:+.0f} us (p25 {d[len(d) // 4]:+.0f}, p75 {d[3 * len(d) // 4]:+.0f})")
