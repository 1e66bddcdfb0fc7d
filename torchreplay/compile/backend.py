"""``torch.compile(model, backend="torchreplay")``: Inductor's fused kernels in CUDA graphs, in
pieces around what cannot be captured, every size from one compile.

Dynamo hands the backend one FX graph per region between its own graph breaks. For each, this
module: splits the graph (:mod:`torchreplay.compile.split`) at the user's ``splitting_ops`` and at
what a CUDA graph cannot hold; compiles each capturable piece with Inductor; finds which inputs
are parameters (read in place), which are arguments (copied in) and which arguments the graph
writes (a fake run, reading version counters: the write is copied back into the caller's tensor,
never a skipped graph); finds the dynamic dimension from the graph's symbolic shapes; and hands
the pieces to the piecewise runtime (:mod:`torchreplay.pieces`), which captures every listed size
at the first call and pads each call to the next size.

Why an FX split and not Inductor's own partitions: the split sees the user's nodes with their
``stack_trace`` (each split is reported with op, reason and file:line), it keeps the piecewise
runtime free of Inductor so eager breakable graphs share it, and the hook that wraps Inductor's
partitions is process-wide state (``set_customized_partition_wrappers``) that would touch every
other compile in the process.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import time
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from torchreplay import _compat
from torchreplay.compile.cache import CompileCache, default_dir
from torchreplay.compile.ranks import agreed, collectives_in
from torchreplay.compile.padded import alongside, dim_of, follows, leading_rows, paddable, padded_symbol
from torchreplay.compile.split import Segment, direct_forward, node_value, split_graph
from torchreplay.compile.training import GraphingCompiler, training_program_fn
from torchreplay.config import DEFAULT_CACHE_DIR, CompileConfig
from torchreplay.core.pool import Pool, release_with
from torchreplay.errors import CacheError
from torchreplay.pieces.program import Constant, Input, Piece, Program
from torchreplay.pieces.runtime import PiecewiseRuntime

__all__ = ["Backend", "torchreplay_backend"]

log = logging.getLogger(__name__)


class Backend:
    """A ``torch.compile`` backend with fixed options; it remembers (weakly) what it compiled,
    for :func:`torchreplay.explain`."""

    def __init__(self, config: CompileConfig | None = None) -> None:
        self.config = config if config is not None else CompileConfig()
        self._runtimes: list[weakref.ReferenceType[PiecewiseRuntime]] = []
        # One pool per device for the inference graphs of everything this backend compiles
        # (the graphs between Dynamo's breaks share memory, replayed in a known order).
        self._pools: dict[torch.device, Pool] = {}
        self.compiles = 0
        self.training_compiles = 0
        self.compile_seconds = 0.0
        #: the persistent compile cache of the inference pieces (None: off)
        self.cache = _open_cache(self.config)
        self._options = {  # what the compiled code depends on (the cache key's options)
            f.name: getattr(self.config, f.name)
            for f in dataclasses.fields(self.config)
            if not f.name.startswith("cache") and f.name != "ranks"
        }

    @property
    def runtimes(self) -> list[PiecewiseRuntime]:
        """The compiled graphs that are still alive, in compile order."""
        return [r for r in (ref() for ref in self._runtimes) if r is not None]

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        start = time.perf_counter()
        self.compiles += 1
        name = f"graph {self.compiles - 1}"
        cfg = self.config
        # (a float Dynamo made an input: Inductor ran it as FX code, not as Dynamo's own backend)
        _compat.adopt_scalar_fakes([n for n in gm.graph.nodes if n.op == "placeholder"], example_inputs)
        if not any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs):
            log.info(
                "torchreplay: %s has no CUDA tensor input; compiled %s, without CUDA graphs",
                name, "with Inductor" if cfg.inductor else "as FX code",
            )
            # Dynamo's own fake values: the compile sees Dynamo's symbols, makes none of its own
            values = [node_value(n) for n in gm.graph.nodes if n.op == "placeholder"]
            if not cfg.inductor:
                fn = gm.forward
            elif _needs_grad(example_inputs):  # training graphs are not in the cache
                fn = _inductor_or_fx(gm, list(example_inputs), name, _compat.inductor_compile)
            else:
                fn = self._inductor(gm, values, name, torch.device("cpu"))
            self.compile_seconds += time.perf_counter() - start
            return fn
        if _needs_grad(example_inputs):
            return self._training(gm, example_inputs, name, start)
        device = next(t.device for t in example_inputs if isinstance(t, torch.Tensor) and t.is_cuda)

        def compile_piece(
            k: int, module: fx.GraphModule, examples: list[Any], static: frozenset[int]
        ) -> Callable[..., Any]:
            return self._inductor(module, examples, f"{name} piece {k}", device)

        program, segments, sized = build_program(
            gm, example_inputs, cfg, device, compile_piece if cfg.inductor else None,
            writes_fn=self._writes_fn(example_inputs, name, device),
            seen_sized=any(r.sizes for r in self.runtimes),
        )
        runtime = PiecewiseRuntime(
            program,
            name=name,
            sizes=cfg.sizes if sized else None,
            config=cfg.graph_config(),
            strict=cfg.strict,
            max_graphs=cfg.max_graphs,
            pool=self._pools.setdefault(device, Pool(device)),
        )
        runtime.segments = segments  # type: ignore[attr-defined]
        if sized:
            runtime.on_first = functools.partial(_rows_dynamic, dims=program.output_dims)
        # Collectives inside (tensor parallel): every rank agrees before each replay.
        front = agreed(runtime, gm, cfg.ranks, runtime.sizes, device)
        runtime.compile_seconds = time.perf_counter() - start
        self.compile_seconds += runtime.compile_seconds
        self._runtimes.append(weakref.ref(runtime))
        return runtime if front is None else front

    def _training(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], name: str, start: float
    ) -> Callable[..., Any]:
        """A graph that needs gradients: each capturable piece's forward and backward graphs
        (from AOT autograd, inside Inductor) run as CUDA graphs (:mod:`.training`)."""
        cfg = self.config
        self.training_compiles += 1
        if not cfg.inductor:
            log.warning(
                "torchreplay: %s needs gradients; with inductor=False training runs the FX code "
                "without CUDA graphs (its backward comes from AOT autograd inside Inductor)",
                name,
            )
            self.compile_seconds += time.perf_counter() - start
            return gm.forward
        if cfg.sizes:
            log.info(
                "torchreplay: %s needs gradients; sizes= is not used for training graphs (each "
                "new shape is captured at its first call, up to max_graphs): padded rows would "
                "enter a loss's mean and batch statistics, and so the gradients", name,
            )
        device = next(t.device for t in example_inputs if isinstance(t, torch.Tensor) and t.is_cuda)
        held = collectives_in(gm)[0]  # their groups' destroy waits for these graphs: released then

        def register(runtime: PiecewiseRuntime) -> None:
            self._register(runtime)
            release_with(runtime, held)

        def compile_piece(
            k: int, module: fx.GraphModule, examples: list[Any], static: frozenset[int]
        ) -> Callable[..., Any]:
            inner = GraphingCompiler(cfg, f"{name} piece {k}", register, static)
            return _compat.inductor_compile(module, examples, inner)

        program, _, _ = build_program(
            gm, example_inputs, dataclasses.replace(cfg, sizes=None), device, compile_piece
        )
        self.compile_seconds += time.perf_counter() - start
        return training_program_fn(program)

    def _writes_fn(
        self, example_inputs: Sequence[Any], name: str, device: torch.device
    ) -> Callable[[fx.GraphModule], Writes | None]:
        """Which values the graph writes in place: the fake run, or its result from the cache."""
        cache = self.cache
        if cache is None:
            return graph_writes

        def writes(gm: fx.GraphModule) -> Writes | None:
            def compute() -> list[list[str]] | None:
                found = graph_writes(gm)
                return None if found is None else sorted([w, v] for w, v in found)

            pairs = cache.fact(
                gm, example_inputs, kind="writes", name=f"{name} writes", device=device,
                compute=compute,
                valid=lambda v: v is None or (isinstance(v, list) and all(
                    isinstance(p, list) and len(p) == 2 and all(isinstance(n, str) for n in p)
                    for p in v)),
            )
            return None if pairs is None else {(w, v) for w, v in pairs}

        return writes

    def _register(self, runtime: PiecewiseRuntime) -> None:
        self._runtimes.append(weakref.ref(runtime))

    def _inductor(
        self, module: fx.GraphModule, examples: list[Any], name: str, device: torch.device
    ) -> Callable[..., Any]:
        """Inductor's code for one piece, from the compile cache where it is on."""
        cache = self.cache
        if cache is None:
            return _inductor_or_fx(module, examples, name, _compat.inductor_compile)

        def cached(m: fx.GraphModule, ex: list[Any]) -> Callable[..., Any]:
            return cache.compile(m, ex, name=name, options=self._options, device=device)

        return _inductor_or_fx(module, examples, name, cached)


