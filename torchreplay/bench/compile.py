"""The ``torch.compile`` backend rows (``compile-mlp``, ``compile-if``, ``compile-nonzero``,
``compile-bert``, ``compile-sweep``, ``compile-resnet50``): eager vs torch's own ways to compile
into CUDA graphs vs torchreplay's, on the models of :mod:`torchreplay.models.blocks`.

Methods (each a :class:`Measurement`; a method that fails is a ``failed: <reason>`` entry, never
a crash):

- ``eager``: ``model(*args)``;
- ``hand-written CUDAGraph``: the floor (:func:`~torchreplay.bench.timing.handwritten_graph`),
  only on rows a plain capture can hold (``compile-mlp``, ``compile-resnet50``): a failed capture
  by hand is not undone and would break the process for the other methods;
- ``torch.compile reduce-overhead``: ``torch.compile(model, mode="reduce-overhead")``;
- ``torch.compile backend="cudagraphs"``: ``torch.compile(model, backend="cudagraphs")``;
- ``tr.graph``: ``tr.graph(model, *args)`` (rows of one shape);
- ``tr.compile``: ``tr.compile(model, sizes=...)``, the torchreplay backend; its note gives its
  time over reduce-overhead's and what it made (Dynamo graphs, pieces, graphed pieces, calls that
  ran ungraphed);
- ``tr.compile, fixed shape per size`` (``compile-sweep``): the reference for the sweep (target:
  the sweep within 5% of it): each call of the sweep padded by hand to its size in ``sizes``,
  and run by a ``tr.compile(model)`` of that one shape (one static compile per size, each on a
  Dynamo frame of its own): what compiling each size apart costs, with padding but no routing.

How: in one process, under ``torch.no_grad()``, each method is built and called once on every
input shape in turn; that time, from building to the end of the last first call, synchronized,
is ``first_call_s`` (compile and capture). Then ``compile_warmup`` more rounds over the shapes,
and the methods are timed interleaved (:func:`~torchreplay.bench.timing.time_interleaved`: each
repeat times every method in turn). A row of many shapes (``compile-sweep``) calls them in turn,
one per call, with samples of a whole number of rounds. ``--no-compile`` leaves out torch's two
compile methods; ``tr.compile`` stays. Memory and the cost of a split are in
:mod:`torchreplay.bench.compile_costs`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import logging
import math
import time
import types
from typing import Any, Callable, Iterator

import torch

from torchreplay.bench.inference import COMPILE as REDUCE_OVERHEAD
from torchreplay.bench.inference import TR_GRAPH
from torchreplay.bench.timing import (
    EAGER,
    FLOOR,
    BenchOptions,
    Measurement,
    StepCallback,
    cuda_generator,
    handwritten_graph,
    release,
    short_reason,
    skipped,
    time_interleaved,
    with_ratios,
)

__all__ = [
    "REDUCE_OVERHEAD",
    "CUDAGRAPHS",
    "TR_COMPILE",
    "TR_COMPILE_FIXED",
    "COMPILE_METHODS",
    "CompileWorkload",
    "WORKLOADS",
    "measure_compile_workload",
    "compile_summary",
    "compile_mlp_row",
    "compile_if_row",
    "compile_nonzero_row",
    "compile_bert_row",
    "compile_sweep_row",
    "compile_resnet50_row",
]

log = logging.getLogger(__name__)

CUDAGRAPHS = 'torch.compile backend="cudagraphs"'
TR_COMPILE = "tr.compile"
TR_COMPILE_FIXED = "tr.compile, fixed shape"
#: Every method of the compile rows, in table order.
COMPILE_METHODS: tuple[str, ...] = (
    EAGER, FLOOR, REDUCE_OVERHEAD, CUDAGRAPHS, TR_GRAPH, TR_COMPILE, TR_COMPILE_FIXED
)
_TORCH_COMPILE = (REDUCE_OVERHEAD, CUDAGRAPHS)
#: The compile rows' MLP: 12 x Linear(1024, 1024) + GELU (the ``if`` and ``nonzero`` rows: 2 x 6).
WIDTH, DEPTH, BATCH = 1024, 12, 8
#: ``compile-sweep``: batches 1..16 in turn through ``tr.compile(sizes=SWEEP_SIZES)``.
SWEEP_BATCHES: tuple[int, ...] = tuple(range(1, 17))
SWEEP_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16)


@dataclasses.dataclass(frozen=True)
class CompileWorkload:
    """A model and the arguments of its calls, ready on the GPU.

    Args:
        row: the ``ROWS`` key.
        name: shown in the table.
        model: an ``nn.Module`` in eval mode.
        inputs: the positional arguments of each call; several are called in turn (a sweep).
        methods: which of :data:`COMPILE_METHODS` to time (``tr.graph`` needs one shape, the
            floor a model a plain capture can hold).
        sizes: ``tr.compile(sizes=)``; None: one shape.
        fixed: for :data:`TR_COMPILE_FIXED`: the arguments of each call, in turn (the sweep's,
            padded to their sizes); each shape gets a compile of its own.
    """

    row: str
    name: str
    model: torch.nn.Module
    inputs: tuple[tuple[Any, ...], ...]
    methods: tuple[str, ...] = (EAGER, REDUCE_OVERHEAD, CUDAGRAPHS, TR_GRAPH, TR_COMPILE)
    sizes: tuple[int, ...] | None = None
    fixed: tuple[tuple[Any, ...], ...] | None = None


def _build(method: str, w: CompileWorkload) -> Callable[..., Any]:
    """Return ``fn(*args)`` for ``method``; building may compile or capture."""
    model = w.model
    if method == EAGER:
        return model
    if method == FLOOR:
        replay = handwritten_graph(model, w.inputs[0], {})  # copies from w.inputs[0]'s tensors
        return lambda *args: replay()
    if method == REDUCE_OVERHEAD:
        return torch.compile(model, mode="reduce-overhead")
    if method == CUDAGRAPHS:
        return torch.compile(model, backend="cudagraphs")
    import torchreplay as tr

    if method == TR_GRAPH:
        return tr.graph(model, *w.inputs[0])
    if method == TR_COMPILE:
        return tr.compile(model, sizes=w.sizes)
    if method == TR_COMPILE_FIXED:
        return _compile_per_shape(model)
    raise ValueError(f"unknown compile method {method!r}")


def own_frame(model: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn(*a) = model(*a)`` with a code object of its own, named ``name``: Dynamo keeps the
    cache entries of a ``torch.compile(fn)`` apart from those of other compiles of the same
    model class (they would share one recompile limit, and each call would try the others'
    guards first)."""
    def frame(*a: Any) -> Any:
        return model(*a)

    code = frame.__code__.replace(co_name=name)
    return types.FunctionType(code, frame.__globals__, name, None, frame.__closure__)


