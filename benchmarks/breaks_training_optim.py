"""The fastest training recipe for a model that needs breaks: the HF Llama of
``_llama_train.py`` (4 layers, hidden 512, b4 x 64, fp32), broken at SDPA's kernel op, trained
with ``AdamW(fused=True)``. Interleaved, us per step:

- eager, with an eager AdamW;
- breaks, with an eager AdamW;
- breaks, with the optimizer step graphed alone (``tr.graph_step(opt.step, optimizers=opt)``,
  ``AdamW(capturable=True, fused=True)``): the recipe the README recommends;
- the whole model graphed (``make_graphed_callables``), with an eager AdamW;
- the whole step as one graph (``tr.graph_step``): the bound, where no break is needed.

Usage: ``PYTHONPATH=. python benchmarks/breaks_training_optim.py``"""
import copy

import torch
import torch.nn.functional as F

import torchreplay as tr
from torchreplay.bench.timing import BenchOptions, time_interleaved
from _llama_train import BREAK, llama_and_tokens

OPTS = BenchOptions(repeats=15, calls=20, warmup=5, host_calls=5)
base, ids = llama_and_tokens()


def loss_of(m):
    return F.cross_entropy(m(ids).logits.flatten(0, 1), ids.flatten())


def method(name):
    m = copy.deepcopy(base)
    capturable = name in ("breaks + graphed AdamW", "whole step graphed")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True, capturable=capturable)
    if name.startswith("breaks"):
        tr.make_graphed_callables(m, (ids,), breaks=[BREAK])
    elif name == "whole model graphed":
        tr.make_graphed_callables(m, (ids,))
    if name == "whole step graphed":
        def whole():
            opt.zero_grad(set_to_none=True)
            loss_of(m).backward()
            opt.step()
        return tr.graph_step(whole, optimizers=opt)
    opt_step = opt.step
    if capturable:
        opt.zero_grad(set_to_none=True)
        loss_of(m).backward()
        opt.step()  # (its state exists before the capture)
        opt_step = tr.graph_step(opt.step, optimizers=opt)

    def step():
        opt.zero_grad(set_to_none=True)
        loss_of(m).backward()
        opt_step()
    return step


names = ["eager", "breaks", "breaks + graphed AdamW", "whole model graphed", "whole step graphed"]
calls = {}
for n in names:
    try:
        calls[n] = method(n)
    except Exception as exc:  # noqa: BLE001 - a row that cannot be built says why
        print(f"{n}: {type(exc).__name__}: {str(exc)[:300]}")
res = time_interleaved(calls, OPTS)
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
print("| method (AdamW fused) | step (us) | vs eager | host (us, min) |")
print("|---|---|---|---|")
eager = res["eager"][0] if not isinstance(res.get("eager"), str) else None
for n, r in res.items():
    if isinstance(r, str):
        print(f"| {n} | failed: {r} | | |")
    else:
        print(f"| {n} | {r[0]:.0f} | {eager / r[0]:.2f}x | {r[1]:.0f} |" if eager else f"| {n} | {r[0]:.0f} | | {r[1]:.0f} |")
