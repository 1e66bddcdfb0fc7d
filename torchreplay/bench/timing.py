"""Timing shared by every benchmark row: the options, one measurement, the clock, and the
hand-written CUDA graph that is every row's floor.

How time is measured (:func:`time_call`):

- Per call (synchronized): after ``warmup`` calls, ``repeats`` samples of ``calls`` back-to-back
  calls, each sample from a ``torch.cuda.synchronize()`` to a ``torch.cuda.synchronize()`` before
  the clock (``time.perf_counter``) is read; the median sample divided by ``calls``.
- Host-side time per call, with no sync in the loop: after a synchronize (not timed), the clock
  around issuing ``host_calls`` calls back-to-back, divided by ``host_calls``; the minimum of
  ``max(40, 3 * repeats)`` samples (the median is kept too, as ``host_median_us``). It is what a
  call costs the CPU: Python, argument checks, copy-in and the launch. ``host_calls`` is small
  (10) so the GPU's launch queue never fills: a graph replay is one launch that the GPU runs far
  slower than the CPU issues it, so with a long loop the host would block on a full queue and
  measure GPU time again. For eager calls the GPU keeps up with the host anyway (that is what
  launch-bound means). The minimum, not the median: on an H100 the launch of a graph of a few
  hundred kernels costs the host 40 or 60 us from one sample to the next (driver noise that
  interference only adds to), so the minimum is the stable estimate of a call's own cost, as in
  ``timeit``; the synchronized time per call stays a median.
- Interleaved (:func:`time_interleaved`, the ``compile-*`` rows): the same samples, but each
  repeat takes one sample of every method in turn (a sync before each), so that drift during a
  long row reaches every method alike; a method that raises is reported and dropped.

Nothing in ``bench/`` prints: :mod:`torchreplay.cli` renders the :class:`Measurement` list.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import platform
import statistics
import time
from typing import Any, Callable, Mapping, Sequence

import torch

__all__ = [
    "EAGER",
    "FLOOR",
    "StepCallback",
    "BenchOptions",
    "QUICK",
    "Measurement",
    "time_call",
    "time_interleaved",
    "host_loop_us",
    "host_samples",
    "handwritten_graph",
    "handwritten_padded",
    "short_reason",
    "skipped",
    "release",
    "with_ratios",
    "cuda_generator",
    "environment",
    "write_json",
]

EAGER = "eager"
FLOOR = "hand-written CUDAGraph"

#: Called with (workload name, method) before each method is built and timed.
StepCallback = Callable[[str, str], None]


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """How long to time each method.

    Args:
        repeats: timed samples per method; the median is reported.
        calls: synchronized calls per sample.
        host_calls: calls per host-side sample (no sync inside; keep it small, see module doc).
        warmup: untimed calls before the samples (after any capture or compilation).
        compile: include ``torch.compile(mode="reduce-overhead")`` (slow to compile).
        compile_warmup: calls after ``torch.compile`` before timing; cudagraph trees record on
            the third call or so, so this must be several.
    """

    repeats: int = 7
    calls: int = 100
    host_calls: int = 10
    warmup: int = 10
    compile: bool = True
    compile_warmup: int = 5

    def __post_init__(self) -> None:
        for name in ("repeats", "calls", "host_calls"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup", "compile_warmup"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


#: Few calls per sample, for a quick check that every row runs (``scripts/gpu_test.py``).
QUICK = BenchOptions(repeats=3, calls=20, warmup=5)


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One method on one workload.

    Attributes:
        row: the :data:`ROWS` key (``"mlp"``).
        workload: what ran, with batch and dtype.
        method: one of :data:`METHODS`.
        per_call_us: median synchronized time per call, or None when the method failed.
        host_us: host-side time per call without a sync in the loop (minimum over samples).
        host_median_us: the same, median over samples.
        vs_floor: ``per_call_us`` over the hand-written graph's (1.0 is the floor).
        speedup: eager's ``per_call_us`` over this one.
        host_delta_us: ``host_us`` minus the hand-written graph's.
        error: ``"failed: <reason>"`` when the method could not be built or run, ``"skipped:
            <reason>"`` when it was not run (a package it needs is not installed).
        first_call_s: seconds from building the method to the end of its first call on every
            input shape (compile and capture), where the row measures it.
        note: a derived result shown under the method (a ratio, memory, cost per split).
        values: the note's numbers by name, for JSON (``{"vs_reduce_overhead": 0.97}``).
    """

    row: str
    workload: str
    method: str
    per_call_us: float | None = None
    host_us: float | None = None
    host_median_us: float | None = None
    vs_floor: float | None = None
    speedup: float | None = None
    host_delta_us: float | None = None
    error: str | None = None
    first_call_s: float | None = None
    note: str | None = None
    values: Mapping[str, float] | None = None