def _compile_per_shape(model: Any) -> Callable[..., Any]:
    """``fn(*args)``: ``tr.compile(model)`` for each shape of ``args[0]``, made at its first
    call. Each wraps ``model`` in a function with a code object of its own, so Dynamo keeps its
    cache entries and automatic-dynamic state apart from the other shapes' (else the second
    shape would recompile the first as dynamic, and the entries would count against one
    recompile limit)."""
    import torchreplay as tr

    per_shape: dict[Any, Any] = {}

    def call(*args: Any) -> Any:
        shape = args[0].shape
        fn = per_shape.get(shape)
        if fn is None:
            fn = per_shape[shape] = tr.compile(own_frame(model, f"fixed_{'x'.join(map(str, shape))}"))
        return fn(*args)

    call.compiled = per_shape  # type: ignore[attr-defined]
    return call


def _cycling(fn: Callable[..., Any], inputs: tuple[tuple[Any, ...], ...]) -> Callable[[], Any]:
    if len(inputs) == 1:
        (args,) = inputs
        return lambda: fn(*args)
    turn = itertools.cycle(inputs)
    return lambda: fn(*next(turn))


def _method_inputs(method: str, w: CompileWorkload) -> tuple[tuple[Any, ...], ...]:
    return w.fixed if method == TR_COMPILE_FIXED and w.fixed is not None else w.inputs


