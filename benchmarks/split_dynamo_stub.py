"""Where issue 10's extra host time at one split (k = 2) goes: ``tr.compile``'s call split into
Dynamo's part and the runtime's part in one process, for the ``compile-split-cost`` MLP
(12 x Linear(1024)+GELU, batch 8) uncut (k = 1) and cut once (k = 2) by a custom op.

Per model, interleaved (``time_interleaved``; host us per call, min and median):
- ``tr.compile``: the whole call;
- ``Dynamo, runtime stubbed``: the same compiled call with ``PiecewiseRuntime.__call__``
  returning the last outputs at once (Dynamo's frame, guards and its call of the runtime);
- ``runtime alone``: the runtime called with the arguments Dynamo passed it, no Dynamo.

If ``tr.compile`` minus the stubbed call exceeds the runtime alone at k = 2 and not at k = 1,
the runtime does more when Dynamo calls it than when called alone (session 64 saw "Dynamo's
side" grow by 7.3 us with one split; ``dynamo_side.py`` found Dynamo's own part flat on CPU).

Usage: ``PYTHONPATH=. python benchmarks/split_dynamo_stub.py``. Needs CUDA."""
from __future__ import annotations

import sys

import torch

sys.path.insert(0, ".")
import torchreplay as tr  # noqa: E402
from torchreplay.bench.timing import BenchOptions, time_interleaved  # noqa: E402
from torchreplay.models.blocks import SPLIT_STYLES, SplitMLP  # noqa: E402
from torchreplay.pieces.runtime import PiecewiseRuntime  # noqa: E402

REAL = PiecewiseRuntime.__call__
STUBBED: dict[int, tuple] = {}  # id(runtime) -> its last outputs, while stubbed


def spy(self, *args, **kwargs):
    out = REAL(self, *args, **kwargs)
    SEEN.append((self, args, out))
    return out


def stub(self, *args, **kwargs):
    return STUBBED[id(self)]


def stubbed(call):
    def run():
        PiecewiseRuntime.__call__ = stub
        try:
            return call()
        finally:
            PiecewiseRuntime.__call__ = REAL
    return run


SEEN: list = []
x = torch.randn(8, 1024, device="cuda")
calls = {}
with torch.no_grad():
    for k in (1, 2):
        model = SplitMLP(k).cuda().eval()
        c = tr.compile(model, splitting_ops=[SPLIT_STYLES["returns"]])
        want = model(x)
        for _ in range(3):
            torch.testing.assert_close(c(x), want)
        SEEN.clear()
        PiecewiseRuntime.__call__ = spy
        try:
            c(x)
        finally:
            PiecewiseRuntime.__call__ = REAL
        (rt, args, out), = SEEN
        STUBBED[id(rt)] = out
        calls[f"tr.compile, k={k}"] = lambda c=c: c(x)
        calls[f"Dynamo, runtime stubbed, k={k}"] = stubbed(lambda c=c: c(x))
        calls[f"runtime alone, k={k}"] = lambda rt=rt, args=args: rt(*args)
        print(f"k={k}: runtime stats {rt.stats}", flush=True)
    res = time_interleaved(calls, BenchOptions(repeats=9, calls=100, warmup=20, host_calls=10))
for name, v in res.items():
    print(f"{name:34s} host min {v[1]:7.1f} us  host median {v[2]:7.1f} us  per call {v[0]:7.1f} us")
for k in (1, 2):
    whole, dyn, alone = (res[f"{w}, k={k}"][1] for w in ("tr.compile", "Dynamo, runtime stubbed", "runtime alone"))
    print(f"k={k}: tr.compile {whole:.1f} = Dynamo {dyn:.1f} + runtime under Dynamo {whole - dyn:.1f} "
          f"(alone {alone:.1f}; difference {whole - dyn - alone:+.1f})")