# ---------------------------------------------------------------------------------------------
# Timing


def time_call(call: Callable[[], Any], opts: BenchOptions) -> tuple[float, float, float]:
    """Time ``call()``; return us per call: synchronized median, host-side min and median.

    See the module docstring for the method.
    """
    sync = torch.cuda.synchronize
    clock = time.perf_counter
    for _ in range(opts.warmup):
        call()
    sync()
    samples = []
    for _ in range(opts.repeats):
        t0 = clock()
        for _ in range(opts.calls):
            call()
        sync()
        samples.append((clock() - t0) / opts.calls)
    host = []
    for _ in range(host_samples(opts)):
        sync()  # an empty queue before each sample, so it never fills (module doc)
        t0 = clock()
        for _ in range(opts.host_calls):
            call()
        host.append((clock() - t0) / opts.host_calls)
    sync()
    return statistics.median(samples) * 1e6, min(host) * 1e6, statistics.median(host) * 1e6


def time_interleaved(
    calls: Mapping[str, Callable[[], Any]], opts: BenchOptions
) -> dict[str, tuple[float, float, float] | str]:
    """Time every call of ``calls`` as :func:`time_call` does, interleaved.

    Each call gets ``opts.warmup`` calls in turn; then each of the ``repeats`` rounds takes one
    synchronized sample of every call in turn, and each host-side round one host sample of every
    call: a drift of the GPU's clock or of the machine's load during the run reaches every method
    alike, where timing one method after another would charge it to whichever ran last.

    Returns:
        per name: ``(per_call_us, host_us, host_median_us)`` as :func:`time_call`, or the
        :func:`short_reason` of the exception the call raised; a call that raised is not called
        again, and the others go on.
    """
    sync = torch.cuda.synchronize
    clock = time.perf_counter
    failed: dict[str, str] = {}
    samples: dict[str, list[float]] = {name: [] for name in calls}
    host: dict[str, list[float]] = {name: [] for name in calls}

    def sample(name: str, n: int, into: list[float] | None, sync_after: bool) -> None:
        if name in failed:
            return
        call = calls[name]
        try:
            sync()  # the previous method's work is not charged to this one
            t0 = clock()
            for _ in range(n):
                call()
            if sync_after:
                sync()
            if into is not None:
                into.append((clock() - t0) / n)
        except Exception as exc:  # noqa: BLE001 - one failing method must not end the row
            failed[name] = short_reason(exc)

    for name in calls:
        if opts.warmup:
            sample(name, opts.warmup, None, True)
    for _ in range(opts.repeats):
        for name in calls:
            sample(name, opts.calls, samples[name], True)
    for _ in range(host_samples(opts)):
        for name in calls:
            sample(name, opts.host_calls, host[name], False)
    sync()
    out: dict[str, tuple[float, float, float] | str] = {}
    for name in calls:
        if name in failed:
            out[name] = failed[name]
        else:
            out[name] = (statistics.median(samples[name]) * 1e6, min(host[name]) * 1e6,
                         statistics.median(host[name]) * 1e6)
    return out


