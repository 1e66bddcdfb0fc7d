"""ResNet-50 training steps with ``make_graphed_callables`` (the partial-network recipe), torch's
tool against ours in one process, split into their parts (CUDA only; RESULTS.md, sessions 33
and 62): zero_grad, forward and loss, backward, the optimizer step, each timed with a
synchronize before and after (us, median of interleaved steps), then the whole step with no
synchronize inside and its paired difference to torch's tool with eager foreach AdamW (the
``resnet50-train`` bench row's reference).

Methods (each a fresh ResNet-50 from the same seed):

- ``torch MGC + AdamW``: torch's tool, ``zero_grad()`` (to None), eager foreach AdamW;
- ``torch MGC + fused AdamW``: the same with eager ``AdamW(fused=True)``, the fastest eager step;
- ``tr MGC + AdamW``: ours, as torch's first;
- ``tr MGC + graphed step``: ours, ``zero_grad(set_to_none=False)`` and
  ``tr.graph_step(opt.step)`` of ``AdamW(capturable=True, fused=True)`` (the bench row's
  ``tr.make_graphed_callables + graphed AdamW step``);
- ``tr MGC + graphed step, to None``: the same with ``zero_grad()`` to None: the backward's
  gradients become ``.grad`` and the graphed step copies them in.

Usage: ``PYTHONPATH=. python benchmarks/mgc_adamw_split.py [--batch 1,8] [--steps 100]``
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import torchvision

import torchreplay as tr
from _paired import paired_quantiles

PARTS = ("zero", "forward", "backward", "opt.step")
WHOLE = "whole (no sync inside)"


def build(graph, batch: int, fused: bool, graphed_step: bool, to_none: bool):
    """One method: the graphed model, its parameters, the zero_grad and step callables."""
    torch.manual_seed(0)
    model = torchvision.models.resnet50().cuda()
    params = list(model.parameters())
    sample = torch.randn(batch, 3, 224, 224, device="cuda")
    graphed = graph(model, (sample,))
    if not graphed_step:
        # fused=False would also turn off torch's default foreach: None keeps it.
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True if fused else None)
        return graphed, params, (lambda: opt.zero_grad()), opt.step
    opt = torch.optim.AdamW(params, lr=1e-4, capturable=True, fused=True)
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    target = torch.randint(0, 1000, (batch,), device="cuda")
    opt.zero_grad(set_to_none=False)
    torch.nn.functional.cross_entropy(graphed(x), target).backward()
    step = tr.graph_step(opt.step, optimizers=opt)
    return graphed, params, (lambda: opt.zero_grad(set_to_none=to_none)), step


def step(method, x, target, t) -> None:
    model, _, zero, opt_step = method

    def timed(label, f):
        torch.cuda.synchronize()
        s = time.perf_counter()
        out = f()
        torch.cuda.synchronize()
        if t is not None:
            t[label].append((time.perf_counter() - s) * 1e6)
        return out

    timed("zero", zero)
    loss = timed("forward", lambda: torch.nn.functional.cross_entropy(model(x), target))
    timed("backward", loss.backward)
    timed("opt.step", opt_step)
    torch.cuda.synchronize()
    s = time.perf_counter()
    zero()
    torch.nn.functional.cross_entropy(model(x), target).backward()
    opt_step()
    torch.cuda.synchronize()
    if t is not None:
        t[WHOLE].append((time.perf_counter() - s) * 1e6)


def run(batch: int, steps: int) -> None:
    mgc = torch.cuda.make_graphed_callables
    methods = {
        "torch MGC + AdamW": build(mgc, batch, False, False, True),
        "torch MGC + fused AdamW": build(mgc, batch, True, False, True),
        "tr MGC + AdamW": build(tr.make_graphed_callables, batch, False, False, True),
        "tr MGC + graphed step": build(tr.make_graphed_callables, batch, True, True, False),
        "tr MGC + graphed step, to None": build(tr.make_graphed_callables, batch, True, True, True),
    }
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    target = torch.randint(0, 1000, (batch,), device="cuda")
    names = list(methods)
    times = {k: {p: [] for p in PARTS + (WHOLE,)} for k in names}
    for m in methods.values():
        for _ in range(10):
            step(m, x, target, None)
    for r in range(steps):
        for k in names[r % len(names):] + names[:r % len(names)]:
            step(methods[k], x, target, times[k])
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}, ResNet-50 b{batch}, "
          f"us, median of {steps} interleaved steps (parts: synchronized before and after)")
    ref = times[names[0]][WHOLE]
    print(f"   {'method':32s} " + " ".join(f"{p:>9s}" for p in PARTS)
          + f" {'whole':>9s}  paired d vs {names[0]!r}: med [p25, p75]")
    for k in names:
        med, p25, p75 = paired_quantiles(times[k][WHOLE], ref)
        w = statistics.median(times[k][WHOLE])
        print(f"   {k:32s} " + " ".join(f"{statistics.median(times[k][p]):9.1f}" for p in PARTS)
              + f" {w:9.1f}  {med:+8.1f} [{p25:+.1f}, {p75:+.1f}]"
              f"  ({w / statistics.median(ref):.3f}x)")
    print("   grad strides equal to the parameter's:",
          {k: all(p.grad.stride() == p.stride() for p in m[1]) for k, m in methods.items()})
    del methods
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--steps", type=int, default=100)
    a = ap.parse_args()
    for b in a.batch.split(","):
        run(int(b), a.steps)


if __name__ == "__main__":
    main()
