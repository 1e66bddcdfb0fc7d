"""Host cost of handing a non-leaf input's gradient out under the checked policy (CUDA only).

Eight small layers graphed by one ``tr.make_graphed_callables`` call (one pool), chained, so
seven backwards hand a gradient to the previous layer's output (training/pair.py InputGrads).
One training step per call (gradients set to None, forward through the chain,
``.sum().backward()``), under ``outputs="static"``, the default ``"checked"``, and "checked"
with each non-leaf gradient handed out as the buffer itself (as before InputGrads, and as
torch's tool does), interleaved: 200 rounds of 20 steps, the order rotated each round; the
paired differences (median, 25th and 75th percentile), and torch's ``make_graphed_callables``
on the same chain as the anchor. Each method's first-layer gradient is checked against eager's
first. Usage:
``python benchmarks/input_grads_cost.py [--profile] [--no-gc] [--counts]`` (``--counts``: how many
times ``"checked"`` made new output tensors in 100 steps, by graph).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import torch.nn as nn

import torchreplay as tr
from _paired import interleaved, paired_quantiles
from torchreplay.training.pair import InputGrads

DEPTH, WIDTH, BATCH = 8, 256, 8


def chain(graph) -> tuple[list[nn.Module], torch.Tensor]:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()).cuda() for _ in range(DEPTH)]
    samples = [
        (torch.randn(BATCH, WIDTH, device="cuda", requires_grad=k > 0),) for k in range(DEPTH)
    ]
    graphed = list(graph(tuple(layers), tuple(samples)))
    return graphed, torch.randn(BATCH, WIDTH, device="cuda")


def stepper(layers, x):
    params = [p for layer in layers for p in layer.parameters()]

    def step():  # as a training step after opt.zero_grad(set_to_none=True)
        for p in params:
            p.grad = None
        h = x
        for layer in layers:
            h = layer(h)
        h.sum().backward()
    return step


class Buffers(InputGrads):
    """What a backward handed to a non-leaf input before InputGrads: its buffer, always."""

    def emit(self, pos, static, policy):
        return static


def buffers(layers, samples):
    graphed = tr.make_graphed_callables(layers, samples)
    for layer in graphed:
        layer.forward._input_grads = Buffers("buffers")
    return graphed


chains = {
    "torch MGC": chain(torch.cuda.make_graphed_callables),
    "static": chain(lambda m, s: tr.make_graphed_callables(m, s, outputs="static")),
    "checked, grads as buffers": chain(buffers),
    "checked": chain(tr.make_graphed_callables),
    "eager": chain(lambda m, s: m),
}
methods = {k: stepper(*c) for k, c in chains.items()}
for f in methods.values():
    for _ in range(20):
        f()
want = chains.pop("eager")[0][0][0].weight.grad  # first layer: every gradient flowed through it
for k, (layers, _) in chains.items():
    torch.testing.assert_close(layers[0][0].weight.grad, want, rtol=1e-4, atol=1e-4, msg=k)
del methods["eager"]
if "--no-gc" in sys.argv:  # Python's cyclic collector off while timing
    import gc

    gc.collect()
    gc.disable()
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: {DEPTH} layers, us per step")
s = interleaved(methods, rounds=200, calls=20, width=26, floor="static")
med, p25, p75 = paired_quantiles(s["checked"], s["checked, grads as buffers"])
print(f"  checked - checked with buffers, per step: med {med:+7.2f} p25 {p25:+7.2f} p75 {p75:+7.2f} "
      f"({DEPTH - 1} gradients handed per step)")

if "--counts" in sys.argv:  # how often "checked" made new tensors, per graph's outputs
    from _counts import new_tensor_counts

    print("  checked, 100 steps: new tensors made by", new_tensor_counts(methods["checked"]) or "nothing")

if "--profile" in sys.argv:  # where the host time of a step goes, per method
    import cProfile
    import pstats

    for k in ("torch MGC", "static", "checked"):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(500):
            methods[k]()
        prof.disable()
        torch.cuda.synchronize()
        print(f"--- {k}: 500 steps, by own time")
        pstats.Stats(prof).sort_stats("tottime").print_stats(16)
