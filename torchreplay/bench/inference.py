"""Inference benchmark rows (``mlp``, ``resnet50``, ``llama``, ``llama-sizes``) and a user's
``module:factory``: eager vs a hand-written CUDA graph vs ``torch.compile`` vs torchreplay.

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

How time is measured: :mod:`torchreplay.bench.timing`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from torchreplay.bench.timing import (
    EAGER,
    FLOOR,
    BenchOptions,
    Measurement,
    StepCallback,
    cuda_generator,
    handwritten_graph,
    handwritten_padded,
    release,
    short_reason,
    time_call,
    with_ratios,
)

__all__ = [
    "COMPILE",
    "TR_GRAPH",
    "TR_STATIC",
    "TR_SIZES",
    "TR_SIZES_STATIC",
    "METHODS",
    "Workload",
    "measure_workload",
    "mlp_row",
    "resnet50_row",
    "llama_row",
    "llama_sizes_row",
    "run_factory",
    "unpack_factory_result",
]

log = logging.getLogger(__name__)

COMPILE = "torch.compile reduce-overhead"
TR_GRAPH = "tr.graph"
TR_STATIC = 'tr.graph outputs="static"'
TR_SIZES = "tr.graph sizes="
TR_SIZES_STATIC = 'tr.graph sizes= outputs="static"'
#: Every method, in table order.
METHODS: tuple[str, ...] = (EAGER, FLOOR, COMPILE, TR_GRAPH, TR_STATIC, TR_SIZES, TR_SIZES_STATIC)



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


def _build(method: str, w: Workload) -> Callable[[], Any]:
    fn, args, kwargs = w.fn, w.args, dict(w.kwargs)
    if method == EAGER:
        return lambda: fn(*args, **kwargs)
    if method == FLOOR and w.sizes:
        from torchreplay.sizes.plan import target_size

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
            log.warning("%s / %s %s", w.name, method, short_reason(exc))
            log.debug("%s / %s failed", w.name, method, exc_info=True)
            raw.append(Measurement(w.row, w.name, method, error=short_reason(exc)))
        finally:
            call = None  # type: ignore[assignment]  # drop the graph and its pool before the next
            if method == COMPILE:
                torch.compiler.reset()
            release()
    return with_ratios(raw)


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
    x = torch.randn(batch, cfg.width, device="cuda", generator=cuda_generator())  # [8, 512]
    yield Workload(
        "mlp", f"MLP {cfg.depth} x Linear({cfg.width}, {cfg.width})+ReLU, batch {batch}, fp32", model, (x,)
    )


def _resnet50_workloads() -> Iterator[Workload]:
    from torchreplay.models.cnn import resnet50, resnet50_source

    model = resnet50("cuda", torch.float32).eval()
    x = torch.randn(1, 3, 224, 224, device="cuda", generator=cuda_generator())  # [1, 3, 224, 224]
    yield Workload("resnet50", f"ResNet-50 ({resnet50_source()}), batch 1, fp32", model, (x,))


#: Batches of the ``llama`` row; the KV cache is sized for the largest.
LLAMA_BATCHES: tuple[int, ...] = (1, 8)


def _llama_workloads() -> Iterator[Workload]:
    from torchreplay.models.llama import LlamaConfig, build_llama

    cfg = LlamaConfig(max_batch=max(LLAMA_BATCHES))
    model = build_llama(cfg, "cuda")  # bf16
    gen = cuda_generator()
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
    from torchreplay.sizes.plan import target_size
    from torchreplay.models.llama import LlamaConfig, build_llama

    cfg = LlamaConfig(max_batch=max(LLAMA_SIZES))
    model = build_llama(cfg, "cuda")  # bf16
    gen = cuda_generator()
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


def mlp_row(opts: BenchOptions, on_step: StepCallback | None) -> Iterator[Measurement]:
    """The ``mlp`` row: a 24-layer MLP at batch 8, fp32."""
    return _inference_row(_mlp_workloads(), opts, on_step)


def resnet50_row(opts: BenchOptions, on_step: StepCallback | None) -> Iterator[Measurement]:
    """The ``resnet50`` row: ResNet-50 at batch 1, fp32."""
    return _inference_row(_resnet50_workloads(), opts, on_step)


def llama_row(opts: BenchOptions, on_step: StepCallback | None) -> Iterator[Measurement]:
    """The ``llama`` row: one decode step of the built-in Llama at batch 1 and 8."""
    return _inference_row(_llama_workloads(), opts, on_step)


def llama_sizes_row(opts: BenchOptions, on_step: StepCallback | None) -> Iterator[Measurement]:
    """The ``llama-sizes`` row: the Llama decode step through ``tr.graph(sizes=)``."""
    return _inference_row(_llama_sizes_workloads(), opts, on_step)


def run_factory(
    factory: Callable[[], tuple[Any, ...]],
    label: str,
    opts: BenchOptions = BenchOptions(),
    on_step: StepCallback | None = None,
) -> list[Measurement]:
    """Time a user's ``factory() -> (fn, args)`` or ``(fn, args, kwargs)`` as an inference row.

    The factory must put its tensors on the GPU; ``fn`` is timed under ``torch.no_grad()``.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available: the benchmark rows time CUDA graphs and need a GPU")
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