def host_loop_us(fn: Callable[[], Any], n: int = 2000, samples: int = 15) -> tuple[float, float]:
    """Median and min host us per call of ``fn``, over ``samples`` unsynchronized loops of
    ``n`` calls (synchronized between loops): the host cost of one launch-sized operation."""
    out = []
    for _ in range(samples):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    out.sort()
    return out[len(out) // 2], out[0]


def host_samples(opts: BenchOptions) -> int:
    """Return how many host-side samples :func:`time_call` takes."""
    return max(40, 3 * opts.repeats)


def handwritten_graph(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any], num_warmup_iters: int = 3
) -> Callable[[], Any]:
    """Capture ``fn(*args, **kwargs)`` the way torch's documentation does, and return the replay.

    The returned zero-argument callable copies the current values of ``args``' tensors into the
    static buffers and replays: the least work a graph call can do, so it is the floor.
    """
    from torchreplay._compat import tree_flatten, tree_unflatten

    leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
    static = [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves]
    static_args, static_kwargs = tree_unflatten(static, spec)
    pairs = [(s, x) for s, x in zip(static, leaves) if isinstance(x, torch.Tensor)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(num_warmup_iters):
            fn(*static_args, **static_kwargs)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = fn(*static_args, **static_kwargs)

    if len(pairs) == 1:
        (static_x, x), replay = pairs[0], g.replay

        def call() -> Any:
            static_x.copy_(x)
            replay()
            return static_out

        return call

    def call_many() -> Any:
        for s, x in pairs:
            s.copy_(x)
        g.replay()
        return static_out

    return call_many


def handwritten_padded(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    size: int,
    num_warmup_iters: int = 3,
) -> Callable[[], Any]:
    """Capture ``fn`` at ``size`` rows and return a padded call, as a hand-written server does.

    Every tensor argument's dim 0 is the batch. The static buffers have ``size`` rows (padding
    rows zero); per call: ``static[:n].copy_(x)`` per tensor, ``g.replay()``, and the output's
    first ``n`` rows. With ``n == size`` it does what :func:`handwritten_graph` does.
    """
    from torchreplay._compat import tree_flatten, tree_unflatten

    leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
    static: list[Any] = []
    pairs = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            buf = x.new_zeros((size, *x.shape[1:]))
            buf[: x.shape[0]].copy_(x)
            pairs.append((buf[: x.shape[0]], x))
            static.append(buf)
        else:
            static.append(x)
    static_args, static_kwargs = tree_unflatten(static, spec)
    n = pairs[0][1].shape[0]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(num_warmup_iters):
            fn(*static_args, **static_kwargs)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = fn(*static_args, **static_kwargs)
    replay = g.replay

    def call() -> Any:
        for dst, x in pairs:
            dst.copy_(x)
        replay()
        return static_out[:n]

    return call


def short_reason(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else ""
    reason = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return "failed: " + (reason if len(reason) <= 120 else reason[:117] + "...")


def skipped(reason: str) -> str:
    """Return the ``error`` of a method that was not run: ``"skipped: <reason>"``."""
    return "skipped: " + reason


def release() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def with_ratios(raw: Sequence[Measurement]) -> list[Measurement]:
    by_method = {m.method: m for m in raw if m.per_call_us is not None}
    floor, eager = by_method.get(FLOOR), by_method.get(EAGER)
    out = []
    for m in raw:
        if m.per_call_us is None:
            out.append(m)
            continue
        out.append(
            dataclasses.replace(
                m,
                vs_floor=m.per_call_us / floor.per_call_us if floor else None,
                speedup=eager.per_call_us / m.per_call_us if eager else None,
                host_delta_us=(m.host_us - floor.host_us) if floor and m.host_us is not None else None,
            )
        )
    return out


def cuda_generator(seed: int = 0) -> torch.Generator:
    # Inputs from a private generator: the bench leaves the global RNG alone.
    return torch.Generator(device="cuda").manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# Results


def environment() -> dict[str, Any]:
    """Return what the numbers depend on: GPU, torch and CUDA versions, date."""
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "gpu": None,
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def write_json(path: str, results: Sequence[Measurement], opts: BenchOptions) -> None:
    """Write ``{"environment", "options", "results"}`` to ``path``."""
    doc = {
        "environment": environment(),
        "options": dataclasses.asdict(opts),
        "results": [dataclasses.asdict(m) for m in results],
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
