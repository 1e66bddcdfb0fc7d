"""Does Dynamo's frame slow the piecewise runtime's own Python? (CPU only; issue 10's k = 2.)

On the H200 (``split_dynamo_stub.py``, session 70) ``tr.compile``'s call costs 13.7 us (k = 1)
and 19.1 us (k = 2) more than Dynamo's part (the runtime stubbed) plus the runtime called alone.
This runs the same three ways on the CPU with no CUDA at all: ``tr.compile`` of the
``compile-split-cost`` MLP (4 x Linear(64)+GELU, FX code, cut once by the custom op at k = 2)
with the runtime's captures replaced by stand-in graphs whose replay does nothing, the CPU
tensors taken for CUDA ones at compile time only, and every node but the splitting op graphed.
What is left is Dynamo's frame and the runtime's Python, interleaved, host us per call in bursts
of 10 (min and median). If the extra stays small here, the GPU's extra is in the calls into
CUDA (the driver and libtorch_cuda), not in our Python.

Usage: ``PYTHONPATH=. python benchmarks/dynamo_runtime_cpu.py [rounds]`` (a diagnostic: it
replaces private functions of torchreplay and ``torch.Tensor.is_cuda`` for its own process).
"""
import sys, time, statistics
from types import SimpleNamespace
sys.path.insert(0, ".")
import torch
from torchreplay.pieces import capturing, runtime as runtime_mod
from torchreplay.pieces.runtime import PiecewiseRuntime
import torchreplay._compat as C

class G:
    def __init__(self, out): self.out = out
    def replay(self): pass
    def reset(self): pass
def cap(fn, args, kwargs, **_):
    with torch.no_grad():
        out = tuple(t.clone() for t in fn(*args))
    return SimpleNamespace(graph=G(out), out=out, seconds=0.0, copies=(), spares=())
class S:
    def synchronize(self): pass
capturing.capture = cap
runtime_mod.side_stream = lambda device: S()
runtime_mod.follow_stream = lambda pool: False
C.direct_replay = lambda g: g.replay
_setup = PiecewiseRuntime._setup
def setup(self, args, device=None):
    real = torch.cuda.is_available
    runtime_mod.torch.cuda.is_available = lambda: True
    try:
        return _setup(self, args, torch.device("cpu"))
    finally:
        runtime_mod.torch.cuda.is_available = real
PiecewiseRuntime._setup = setup

import torchreplay as tr
import importlib
bmod = importlib.import_module("torchreplay.compile.backend")
_bcall = bmod.Backend.__call__
def bcall(self, gm, ex):
    torch.Tensor.is_cuda = property(lambda t: True)
    try:
        return _bcall(self, gm, ex)
    finally:
        del torch.Tensor.is_cuda
bmod.Backend.__call__ = bcall
smod = importlib.import_module("torchreplay.compile.split")
d = list(smod.split_graph.__defaults__); d[-1] = lambda nodes: True; smod.split_graph.__defaults__ = tuple(d)
_why = smod.why_eager
def why(node, ops, device):
    r = _why(node, ops, device)
    return r if r is not None and "splitting op" in str(r) else None
smod.why_eager = why
from torchreplay.models.blocks import SPLIT_STYLES, SplitMLP

REAL = PiecewiseRuntime.__call__
SEEN, STUBBED = [], {}
def spy(self, *a, **k):
    out = REAL(self, *a, **k); SEEN.append((self, a, out)); return out
def stub(self, *a, **k):
    return STUBBED[id(self)]

x = torch.randn(8, 64)
calls = {}
with torch.no_grad():
    for k in (1, 2):
        m = SplitMLP(k, depth=4, width=64).eval()
        c = tr.compile(m, splitting_ops=[SPLIT_STYLES["returns"]], inductor=False)
        for _ in range(3):
            torch.testing.assert_close(c(x), m(x))
        SEEN.clear(); PiecewiseRuntime.__call__ = spy
        try: c(x)
        finally: PiecewiseRuntime.__call__ = REAL
        (rt, args, out), = SEEN
        print(k, rt, rt.stats.replays, [p.graphed for p in rt.program.pieces])
        STUBBED[id(rt)] = out
        def stubbed(c=c):
            PiecewiseRuntime.__call__ = stub
            try: return c(x)
            finally: PiecewiseRuntime.__call__ = REAL
        calls[f"tr.compile k={k}"] = lambda c=c: c(x)
        calls[f"stubbed k={k}"] = stubbed
        calls[f"alone k={k}"] = lambda rt=rt, args=args: rt(*args)
    times = {n: [] for n in calls}
    for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 400):
        for n, f in calls.items():
            t0 = time.perf_counter_ns()
            for _ in range(10): f()
            times[n].append((time.perf_counter_ns() - t0) / 10e3)
for n, ts in times.items():
    print(f"{n:16s} min {min(ts):7.2f} med {statistics.median(ts):7.2f}")
for k in (1, 2):
    w, s, a = (min(times[f"{n} k={k}"]) for n in ("tr.compile", "stubbed", "alone"))
    print(f"k={k}: tr.compile {w:.1f} = stub {s:.1f} + {w - s:.1f} (alone {a:.1f}; extra {w - s - a:+.1f})")