def _shown(method: str, w: CompileWorkload) -> str:
    if method == TR_COMPILE and w.sizes:
        return f"{TR_COMPILE} sizes={','.join(map(str, w.sizes))}"
    if method == TR_COMPILE_FIXED and w.fixed is not None:
        sizes = sorted({args[0].shape[0] for args in w.fixed})
        return f"{TR_COMPILE_FIXED}, one compile per size ({','.join(map(str, sizes))})"
    return method


def measure_compile_workload(
    w: CompileWorkload, opts: BenchOptions, on_step: StepCallback | None = None
) -> list[Measurement]:
    """Build every method of ``w`` (timing its first calls), time them interleaved, and return
    one :class:`Measurement` per method in :data:`COMPILE_METHODS` order."""
    methods = [m for m in COMPILE_METHODS
               if m in w.methods and (opts.compile or m not in _TORCH_COMPILE)]
    built: dict[str, Any] = {}
    calls: dict[str, Callable[[], Any]] = {}
    first: dict[str, float] = {}
    errors: dict[str, str] = {}
    fn: Any = None
    torch.compiler.reset()
    try:
        with torch.no_grad():
            for method in methods:
                if on_step is not None:
                    on_step(w.name, method)
                inputs = _method_inputs(method, w)
                try:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    fn = _build(method, w)
                    for args in inputs:
                        fn(*args)
                    torch.cuda.synchronize()
                    first[method] = time.perf_counter() - t0
                    for _ in range(opts.compile_warmup):
                        for args in inputs:
                            fn(*args)
                    built[method] = fn
                    calls[method] = _cycling(fn, inputs)
                except Exception as exc:  # noqa: BLE001 - one failing method must not end the row
                    errors[method] = short_reason(exc)
                    log.warning("%s / %s %s", w.name, method, errors[method])
                    log.debug("%s / %s failed", w.name, method, exc_info=True)
            if on_step is not None:
                on_step(w.name, f"timing {len(calls)} methods interleaved")
            # Samples of whole rounds over the shapes, so every shape counts alike.
            rounds = len(w.inputs)
            timed_opts = dataclasses.replace(opts, calls=math.ceil(opts.calls / rounds) * rounds)
            timings = time_interleaved(calls, timed_opts)
        raw = []
        for method in methods:
            shown = _shown(method, w)
            timing = timings.get(method) if method not in errors else errors[method]
            if isinstance(timing, tuple):
                raw.append(Measurement(w.row, w.name, shown, *timing, first_call_s=first[method]))
            else:
                if method not in errors:
                    log.warning("%s / %s %s", w.name, method, timing)
                raw.append(Measurement(w.row, w.name, shown, error=timing,
                                       first_call_s=first.get(method)))
        return _with_notes(with_ratios(raw), built, w)
    finally:
        fn = None
        built.clear()
        calls.clear()
        torch.compiler.reset()  # drops the compiled code and, with it, its graphs and pools
        release()


def compile_summary(compiled: Any) -> tuple[str, dict[str, float]]:
    """Say what a ``tr.compile`` result made: Dynamo graphs, pieces, graphed pieces, calls that
    ran ungraphed (a piece that failed to capture, a shape above the largest size)."""
    runtimes = compiled.backend.runtimes
    pieces = sum(len(rt.program.pieces) for rt in runtimes)
    graphed = sum(
        p.graphed and k not in rt.failures for rt in runtimes for k, p in enumerate(rt.program.pieces)
    )
    ungraphed = sum(rt.stats.fallbacks for rt in runtimes)
    text = (f"{compiled.backend.compiles} Dynamo graph(s), {pieces} piece(s), {graphed} graphed; "
            f"{ungraphed} piece call(s) ran ungraphed")
    return text, {"dynamo_graphs": compiled.backend.compiles, "pieces": pieces,
                  "graphed_pieces": graphed, "ungraphed_calls": ungraphed}