def _needs_grad(example_inputs: Sequence[Any]) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs
    )


def _open_cache(cfg: CompileConfig) -> CompileCache | None:
    if cfg.cache_dir is None or not cfg.inductor:
        return None
    if not _compat.has_standalone_compile():
        log.warning(
            "torchreplay: torch %s has no torch._inductor.standalone_compile; running without "
            "the compile cache (every start compiles)", torch.__version__,
        )
        return None
    directory = default_dir() if cfg.cache_dir is DEFAULT_CACHE_DIR else cfg.cache_dir
    return CompileCache(directory, strict=cfg.cache_strict)  # type: ignore[arg-type]


#: what the string backend compiled in this process (weakly): ``tr.explain`` of a
#: ``torch.compile(..., backend="torchreplay")`` result reads it
_BY_NAME: list[weakref.ReferenceType[PiecewiseRuntime]] = []


def torchreplay_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: dict[str, Any] | None = None,
    mode: str | None = None,
    **kwargs: Any,
) -> Any:
    """The ``torchreplay`` backend of ``torch.compile`` (the ``torch_dynamo_backends`` entry
    point): ``torch.compile(model, backend="torchreplay", options={"sizes": [1, 2, 4]})``.
    Torch hands ``options`` (and ``mode``) over as they are; the options may also come as
    keywords (``functools.partial(torchreplay_backend, sizes=[1, 2, 4])``). There is no mode:
    every mode of ours captures CUDA graphs.

    Each Dynamo graph gets a backend (and a pool) of its own: nothing tells this function which
    model a graph belongs to, and a pool shared between two models would mark one model's
    outputs stale when the other replays. ``tr.compile`` shares one pool across the graphs of
    one model."""
    if mode not in (None, "default"):
        raise ValueError(
            f"backend='torchreplay' has no mode {mode!r}: it always runs Inductor's code as CUDA "
            "graphs. Leave mode out and pass its options as options={...} "
            "(torchreplay.CompileConfig names them)"
        )
    given = {**(options or {}), **kwargs}
    known = {f.name for f in dataclasses.fields(CompileConfig)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(
            f"backend='torchreplay' has no option {', '.join(map(repr, unknown))}; its options "
            f"(torchreplay.CompileConfig): {', '.join(sorted(known))}"
        )
    backend = Backend(CompileConfig(**given))
    out = backend(gm, example_inputs)
    _BY_NAME[:] = [r for r in _BY_NAME if r() is not None] + backend._runtimes
    return out


def runtimes_by_name() -> list[PiecewiseRuntime]:
    """The live graphs that ``torch.compile(..., backend="torchreplay")`` made, in order."""
    return [r for r in (ref() for ref in _BY_NAME) if r is not None]


def build_program(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    cfg: CompileConfig,
    device: torch.device,
    compile_piece: Callable[[int, fx.GraphModule, list[Any], frozenset[int]], Callable[..., Any]]
    | None = None,
    writes_fn: Callable[[fx.GraphModule], Writes | None] | None = None,
    seen_sized: bool = False,
) -> tuple[Program, list[Segment], bool]:
    """Split ``gm``, compile its pieces, and describe its inputs and outputs for the runtime.

    ``compile_piece(k, module, example_inputs, static)`` compiles a capturable piece (default:
    Inductor, or the FX code as is with ``inductor=False``); ``static``: the positions of its
    inputs that are parameters or buffers.

    ``writes_fn(gm)``: what the graph writes in place, where (default: :func:`graph_writes`; the
    backend passes one that keeps the answer in the compile cache).

    ``seen_sized``: the backend has compiled a graph padded to ``cfg.sizes`` before. A graph
    with no dynamic size at all is then Dynamo's specialisation of a later one (a graph after a
    break, recompiled for a 1-row call): captured for its one shape, said at INFO, not warned.

    Returns the program, the segments (for the report) and whether padding to ``cfg.sizes`` is
    possible (a dynamic dimension was found and every output's size is that dimension or fixed).
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    segments = split_graph(gm, cfg.splitting_ops, device)
    wrote = (writes_fn or graph_writes)(gm)
    written = None if wrote is None else {v for _, v in wrote}
    symbol = padded_symbol(placeholders, example_inputs, cfg) if cfg.sizes else None
    rows = leading_rows(gm, symbol) | alongside(placeholders, example_inputs, symbol, cfg.dim)
    inputs = []
    for p, ex in zip(placeholders, example_inputs):
        value, name = node_value(p), input_name(p)
        if isinstance(ex, torch.Tensor):
            if _compat.is_static_input(ex):
                # written: put back after capture (its warm-up runs wrote it several times)
                inputs.append(Input(name, "static", written=written is None or p.name in written))
            else:
                dim = dim_of(value, symbol, rows)
                is_written = written is None or p.name in written
                inputs.append(Input(name, "tensor", dim=dim, written=is_written))
        elif isinstance(ex, (int, torch.SymInt)):
            is_size = symbol is not None and follows(_compat.symbol_of(value), symbol, rows)
            inputs.append(Input(name, "int", is_size=is_size))
        else:
            inputs.append(Input(name, "other"))
    slot = {p: i for i, p in enumerate(placeholders)}
    next_slot = len(placeholders)
    pieces = []
    for k, seg in enumerate(segments):
        reads = tuple(slot[a] for a in seg.inputs)
        writes = tuple(range(next_slot, next_slot + len(seg.outputs)))
        for n, s in zip(seg.outputs, writes):
            slot[n] = s
        next_slot += len(seg.outputs)
        assert seg.module is not None
        if seg.graphed and compile_piece is not None:
            static = frozenset(
                j for j, a in enumerate(seg.inputs)
                if a in slot and slot[a] < len(inputs) and inputs[slot[a]].kind == "static"
            )
            fn = compile_piece(k, seg.module, [node_value(a) for a in seg.inputs], static)
        elif seg.graphed and cfg.inductor:
            examples = [node_value(a) for a in seg.inputs]
            fn = _inductor_or_fx(seg.module, examples, f"piece {k}", _compat.inductor_compile)
        else:
            fn = seg.module.forward  # not GraphModule.__call__: 2 us less per eager step
        pieces.append(
            Piece(
                fn=fn,
                reads=reads,
                writes=writes,
                graphed=seg.graphed,
                name=f"piece {k}",
                split=seg.splits[0] if seg.splits else None,
                nodes=len(seg.nodes),
                written=_written_by(seg, wrote),
                replay_fn=None if seg.graphed else direct_forward(seg.module),
            )
        )
    output = next(n for n in gm.graph.nodes if n.op == "output")
    leaves = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    outs: list[int | Constant] = []
    dims: list[int | None] = []
    sized = symbol is not None
    for leaf in leaves:
        if isinstance(leaf, fx.Node):
            outs.append(slot[leaf])
            value = node_value(leaf)
            dims.append(dim_of(value, symbol, rows))
            if symbol is not None and not paddable(value, symbol, rows):
                sized = False
        else:
            outs.append(Constant(leaf))
            dims.append(None)
    static = not any(_compat.symbol_of(v) is not None for p in placeholders for v in _sizes_of(node_value(p)))
    if cfg.sizes and not sized and seen_sized and static:
        log.info("torchreplay: a graph specialised by Dynamo to one shape (a recompile); captured "
                 "for that shape, not padded")
    elif cfg.sizes and not sized:
        log.warning(
            "torchreplay: sizes=%s given, but the graph has no dynamic dimension %d whose size "
            "every output keeps (mark it dynamic, or compile with tr.compile(sizes=...)); each "
            "new shape is captured as it comes instead",
            list(cfg.sizes), cfg.dim,
        )
    program = Program(tuple(inputs), pieces, tuple(outs), tuple(dims) if sized else ())
    return program, segments, sized


_MODULE_PART = re.compile(r"\._(?:modules|parameters|buffers)\['([^']+)'\]")


def input_name(p: fx.Node) -> str:
    """A graph input as the user's code names it, for messages: ``self.seen`` for Dynamo's
    ``L['self']._buffers['seen']`` (placeholder ``l_self_buffers_seen_``), ``x``, ``d['k']``;
    the placeholder's name where Dynamo left no source."""
    source = _compat.dynamo_source_name(p)
    if not source:
        return p.name
    return _MODULE_PART.sub(r".\1", re.sub(r"^[LG]\['([^']+)'\]", r"\1", source))


def _sizes_of(value: Any) -> tuple[Any, ...]:
    """A traced value's sizes (a tensor's shape), or the value itself as a size."""
    return tuple(value.shape) if isinstance(value, torch.Tensor) else (value,)


def _inductor_or_fx(
    module: fx.GraphModule,
    examples: list[Any],
    name: str,
    compile_fn: Callable[[fx.GraphModule, list[Any]], Callable[..., Any]],
) -> Callable[..., Any]:
    """Inductor's code for a piece; where Inductor fails on it, the FX code as is (still
    captured), with a warning: one piece Inductor cannot compile does not fail the model."""
    try:
        return compile_fn(module, examples)
    except CacheError:
        raise
    except Exception as exc:  # Inductor's own errors: codegen, Triton compile, lowering
        if _compat.dynamo_restart(exc):  # (for Dynamo: trace again, a float made constant)
            raise
        log.warning(
            "torchreplay: Inductor could not compile %s (%s: %s); it runs as FX code, still "
            "captured", name, type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "",
        )
        return module.forward


def _rows_dynamic(outs: Sequence[Any], n: int | None, dims: Sequence[int | None]) -> None:
    """Mark each dimension of the first call's outputs that has the call's rows dynamic (soft):
    Dynamo's frame resumed after a graph break takes them as inputs, and would trace them
    static, then again dynamic at the next size: under ``sizes=``, a second compile and capture
    of every size in the middle of serving. Not at one row, which Dynamo specialises whatever
    the mark says."""
    if n is None or n < 2:
        return
    for value, d in zip(outs, dims):
        if d is not None and isinstance(value, torch.Tensor) and value.dim() > d:
            _compat.maybe_mark_dynamic(value, d)


Writes = set[tuple[str, str]]
"""``(writer, written)`` node names: node ``writer`` writes the value of node ``written`` in
place (directly or through a view)."""


def graph_writes(gm: fx.GraphModule) -> Writes | None:
    """What the graph writes in place, and which node writes it, from a run on fake tensors node
    by node: an in-place op (or a write through a view) bumps the version counter of the tensor
    it writes, and every value on that storage is written with it. None when the fake run fails:
    then every tensor counts as written (put back after warm-ups, copied back after replays:
    slower, correct)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = [node_value(p) for p in placeholders]
    mode = _compat.fake_mode_of(values)
    if mode is None:
        return None
    found: Writes = set()
    on_storage: dict[int, list[str]] = {}

    class _Watch(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            read = [t for a in n.all_input_nodes for t in _tensor_leaves(self.env.get(a))]
            before = [t._version for t in read]
            out = super().run_node(n)
            for t, b in zip(read, before):
                if t._version != b:
                    found.update((n.name, v) for v in on_storage.get(_compat.storage_key(t), ()))
            for t in _tensor_leaves(out):
                on_storage.setdefault(_compat.storage_key(t), []).append(n.name)
            return out

    try:
        with mode, torch.no_grad(), _compat.normal_tensors(), _compat.fresh_unbacked_ignored(mode):
            clones = [v.detach().clone() if isinstance(v, torch.Tensor) else v for v in values]
            _Watch(gm, garbage_collect_values=False).run(*clones)
        return found
    except Exception as exc:  # a graph the fake run cannot handle: be conservative
        log.debug("torchreplay: fake run to find in-place writes failed: %s", exc)
        return None


def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors in a node's value (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensor_leaves(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensor_leaves(v)]
    return []


def _written_by(seg: Segment, wrote: Writes | None) -> tuple[int, ...]:
    """The positions of ``seg``'s inputs that its nodes write in place (all, unknown)."""
    if wrote is None:
        return tuple(range(len(seg.inputs)))
    mine = {n.name for n in seg.nodes}
    hit = {v for w, v in wrote if w in mine}
    return tuple(j for j, a in enumerate(seg.inputs) if a.name in hit)
