"""Benchmark rows: eager vs a hand-written CUDA graph vs ``torch.compile`` vs torchreplay.

Each row builds its workloads (a callable and the arguments of one call) and times, in one
process and on the same tensors, every method:

- ``eager``: ``fn(*args)``.
- ``hand-written CUDAGraph``, the floor for graphs without kernel fusion: static input buffers,
  three warm-up calls on a side stream, capture into ``torch.cuda.CUDAGraph``, and per call only
  ``static_x.copy_(x); g.replay()`` - no argument checks, outputs overwritten by the next replay.
- ``torch.compile reduce-overhead``: ``torch.compile(fn, mode="reduce-overhead")`` (kernel fusion
  and cudagraph trees). A failure is reported as ``failed: <reason>``, never raised.
- ``tr.graph``: ``tr.graph(fn, *args)`` with the default (checked) output policy, and
  ``tr.graph outputs="static"``, the zero-copy policy without checks.
- Many-size rows (``llama-sizes``): ``tr.graph sizes=`` (and its ``outputs="static"``) graph every
  size of :attr:`Workload.sizes`, and the floor is :func:`handwritten_padded`: one graph at the
  padded size (the smallest size that holds the batch), ``static[:n].copy_(x); g.replay()``.

Every inference workload runs under ``torch.no_grad()``.

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

Rows live in :data:`ROWS` (name -> function); later rows (padded sizes, training) add entries there.
Nothing here prints: :mod:`torchreplay.cli` renders the :class:`Measurement` list.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import logging
import platform
import statistics
import time
from types import MappingProxyType
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

import torch

__all__ = [
    "BenchOptions",
    "QUICK",
    "Measurement",
    "Workload",
    "ROWS",
    "METHODS",
    "run",
    "run_factory",
    "time_call",
    "handwritten_graph",
    "handwritten_padded",
    "environment",
    "write_json",
]

log = logging.getLogger(__name__)

EAGER = "eager"
FLOOR = "hand-written CUDAGraph"
COMPILE = "torch.compile reduce-overhead"
TR_GRAPH = "tr.graph"
TR_STATIC = 'tr.graph outputs="static"'
TR_SIZES = "tr.graph sizes="
TR_SIZES_STATIC = 'tr.graph sizes= outputs="static"'
#: Every method, in table order.
METHODS: tuple[str, ...] = (EAGER, FLOOR, COMPILE, TR_GRAPH, TR_STATIC, TR_SIZES, TR_SIZES_STATIC)

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
        error: ``"failed: <reason>"`` when the method could not be built or run.
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


@dataclasses.dataclass(frozen=True)
class Workload:
    """A callable and the arguments of one call, ready on the GPU.

    Args:
        row: the :data:`ROWS` key it belongs to.
        name: shown in the table (model, batch, dtype).
        fn: the callable; an ``nn.Module`` in eval mode for inference rows.
        args, kwargs: one call's arguments (any pytree).
        methods: which of :data:`METHODS` to time.
        sizes: for many-size rows: the ``tr.graph sizes=`` methods graph these sizes (dim 0 of
            every tensor argument varies), and the hand-written floor is one graph at the padded
            size, the smallest of ``sizes`` that holds the batch.
    """

    row: str
    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    methods: tuple[str, ...] = METHODS
    sizes: tuple[int, ...] = ()


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


def _build(method: str, w: Workload) -> Callable[[], Any]:
    fn, args, kwargs = w.fn, w.args, dict(w.kwargs)
    if method == EAGER:
        return lambda: fn(*args, **kwargs)
    if method == FLOOR and w.sizes:
        from torchreplay.bucket_plan import target_size

        padded = target_size(w.sizes, args[0].shape[0])
        assert padded is not None, "a many-size row's batch must fit its largest size"
        return handwritten_padded(fn, args, kwargs, padded)
    if method == FLOOR:
        return handwritten_graph(fn, args, kwargs)
    if method == COMPILE:
        compiled = torch.compile(fn, mode="reduce-overhead")
        return lambda: compiled(*args, **kwargs)
    import torchreplay as tr

    outputs = "static" if method in (TR_STATIC, TR_SIZES_STATIC) else None
    if method in (TR_SIZES, TR_SIZES_STATIC):
        gs = tr.graph(fn, *args, sizes=w.sizes, outputs=outputs, **kwargs)
        return lambda: gs(*args, **kwargs)
    g = tr.graph(fn, *args, outputs=outputs, **kwargs)
    return lambda: g(*args, **kwargs)


def _short_reason(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else ""
    reason = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return "failed: " + (reason if len(reason) <= 120 else reason[:117] + "...")


def _release() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def measure_workload(
    w: Workload, opts: BenchOptions, on_step: StepCallback | None = None
) -> list[Measurement]:
    """Time every method of ``w`` in order and return one :class:`Measurement` per method."""
    raw: list[Measurement] = []
    for method in METHODS:
        if method not in w.methods or (method == COMPILE and not opts.compile):
            continue
        if method in (TR_SIZES, TR_SIZES_STATIC) and not w.sizes:
            continue  # a one-shape workload has no sizes to graph
        if on_step is not None:
            on_step(w.name, method)
        try:
            with torch.no_grad():
                call = _build(method, w)
                for _ in range(opts.compile_warmup if method == COMPILE else 0):
                    call()
                per_call, host, host_median = time_call(call, opts)
            raw.append(Measurement(w.row, w.name, method, per_call, host, host_median))
        except Exception as exc:  # noqa: BLE001 - one failing method must not end the table
            # One line in the table and the log; the traceback only at DEBUG (-vv).
            log.warning("%s / %s %s", w.name, method, _short_reason(exc))
            log.debug("%s / %s failed", w.name, method, exc_info=True)
            raw.append(Measurement(w.row, w.name, method, error=_short_reason(exc)))
        finally:
            call = None  # type: ignore[assignment]  # drop the graph and its pool before the next
            if method == COMPILE:
                torch.compiler.reset()
            _release()
    return _with_ratios(raw)


def _with_ratios(raw: Sequence[Measurement]) -> list[Measurement]:
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


# ---------------------------------------------------------------------------------------------
# Rows


def _inference_row(
    workloads: Iterable[Workload], opts: BenchOptions, on_step: StepCallback | None
) -> Iterator[Measurement]:
    for w in workloads:
        yield from measure_workload(w, opts, on_step)


def _mlp_workloads() -> Iterator[Workload]:
    from torchreplay.models.mlp import MLPConfig, build_mlp

    cfg, batch = MLPConfig(depth=24, width=512), 8
    model = build_mlp(cfg, "cuda", torch.float32).eval()
    x = torch.randn(batch, cfg.width, device="cuda", generator=_cuda_generator())  # [8, 512]
    yield Workload(
        "mlp", f"MLP {cfg.depth} x Linear({cfg.width}, {cfg.width})+ReLU, batch {batch}, fp32", model, (x,)
    )


def _resnet50_workloads() -> Iterator[Workload]:
    from torchreplay.models.cnn import resnet50, resnet50_source

    model = resnet50("cuda", torch.float32).eval()
    x = torch.randn(1, 3, 224, 224, device="cuda", generator=_cuda_generator())  # [1, 3, 224, 224]
    yield Workload("resnet50", f"ResNet-50 ({resnet50_source()}), batch 1, fp32", model, (x,))


#: Batches of the ``llama`` row; the KV cache is sized for the largest.
LLAMA_BATCHES: tuple[int, ...] = (1, 8)


def _llama_workloads() -> Iterator[Workload]:
    from torchreplay.models.llama import LlamaConfig, build_llama

    cfg = LlamaConfig(max_batch=max(LLAMA_BATCHES))
    model = build_llama(cfg, "cuda")  # bf16
    gen = _cuda_generator()
    for batch in LLAMA_BATCHES:
        input_ids = torch.randint(0, cfg.vocab_size, (batch, 1), device="cuda", generator=gen)  # [B, 1]
        # Every call writes the same slot (an idempotent rewrite); the cost does not depend on the
        # position because attention always covers the whole cache.
        positions = torch.full((batch,), cfg.max_seq_len // 2, dtype=torch.long, device="cuda")  # [B]
        name = f"Llama decode ({cfg.n_layers} layers, hidden {cfg.dim}, bf16), batch {batch}"
        yield Workload(
            "llama", name, model, (input_ids, positions),
            methods=(EAGER, FLOOR, TR_GRAPH, TR_STATIC),
        )


#: Batches of the ``llama-sizes`` row: exact sizes, then 13, which pads to 16.
LLAMA_SIZES_BATCHES: tuple[int, ...] = (1, 8, 32, 13)
#: Sizes the ``llama-sizes`` row graphs: ``default_sizes(32)``, i.e. 1, 2, 4, 8, 16, 24, 32.
LLAMA_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32)


def _llama_sizes_workloads() -> Iterator[Workload]:
    from torchreplay.bucket_plan import target_size
    from torchreplay.models.llama import LlamaConfig, build_llama

    cfg = LlamaConfig(max_batch=max(LLAMA_SIZES))
    model = build_llama(cfg, "cuda")  # bf16
    gen = _cuda_generator()
    for batch in LLAMA_SIZES_BATCHES:
        input_ids = torch.randint(0, cfg.vocab_size, (batch, 1), device="cuda", generator=gen)  # [B, 1]
        positions = torch.full((batch,), cfg.max_seq_len // 2, dtype=torch.long, device="cuda")  # [B]
        padded = target_size(LLAMA_SIZES, batch)
        shown = f"batch {batch}" if padded == batch else f"batch {batch} padded to {padded}"
        name = (
            f"Llama decode ({cfg.n_layers} layers, hidden {cfg.dim}, bf16), {shown}, "
            f"sizes {', '.join(map(str, LLAMA_SIZES))}"
        )
        yield Workload(
            "llama-sizes", name, model, (input_ids, positions),
            methods=(EAGER, FLOOR, TR_SIZES, TR_SIZES_STATIC), sizes=LLAMA_SIZES,
        )


def _cuda_generator(seed: int = 0) -> torch.Generator:
    # Inputs from a private generator: the bench leaves the global RNG alone.
    return torch.Generator(device="cuda").manual_seed(seed)


RowFn = Callable[[BenchOptions, Optional[StepCallback]], Iterator[Measurement]]


#: Benchmark rows by name, in table order. A row is a function of the options that yields
#: measurements; it builds its models lazily, so one row's memory is free before the next.
ROWS: Mapping[str, RowFn] = MappingProxyType(
    {
        "mlp": lambda opts, on_step: _inference_row(_mlp_workloads(), opts, on_step),
        "resnet50": lambda opts, on_step: _inference_row(_resnet50_workloads(), opts, on_step),
        "llama": lambda opts, on_step: _inference_row(_llama_workloads(), opts, on_step),
        "llama-sizes": lambda opts, on_step: _inference_row(_llama_sizes_workloads(), opts, on_step),
        # Training rows live in bench_training.py (it imports this module, hence the late import).
        "mlp-train": lambda opts, on_step: _training_row("mlp_train_row", opts, on_step),
        "resnet50-train": lambda opts, on_step: _training_row("resnet50_train_row", opts, on_step),
    }
)


def _training_row(
    name: str, opts: BenchOptions, on_step: StepCallback | None
) -> Iterator[Measurement]:
    from torchreplay import bench_training

    yield from getattr(bench_training, name)(opts, on_step)


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available: the benchmark rows time CUDA graphs and need a GPU")


def run(
    names: Sequence[str] | None = None,
    opts: BenchOptions = BenchOptions(),
    on_step: StepCallback | None = None,
) -> list[Measurement]:
    """Run the rows ``names`` (default: all of :data:`ROWS`) and return every measurement.

    Raises:
        ValueError: a name that is not in :data:`ROWS`.
        RuntimeError: CUDA is not available.
    """
    names = list(ROWS) if names is None else list(names)
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise ValueError(f"unknown benchmark rows {unknown}; choose from {sorted(ROWS)}")
    _require_cuda()
    results: list[Measurement] = []
    for name in names:
        results.extend(ROWS[name](opts, on_step))
        _release()
    return results


def run_factory(
    factory: Callable[[], tuple[Any, ...]],
    label: str,
    opts: BenchOptions = BenchOptions(),
    on_step: StepCallback | None = None,
) -> list[Measurement]:
    """Time a user's ``factory() -> (fn, args)`` or ``(fn, args, kwargs)`` as an inference row.

    The factory must put its tensors on the GPU; ``fn`` is timed under ``torch.no_grad()``.
    """
    _require_cuda()
    fn, args, kwargs = unpack_factory_result(factory(), label)
    return measure_workload(Workload("factory", label, fn, args, kwargs), opts, on_step)


def unpack_factory_result(result: Any, label: str) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """Validate a factory's ``(fn, args)`` / ``(fn, args, kwargs)`` and return all three.

    Raises:
        TypeError: naming ``label`` and what came back instead.
    """
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3):
        raise TypeError(
            f"{label} must return (fn, args) or (fn, args, kwargs), got {type(result).__name__}"
            + (f" of length {len(result)}" if isinstance(result, (tuple, list)) else "")
        )
    fn, args = result[0], result[1]
    kwargs = result[2] if len(result) == 3 else {}
    if not callable(fn):
        raise TypeError(f"{label} returned fn={type(fn).__name__}, which is not callable")
    if not isinstance(args, (tuple, list)):
        raise TypeError(
            f"{label} returned args of type {type(args).__name__}; return a tuple, e.g. (x,)"
        )
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"{label} returned kwargs of type {type(kwargs).__name__}; return a dict")
    return fn, tuple(args), dict(kwargs)


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
