"""Where the 32-size breakable build of the built-in Llama spends its host time, without a
profiler's distortion: named functions are wrapped with wall-clock timers (inclusive: a part
inside another counts in both), the build is run once to meet every shape, then three times
timed; the parts of the last build are printed with their call counts.

Usage: ``python benchmarks/breaks_build_parts.py`` (``SDPA=efficient`` pins the attention kernel
as ``breaks_build.py`` does)."""
import contextlib
import functools
import importlib
import os
import time
from collections import defaultdict

import torch

from torchreplay.bench.breaks import _capture_sizes, _inputs
from torchreplay.models import build_llama

spent: dict[str, float] = defaultdict(float)
calls: dict[str, int] = defaultdict(int)


def timed(owner, attr, label):
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[label] += time.perf_counter() - t0
            calls[label] += 1

    setattr(owner, attr, wrapper)


PARTS = [
    ("torch.cuda.graphs:CUDAGraph", "capture_begin", "CUDAGraph.capture_begin"),
    ("torch.cuda.graphs:CUDAGraph", "capture_end", "CUDAGraph.capture_end"),
    ("torch.cuda.graphs:CUDAGraph", "replay", "CUDAGraph.replay"),
    ("torch.cuda", "synchronize", "torch.cuda.synchronize"),
    ("torchreplay.breaks.graph:BreakableGraph", "__init__", "BreakableGraph.__init__ (plan, sample)"),
    ("torchreplay.breaks.graph:BreakableGraph", "_plan", "BreakableGraph._plan"),
    ("torchreplay.breaks.runtime:BreakableRuntime", "_capture_batch", "BreakableRuntime._capture_batch"),
    ("torchreplay.breaks.runtime:BreakableRuntime", "_capture_key", "BreakableRuntime._capture_key"),
    ("torchreplay.breaks.runtime:BreakableRuntime", "_run_break", "._run_break (cut, replay, break)"),
    ("torchreplay.breaks.runtime:BreakableRuntime", "_check_padding", "._check_padding"),
    ("torchreplay.breaks.runtime:BreakableRuntime", "_sources", "._sources"),
    ("torchreplay.breaks.runtime:BreakableRuntime", "_seal", "._seal"),
    ("torchreplay.breaks.runtime:BreakableRuntime", "_learn_output_dims", "._learn_output_dims"),
    ("torchreplay.breaks.runtime", "capture", "core.capture.capture"),
    ("torchreplay.breaks.runtime", "same_path", "same_path"),
    ("torchreplay.breaks.graph:StateSnapshot", "__init__", "StateSnapshot.__init__"),
    ("torchreplay.breaks.graph:StateSnapshot", "restore", "StateSnapshot.restore"),
    ("torchreplay.breaks.graph:Placed", "of", "Placed.of"),
    ("torchreplay.core.effects:PyState", "take", "PyState.take (walk)"),
    ("torchreplay.core.effects:PyState", "verdict", "PyState.verdict"),
    ("torchreplay.core.effects:PyState", "put_back_tensors", "PyState.put_back_tensors"),
    ("torchreplay.core.padcheck", "fingerprint", "padcheck.fingerprint"),
    ("torchreplay.core.padcheck:StateCheck", "after_first", "StateCheck.after_first"),
    ("torchreplay.core.padcheck:StateCheck", "after_second", "StateCheck.after_second"),
    ("torchreplay.core.padcheck:StateCheck", "compare_first", "StateCheck.compare_first"),
    ("torchreplay.core.padcheck:StateCheck", "compare_second", "StateCheck.compare_second"),
    ("torchreplay.breaks.plan:Recorder", "__call__", "Recorder.__call__"),
    ("torchreplay.pieces.runtime:PiecewiseRuntime", "_stage", "PiecewiseRuntime._stage"),
    ("torchreplay.models.llama:Llama", "forward", "Llama.forward (the breaks inside)"),
    ("torchreplay.core.capture:Segments", "cut", "Segments.cut"),
    ("torchreplay.core.capture:Segments", "resume", "Segments.resume"),
]


def resolve(spec):
    mod, _, cls = spec.partition(":")
    owner = importlib.import_module(mod)
    return getattr(owner, cls) if cls else owner


for spec, attr, label in PARTS:
    try:
        timed(resolve(spec), attr, label)
    except (AttributeError, ImportError) as exc:
        print(f"not timed: {label}: {exc}")

modes: set[tuple[int, int]] = set()  # (function modes, dispatch modes) seen by a layer


def _seen(fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        modes.add((torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()))
        return fn(*a, **k)
    return wrapper


from torchreplay.models import llama as _llama  # noqa: E402

_llama.Attention.forward = _seen(_llama.Attention.forward)
model = build_llama(device="cuda")
pinned = contextlib.nullcontext()
if os.environ.get("SDPA") == "efficient":
    from torch.nn.attention import SDPBackend, sdpa_kernel

    pinned = sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION)
with torch.no_grad(), pinned:
    model(*_inputs(model, 1))
    torch.cuda.synchronize()
    first, _ = _capture_sizes(model)
    first_spent, first_calls = dict(spent), dict(calls)
    times = []
    for _ in range(3):
        spent.clear()
        calls.clear()
        modes.clear()
        s, n = _capture_sizes(model)
        times.append(s)
    build_modes = sorted(modes)
    # the floor: the same forwards run eagerly, one per size
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for b in range(1, 33):
        model(*_inputs(model, b))
    torch.cuda.synchronize()
    eager = time.perf_counter() - t0
print(f"modes seen by the attention layers in the last build (function, dispatch): {build_modes}")
print(f"32 eager forwards (sizes 1..32, inputs made inside): {eager:.3f} s")
print(f"SDPA={os.environ.get('SDPA', 'default')}: first {first:.3f} s, again {['%.3f' % t for t in times]} s, captures {n}")
print(f"{'part (inclusive)':52s} {'last build (s)':>14s} {'calls':>6s} {'first build (s)':>15s} {'calls':>6s}")
for label, s in sorted(spent.items(), key=lambda kv: -kv[1]):
    print(f"{label:52s} {s:14.3f} {calls[label]:6d} {first_spent.get(label, 0):15.3f} {first_calls.get(label, 0):6d}")
