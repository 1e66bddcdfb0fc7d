"""Why the piecewise runtime takes longer when ``tr.compile``'s Dynamo frame calls it than when
called alone (issue 10's split cost at k = 2; ``split_dynamo_stub.py`` measured the difference).

For the ``compile-split-cost`` MLP cut once (``SplitMLP(2)``, batch 8, ``--width``), no_grad,
host ns per call in bursts of 10 calls after a synchronize (the first of each burst dropped),
interleaved between ``tr.compile`` and the same runtime called alone with Dynamo's arguments:

1. fixed workloads run first inside the runtime's call (so both see the same state): 200 Python
   calls, 400 ``dict.get`` calls, 100 ``Tensor.data_ptr()`` calls, 3 ``torch.empty(8, "cuda")``;
2. the runtime's own sections (``_route``, ``follow_stream``, ``copy_inputs``, the graph launches,
   the eager steps between graphs, each graph's ``copy_in`` of what they made, ``hand_out``),
   the whole runtime call,
   and what it does besides those;
3. the thread's state inside the call (grad mode, dispatch key sets, torch function state,
   Dynamo's frame callback, profile and trace hooks, ``sys.monitoring`` tools), compared;
4. without Dynamo: the host cost of a graph launch, ``torch.empty``, a copy and a clone with the
   GPU idle and with about 1 ms of work queued ahead.

Usage: ``PYTHONPATH=. python benchmarks/runtime_under_dynamo.py [--width 1024] [--pieces 2]``
(``--pieces 1``: no split). Needs CUDA.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
import torchreplay as tr  # noqa: E402
from torchreplay import _compat  # noqa: E402
from torchreplay.models.blocks import SPLIT_STYLES, SplitMLP  # noqa: E402
from torchreplay.pieces import entries as entries_mod, runtime as runtime_mod  # noqa: E402
from torchreplay.pieces.runtime import PiecewiseRuntime  # noqa: E402

ns = time.perf_counter_ns
parser = argparse.ArgumentParser()
parser.add_argument("--width", type=int, default=1024)
parser.add_argument("--rounds", type=int, default=200)
parser.add_argument("--pieces", type=int, default=2)
opts = parser.parse_args()

small = torch.randn(8, 8, device="cuda")
table = {1: 2}


def _leaf(a: int) -> int:
    return a + 1


def frames() -> None:
    s = 0
    for _ in range(200):
        s = _leaf(s)


def dict_gets() -> None:
    get = table.get
    for _ in range(400):
        get(1)


def data_ptrs() -> None:
    for _ in range(100):
        small.data_ptr()


def cuda_empties() -> None:
    for _ in range(3):
        torch.empty(8, device="cuda")


WORK = {"200 Python calls": frames, "400 dict.get": dict_gets, "100 data_ptr()": data_ptrs,
        "3 torch.empty(cuda)": cuda_empties}
LOG: dict[str, list[int]] = {}


def state() -> dict[str, object]:
    C = torch._C
    d: dict[str, object] = {
        "grad": torch.is_grad_enabled(), "include": str(C._dispatch_tls_local_include_set()),
        "exclude": str(C._dispatch_tls_local_exclude_set()),
        "torch function": (C._is_torch_function_enabled(), C._is_torch_function_mode_enabled()),
        "profile": sys.getprofile(), "trace": sys.gettrace(),
        "frame callback": _compat.eval_frame_callback(), "stream": torch.cuda.current_stream(),
    }
    monitoring = getattr(sys, "monitoring", None)
    if monitoring is not None:
        d["monitoring"] = [(monitoring.get_tool(i), monitoring.get_events(i)) for i in range(6)]
    return d


def timed(name: str, f):
    def g(*a, **k):
        t0 = ns()
        out = f(*a, **k)
        LOG.setdefault(name, []).append(ns() - t0)
        return out
    return g


REAL_CALL = PiecewiseRuntime.__call__
STATES: list[dict[str, object]] = []


def instrumented_call(self, *a, **k):
    STATES.append(state())
    for name, f in WORK.items():
        t0 = ns()
        f()
        LOG.setdefault(name, []).append(ns() - t0)
    t0 = ns()
    out = REAL_CALL(self, *a, **k)
    LOG.setdefault("runtime call", []).append(ns() - t0)
    return out


for section in ("copy_inputs", "hand_out", "follow_stream"):
    setattr(runtime_mod, section, timed(section, getattr(runtime_mod, section)))
PiecewiseRuntime._route = timed("_route", PiecewiseRuntime._route)
entries_mod.PieceGraph.copy_in = timed("graphs' copy_in", entries_mod.PieceGraph.copy_in)
real_direct_replay = _compat.direct_replay
_compat.direct_replay = lambda graph: timed("graph launches", real_direct_replay(graph))

x = torch.randn(8, opts.width, device="cuda")
with torch.no_grad():
    model = SplitMLP(opts.pieces, width=opts.width).cuda().eval()
    compiled = tr.compile(model, splitting_ops=[SPLIT_STYLES["returns"]])
    want = model(x)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), want)
    seen = []

    def spy(self, *a, **k):
        seen.append((self, a))
        return REAL_CALL(self, *a, **k)

    PiecewiseRuntime.__call__ = spy
    compiled(x)
    runtime, args = seen.pop()
    for route in runtime._routes.values():  # the eager steps between graphs, timed
        route.entry.steps = [
            (g, fn if g is not None else timed("eager steps", fn), *rest) for g, fn, *rest in route.entry.steps
        ]
    PiecewiseRuntime.__call__ = instrumented_call
    calls = {"tr.compile": lambda: compiled(x), "runtime alone": lambda: runtime(*args)}
    results: dict[str, dict[str, list[int]]] = {name: {} for name in calls}
    for _ in range(opts.rounds):
        for name, call in calls.items():
            torch.cuda.synchronize()
            for i in range(10):
                LOG.clear()
                t0 = ns()
                call()
                total = ns() - t0
                if i:
                    for key, v in [("whole call", [total]), *LOG.items()]:
                        results[name].setdefault(key, []).append(sum(v))
    torch.cuda.synchronize()
    STATES.clear()
    compiled(x)
    runtime(*args)
    under, alone = STATES
    PiecewiseRuntime.__call__ = REAL_CALL

for name in calls:
    r = results[name]
    inside = [k for k in r if k in ("copy_inputs", "graph launches", "eager steps", "graphs' copy_in", "hand_out",
                                     "follow_stream", "_route")]
    r["runtime, the rest"] = [c - sum(r[k][i] for k in inside) for i, c in enumerate(r["runtime call"])]
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, SplitMLP({opts.pieces}, width={opts.width}), "
      f"host us per call (median)")
print(f"{'':24s} {'runtime alone':>14s} {'tr.compile':>11s} {'ratio':>6s}")
for key in results["runtime alone"]:
    a = statistics.median(results["runtime alone"][key]) / 1000
    b = statistics.median(results["tr.compile"][key]) / 1000
    print(f"{key:24s} {a:14.2f} {b:11.2f} {b / a:6.2f}")
differ = [k for k in alone if alone[k] != under[k]]
print("thread state inside the call, differing:", {k: (alone[k], under[k]) for k in differ} or "none",
      f"(compared: {', '.join(alone)})")

# 4. Without Dynamo: CUDA host calls with the GPU idle and busy.
w = torch.randn(opts.width, opts.width, device="cuda")
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    for _ in range(3):
        x @ w
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    y = x
    for _ in range(6):
        y = torch.nn.functional.gelu(y @ w)
dst = torch.empty_like(x)
ops = {"graph launch": graph.replay, "torch.empty(8, cuda)": lambda: torch.empty(8, device="cuda"),
       "copy_ (8 rows)": lambda: dst.copy_(x), "clone (8 rows)": lambda: x.clone()}
print("without Dynamo, host us per call (median):  GPU idle   ~1 ms queued ahead")
for name, op in ops.items():
    medians = []
    for busy in (False, True):
        samples = []
        for _ in range(300):
            torch.cuda.synchronize()
            if busy:
                torch.cuda._sleep(2_000_000)
            for _ in range(5):
                t0 = ns()
                op()
                samples.append(ns() - t0)
        medians.append(statistics.median(samples) / 1000)
    print(f"  {name:24s} {medians[0]:10.2f} {medians[1]:10.2f}")
torch.cuda.synchronize()