def _with_notes(results: list[Measurement], built: dict[str, Any], w: CompileWorkload) -> list[Measurement]:
    """Add to ``tr.compile``'s measurement its ratio to reduce-overhead (and, on the sweep, to
    the fixed shape) and what it made."""
    by_method = {m.method: m for m in results}
    ours = by_method.get(_shown(TR_COMPILE, w))
    if ours is None or TR_COMPILE not in built:
        return results
    parts, values = [], {}
    ro, fixed = by_method.get(REDUCE_OVERHEAD), by_method.get(_shown(TR_COMPILE_FIXED, w))
    if ours.per_call_us is not None and ro is not None and ro.per_call_us:
        values["vs_reduce_overhead"] = ours.per_call_us / ro.per_call_us
        parts.append(f"{values['vs_reduce_overhead']:.2f}x reduce-overhead (target <= 1.0x)")
    if ours.per_call_us is not None and fixed is not None and fixed.per_call_us:
        values["vs_fixed_shape"] = ours.per_call_us / fixed.per_call_us
        parts.append(f"{values['vs_fixed_shape']:.2f}x its fixed-shape time (target <= 1.05x)")
    text, counts = compile_summary(built[TR_COMPILE])
    parts.append(text)
    values.update(counts)
    noted = dataclasses.replace(ours, note="; ".join(parts), values=values)
    return [noted if m is ours else m for m in results]


# ---------------------------------------------------------------------------------------------
# Rows


def _x(batch: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(batch, WIDTH, device="cuda", generator=gen)  # [B, 1024]


def _mlp_workloads() -> Iterator[CompileWorkload]:
    from torchreplay.models.blocks import gelu_mlp

    model = gelu_mlp(DEPTH, WIDTH).cuda().eval()
    yield CompileWorkload(
        "compile-mlp", f"MLP {DEPTH} x Linear({WIDTH}, {WIDTH})+GELU, batch {BATCH}, fp32", model,
        ((_x(BATCH, cuda_generator()),),),
        methods=(EAGER, FLOOR, REDUCE_OVERHEAD, CUDAGRAPHS, TR_GRAPH, TR_COMPILE),
    )


def _if_workloads() -> Iterator[CompileWorkload]:
    from torchreplay.models.blocks import DataDependentIf

    yield CompileWorkload(
        "compile-if", f"MLP 2 x {DEPTH // 2} layers, data-dependent `if` between, batch {BATCH}, fp32",
        DataDependentIf(DEPTH // 2, WIDTH).cuda().eval(), ((_x(BATCH, cuda_generator()),),),
    )


def _nonzero_workloads() -> Iterator[CompileWorkload]:
    from torchreplay.models.blocks import NonzeroBetween

    yield CompileWorkload(
        "compile-nonzero",
        f"MLP 2 x {DEPTH // 2} layers, torch.nonzero between (returned too), batch {BATCH}, fp32",
        NonzeroBetween(DEPTH // 2, WIDTH).cuda().eval(), ((_x(BATCH, cuda_generator()),),),
    )


#: ``compile-bert``: batch x sequence, and each row's real length (the rest is padding).
BERT_BATCH, BERT_SEQ, BERT_LENGTHS = 4, 64, (64, 48, 33, 17)
BERT_NAME = (f"BERT (HF BertModel: 4 layers, hidden 256, 4 heads, random weights), batch "
             f"{BERT_BATCH} x seq {BERT_SEQ}, padding mask (lengths {', '.join(map(str, BERT_LENGTHS))}), fp32")


def _bert_workloads() -> Iterator[CompileWorkload]:
    from torchreplay.models.blocks import bert_encoder

    model = bert_encoder().cuda().eval()
    gen = cuda_generator()
    vocab = model.bert.config.vocab_size
    input_ids = torch.randint(0, vocab, (BERT_BATCH, BERT_SEQ), device="cuda", generator=gen)  # [B, S]
    lengths = torch.tensor(BERT_LENGTHS, device="cuda")
    mask = (torch.arange(BERT_SEQ, device="cuda")[None, :] < lengths[:, None]).long()  # [B, S]
    yield CompileWorkload("compile-bert", BERT_NAME, model, ((input_ids, mask),))


def _sweep_workloads() -> Iterator[CompileWorkload]:
    from torchreplay.models.blocks import gelu_mlp

    model = gelu_mlp(DEPTH, WIDTH).cuda().eval()
    gen = cuda_generator()
    largest = max(SWEEP_BATCHES)
    inputs = tuple((_x(b, gen),) for b in SWEEP_BATCHES)
    yield CompileWorkload(
        "compile-sweep",
        f"MLP {DEPTH} x Linear({WIDTH}, {WIDTH})+GELU, batches {min(SWEEP_BATCHES)}..{largest} in "
        f"turn, fp32",
        model,
        inputs,
        methods=(EAGER, REDUCE_OVERHEAD, CUDAGRAPHS, TR_COMPILE, TR_COMPILE_FIXED),
        sizes=SWEEP_SIZES,
        fixed=tuple((_padded(x, SWEEP_SIZES),) for (x,) in inputs),
    )


def _padded(x: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """``x`` with zero rows added up to the smallest of ``sizes`` that holds it."""
    size = min(s for s in sizes if s >= x.shape[0])
    return torch.cat([x, x.new_zeros(size - x.shape[0], *x.shape[1:])])


def _resnet50_workloads() -> Iterator[CompileWorkload]:
    from torchreplay.models.cnn import resnet50, resnet50_source

    x = torch.randn(1, 3, 224, 224, device="cuda", generator=cuda_generator())  # [1, 3, 224, 224]
    yield CompileWorkload(
        "compile-resnet50", f"ResNet-50 ({resnet50_source()}), batch 1, fp32",
        resnet50("cuda", torch.float32).eval(), ((x,),),
        methods=(EAGER, FLOOR, REDUCE_OVERHEAD, CUDAGRAPHS, TR_GRAPH, TR_COMPILE),
    )


#: The workloads of each timed compile row, by row name (built on the GPU when called).
WORKLOADS: dict[str, Callable[[], Iterator[CompileWorkload]]] = {
    "compile-mlp": _mlp_workloads,
    "compile-if": _if_workloads,
    "compile-nonzero": _nonzero_workloads,
    "compile-bert": _bert_workloads,
    "compile-sweep": _sweep_workloads,
    "compile-resnet50": _resnet50_workloads,
}


def _rows(workloads: Callable[[], Iterator[CompileWorkload]], opts: BenchOptions,
          on_step: StepCallback | None) -> Iterator[Measurement]:
    for w in workloads():
        yield from measure_compile_workload(w, opts, on_step)


def compile_mlp_row(opts: BenchOptions, on_step: StepCallback | None) -> Iterator[Measurement]:
    """The ``compile-mlp`` row: a 12-layer GELU MLP, width 1024, batch 8."""
    return _rows(_mlp_workloads, opts, on_step)


def compile_if_row(opts: BenchOptions, on_step: StepCallback | None) -> Iterator[Measurement]:
    """The ``compile-if`` row: a data-dependent ``if`` between two 6-layer blocks."""
    return _rows(_if_workloads, opts, on_step)


def compile_nonzero_row(opts: BenchOptions, on_step: StepCallback | None) -> Iterator[Measurement]:
    """The ``compile-nonzero`` row: ``torch.nonzero`` between two 6-layer blocks, returned too."""
    return _rows(_nonzero_workloads, opts, on_step)


def compile_bert_row(opts: BenchOptions, on_step: StepCallback | None) -> Iterator[Measurement]:
    """The ``compile-bert`` row: Hugging Face's BertModel with a padding mask; one ``skipped``
    entry when ``transformers`` is not installed."""
    if importlib.util.find_spec("transformers") is None:
        reason = "transformers is not installed (pip install transformers), so there is no BertModel"
        log.warning("compile-bert: %s", reason)
        return iter([Measurement("compile-bert", BERT_NAME, "every method", error=skipped(reason))])
    return _rows(_bert_workloads, opts, on_step)


def compile_sweep_row(opts: BenchOptions, on_step: StepCallback | None) -> Iterator[Measurement]:
    """The ``compile-sweep`` row: batches 1..16 in turn through one compile, sizes 1, 2, 4, 8, 16."""
    return _rows(_sweep_workloads, opts, on_step)


def compile_resnet50_row(opts: BenchOptions, on_step: StepCallback | None) -> Iterator[Measurement]:
    """The ``compile-resnet50`` row: ResNet-50 (torchvision's where installed), batch 1, eval."""
    return _rows(_resnet50_workloads, opts, on_step)
