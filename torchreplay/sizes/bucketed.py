"""Many sizes: one graph per captured size, calls padded to the next captured size.

``tr.graph(fn, *sample_args, sizes=[...], dim=0)`` returns a :class:`BucketedGraph`. Its memory
layout is what makes it cheap:

- one set of static input buffers at the largest size; a graph of size ``s`` reads their leading
  ``s`` rows (``narrow(dim, 0, s)``);
- one set of static output buffers at the largest size; each graph copies its outputs into their
  leading slice *inside the capture*, so what the callable allocated for its outputs is freed when
  the capture ends and the next (smaller) capture reuses it;
- one memory pool for every graph, captured largest first: it grows with the largest size.

The planning (which size a call goes to, what is sliced back, ...) is in :mod:`.plan` and
:mod:`.outputs`; calls from several threads: :mod:`torchreplay.core.threads`.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable

import torch

from torchreplay import _compat
from torchreplay.config import RANKS, SAFE, BucketConfig, GraphConfig, RankConfig
from torchreplay.core.args import CallArgs, called_module, fn_name, infer_device, owning_module
from torchreplay.core.capture import capture, progress, side_stream
from torchreplay.core.eager_form import EagerForm
from torchreplay.core.generators import bind, check_pairs, hand_back
from torchreplay.core.snapshot import StateSnapshot
from torchreplay.core.effects import PyState
from torchreplay.core.io import (
    Inputs, TransformedInput, point_or_off, same_constant, warn_widening, widens, write_back,
)
from torchreplay.core.modes import CAPTURE, GRAD, REPLICA, TRANSFORM, EagerCalls, tracked_leaf
from torchreplay.core.outputs import Outputs
from torchreplay.core.padding import flat_call, pad_sample, run_padded
from torchreplay.core.placed import CHANGES, GONE, Placed
from torchreplay.core.threads import Callers, follow_stream, get_ident, outputs_to_clones
from torchreplay.core.pool import Pool, release_with
from torchreplay.distributed import EAGER, GRAPH, agreement
from torchreplay.errors import CaptureError, ReplayInputError, UnsupportedError
from torchreplay.sizes.guards import check_call, input_error, refuse_row_mixing
from torchreplay.sizes.probe import args_at, probe
from torchreplay.sizes.plan import (
    DimSpec, FillSpec, InputPlan, decide, format_sizes, narrow_leading, plan_inputs, target_size,
)
from torchreplay.sizes.routes import Route as _Route, SizeGraph as _SizeGraph, copy_targets
from torchreplay.sizes.routes import log_summary, retire_routes, route_views
from torchreplay.stats import GraphStats

__all__ = ["BucketedGraph"]

log = logging.getLogger(__name__)

_Tensor = torch.Tensor
_grad_enabled = torch.is_grad_enabled
_dynamo_tracing = _compat.dynamo_tracing
_foreach_copy = _compat.foreach_copy_
_copy_untracked = _compat.foreach_copy_untracked
_TRACKED = object()  # _replay: the call must record autograd, so it runs eagerly


class BucketedGraph(EagerForm):
    """A callable captured as one CUDA graph per size, with calls padded to the next size.

    A call of size ``n`` (the length of its varying dimensions) replays the graph of the smallest
    captured size ``s >= n``: the ``n`` real rows are copied into the static input buffers, rows
    ``n .. s-1`` hold the fill value, and the outputs come back sliced to ``n`` rows under the
    output policy. All sizes share one memory pool and one set of input and output buffers.

    Build it with ``torchreplay.graph(fn, *sample_args, sizes=[...], dim=0)``.

    Attributes:
        stats: counters: captures, replays, fallbacks, capture seconds, per-size hits
            (``size_hits``), real and padded rows (``pad_waste``), pool bytes.
        pool: the memory pool of every size's graph.
        sizes: the sizes it may capture (ascending); ``captured_sizes``: those captured so far.
        static_args, static_kwargs: the static input buffers at the largest size.
        buffer_bytes: bytes of the static input and output buffers (outside the pool).

    .. warning::
        Padding is correct only for a callable whose rows are independent: row ``i`` of each
        output depends only on row ``i`` of the varying inputs (and on static arguments and
        module state). Batch statistics (BatchNorm in training mode), reductions over the batch
        (``x.sum(0)``, a softmax across rows) and anything that reads "the other rows" see the
        padding rows and give different results. A BatchNorm in training mode is refused at
        construction; a difference beyond rounding between the real rows of a padded call and
        the same call unpadded is logged as a warning at construction (:mod:`.probe`).

    .. warning::
        All sizes share one set of output buffers: with ``outputs="checked"``, any call (of any
        size) makes the outputs of earlier calls stale; ``.clone()`` what you keep.

    .. warning::
        Padding rows run through the callable like real ones. A callable that writes state per
        row (a KV cache row per batch entry) also writes the padding rows' state: rows ``n ..
        s-1`` of such state hold junk after a call of size ``n``.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        options: BucketConfig,
        dim: DimSpec = 0,
        fill_value: FillSpec = 0,
        config: GraphConfig = SAFE,
        pool: Pool | None = None,
        device: torch.device | int | str | None = None,
        ranks: RankConfig = RANKS,
    ) -> None:
        self.fn = fn
        self.name = fn_name(fn)
        self.config = config
        self.options = options
        self.sizes = options.sizes
        self._max = options.sizes[-1]
        self._module = owning_module(fn)
        refuse_row_mixing(self._module, self.name)  # a plain function's modules: after the probe
        self._training = self._module.training if self._module is not None else False
        call = CallArgs(fn, args, kwargs)
        self._plan: InputPlan = plan_inputs(call, dim, fill_value)
        device = infer_device(fn, call, device)
        self.device = device
        self.pool = pool if pool is not None else Pool(device)
        self.stats = GraphStats(self.pool.reserved_bytes)
        self._warned_sizes: set[int] = set()
        self._graphs: dict[int, _SizeGraph] = {}
        self._routes: list[_Route | None] = [None] * (self._max + 1)
        # With sync_sizes: routes of a call size to a larger graph than its own (n, size).
        self._wide: dict[tuple[int, int], _Route] = {}
        self._agreed: list[int | None] = [None] * (self._max + 1)  # agreed size -> graph size
        self._last: Outputs | None = None
        self._warned_casts: set[tuple[int, torch.dtype]] = set()

        # Static inputs at the largest size: the sample's rows, then the fill value.
        with torch.no_grad():  # buffers, not part of an autograd graph
            padded = [
                pad_sample(leaf, d, self._max, f) if d is not None else leaf
                for leaf, d, f in zip(call.leaves, self._plan.dims, self._plan.fills)
            ]
        self._inputs = Inputs(call.with_leaves(padded), device, adopt=True)  # (fixed ones: marked)
        del call, padded  # they hold the caller's sample tensors
        self.static_args = self._inputs.static_args
        self.static_kwargs = self._inputs.static_kwargs
        self._slots = self._inputs.slots
        self._generator_pairs = self._inputs.generator_pairs  # (two generator arguments or more)
        self._inputs.large = [i for i in self._inputs.large if self._plan.dims[i] is None]  # (fixed)
        plan = self._plan
        self._varying = [(self._slots[i].static, plan.dims[i], plan.fills[i]) for i in plan.varying]
        self._lead = self._plan.lead
        self._lead_dim = self._plan.dims[self._lead]
        self._stream = side_stream(device)
        self._device_index = device.index
        self._check_device = torch.cuda.device_count() > 1
        self._callers = Callers()  # one call at a time: threads share the buffers and outputs

        start = time.perf_counter()
        find = self._module is None  # a plain function: the modules it runs are found
        snapshot = (
            StateSnapshot(self._module, device, find=find, save=config.restore_state)
            if config.restore_state or find else None
        )
        runs = snapshot.called if find and snapshot is not None else [self._module]  # filled in place
        # core/effects.py; from before the probe, whose changes count too
        self._effects = PyState(self.name, fn, *self._args_at(self._max), lambda: runs or [], reads=True)
        self._effects.start()
        with self._inputs.rewinding() as adopted:  # (what the build writes into the caller's)
            probed = probe(self.name, fn, self._inputs, self._plan, self.sizes, effects=self._effects,
                           snapshot=snapshot, adopted=adopted, module=self._module,
                           stream=self._stream, device=device)
        self._out_plan = probed.plan
        if find and snapshot is not None:  # the probe ran it: refuse what padding would mix
            self._module = module = called_module(snapshot.called or ())
            self._training = module.training if module is not None else False
            try:
                refuse_row_mixing(module, self.name)
            except UnsupportedError:
                snapshot.restore()
                self._effects.undo()
                raise
        self.stats.padding_check = probed.padding.summary
        if probed.padding.report is not None:
            log.warning("torchreplay: %s", probed.padding.report)
        planned = self._out_plan.leaves
        with _compat.normal_tensors():  # captures copy into them, under inference_mode or not
            self._outs = {i: torch.empty(planned[i].shape, dtype=planned[i].dtype, device=device)
                          for i in self._out_plan.owned}
        self.buffer_bytes = sum(s.static.nbytes for s in self._inputs.tensor_slots if not s.adopted) + sum(
            t.nbytes for t in self._outs.values())
        probe_seconds = time.perf_counter() - start
        self._graph_list: list[Any] = []  # every size's graph, for the release on drop
        with self._inputs.rewinding() as adopted:  # (each warm-up starts from the caller's)
            reset = adopted.undo if adopted is not None else None
            first = self._capture_size(self._max, warmup=True, snapshot=snapshot, watch=True, reset=reset)
        collectives, collective_log = self._first_collectives
        self.collectives = collectives
        self._ranks = agreement(
            ranks, collectives, collective_log, name=self.name, sizes=True, device=self.device,
            parts=[options.sizes, options.capture, options.max_graphs, options.fallback],
        )
        del collective_log
        self._inputs.set_written(first.written)
        self._writes = bool(self._inputs.written or self._inputs.rebound)  # (generators: moved on)
        self.stats.written_inputs = self._inputs.written_paths()
        if snapshot is not None:
            snapshot.restore()
        del snapshot  # its copies of the module's buffers (a KV cache) are not needed any more
        # after capture: hooks a warm-up removed (a lazy module's) are not counted as changed
        self._eager_calls = EagerCalls(self.name, self._training, self._module)  # core/modes.py
        # A callable that writes a varying input leaves its padding rows dirty after a replay.
        self._writes_inputs = any(self._plan.dims[i] is not None for i in self._inputs.written)
        # Rows >= _clean_from of every varying buffer hold the fill value.
        self._clean_from = self._max
        self.stats.capture_seconds += probe_seconds
        self._position = self.pool.register(self)
        # Not a bound method: the finalizer must not keep this object alive.
        self.pool.track(self, self._graph_list, functools.partial(retire_routes, self._routes, self._wide))
        release_with(self, collectives, self._ranks)

        if options.capture == "ahead":
            rest = self.sizes[-2::-1]  # largest first: smaller graphs fit in the pool's blocks
            with progress(f"capturing '{self.name}'", len(self.sizes)) as advance:
                advance()
                for s in rest:
                    self._capture_size(s, warmup=False, snapshot=None)
                    advance()
        self._effects.settle()  # nothing left to put back: later captures only compare
        self._reads = self._effects.reads()
        self._eager_calls.values = self._reads.values if self._reads is not None else None
        self._placed = Placed.of(self._module, self.device)
        log_summary(self)

    # -- capture --------------------------------------------------------------------------------

    def _args_at(self, s: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The static arguments with every varying buffer narrowed to its leading ``s`` rows."""
        return args_at(self._inputs, self._plan, self._max, s)

    def _capture_size(self, s: int, *, warmup: bool, snapshot: StateSnapshot | None, watch: bool = False,
                      reset: Callable[[], None] | None = None) -> _SizeGraph:
        """Capture the graph of size ``s``; its outputs are copied into the shared buffers
        (``reset``: before each warm-up and the capture, see core/capture.py)."""
        plan = self._out_plan
        fn = self.fn
        copies = [
            (i, narrow_leading(self._outs[i], plan.leaves[i].dims, s)) for i in plan.owned
        ]

        def body(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            why = plan.mismatch(out, s)
            if why is not None:
                raise CaptureError(
                    f"'{self.name}' at size {s}: {why}; with sizes= every output must have the "
                    "same structure at every size, with size-dependent dimensions equal to the size"
                )
            leaves = _compat.tree_flatten(out)[0]
            for i, dst in copies:
                dst.copy_(leaves[i])
            return out

        # capture() names the callable in its messages by __qualname__.
        body.__qualname__ = body.__name__ = self.name
        a, k = self._args_at(s)
        # The graph copies its tensor arguments in itself (_compat/copy_nodes.py): a call
        # points its first nodes at its tensors' rows, and launches no copy.
        targets = copy_targets(self._inputs, self._plan.dims, s, self._max)
        captured = capture(
            body,
            a,
            k,
            device=self.device,
            stream=self._stream,
            pool=self.pool,
            config=self.config,
            warmup=warmup,
            snapshot=snapshot,
            watch=[slot.static for slot in self._inputs.tensor_slots] if watch else (),
            collectives=watch,  # the first capture's are what the ranks agree on
            effects=self._effects,
            reset=reset,
            owner=self,  # (body is made per size)
            copy_in=list(targets.values()),
        )
        if watch:  # the first capture: what the ranks agree on
            self._first_collectives = (captured.collectives, captured.collective_log)
        leaves = _compat.tree_flatten(captured.out)[0]
        externals = {i: leaves[i] for i in plan.external}
        # Drop the callable's own outputs: their memory goes back to the pool for smaller sizes.
        graph, seconds, written = captured.graph, captured.seconds, captured.written
        nodes, spares = dict(zip(targets, captured.copies)), captured.spares
        del captured, leaves
        self._graph_list.append(graph)
        entry = _SizeGraph(s, graph, externals, seconds, written, nodes, spares)
        self.stats.graph_copies = max(self.stats.graph_copies, len(nodes))
        self._graphs[s] = entry
        self.stats.captures += 1
        self.stats.capture_seconds += seconds
        self.stats.size_hits.setdefault(s, 0)
        return entry

    # -- replay ---------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _dynamo_tracing():  # called from code torch.compile traces: run outside it
            return _compat.call_untraced(self, args, kwargs)
        module = self._module
        placed = self._placed  # the model moved, or weights or submodules replaced
        if placed is not None and (
            placed.seen != CHANGES[0] or placed.table.get(placed.key, GONE).data_ptr() != placed.at
        ) and placed.moved():
            stale = placed.error(self.name)
        else:  # a tensor in Python state it reads, replaced since capture (core/effects.py)
            stale = self._reads and self._reads.replaced(self.name)
        if stale is not None:
            if self._ranks is not None:  # the others replay only if every rank would
                self._ranks(0, EAGER)
            raise stale
        # core/modes.py: what a replay cannot do as eager does (with ranks: decided before they agree)
        why = self._eager_calls.reason(
            module, self._inputs.flatten(args, kwargs) if self._ranks is not None else None)
        if why is not None:
            if self._ranks is not None:  # every rank falls back, or all raise
                self._ranks(0, EAGER)
            return self._mode_fallback(args, kwargs, why)
        elsewhere = self._check_device and torch.cuda.current_device() != self._device_index
        if elsewhere and _compat.replica_calling(self) is not None:  # nn.DataParallel's, on another
            return self._mode_fallback(args, kwargs, REPLICA)  # GPU: never touches the graphs
        with (callers := self._callers).lock:  # one call at a time (core/threads.py)
            if get_ident() != callers.thread:
                callers.another(get_ident(), self._make_clones)
            if follow_stream(self.pool):  # ordered after a call on another stream
                return self._mode_fallback(args, kwargs, CAPTURE)  # inside another capture
            if elsewhere:
                with torch.cuda.device(self._device_index):
                    return self._run(args, kwargs)
            return self._run(args, kwargs)

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        leaves = self._inputs.flatten(args, kwargs)
        try:
            n = leaves[self._lead].shape[self._lead_dim]
        except (AttributeError, IndexError, TypeError):
            raise self._input_error(leaves, None) from None
        if self._ranks is not None:
            return self._run_agreed(n, leaves, args, kwargs)
        route = self._routes[n] if n <= self._max else None
        if route is None:
            return self._new_size(n, leaves, args, kwargs)
        try:
            out = self._replay(route, n, leaves)
        except TransformedInput:  # inside vmap, jvp: eagerly, as the transform expects
            return self._mode_fallback(args, kwargs, TRANSFORM)
        return self._mode_fallback(args, kwargs, GRAD) if out is _TRACKED else out

    def _replay(self, route: _Route, n: int, leaves: list[Any]) -> Any:
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        widened: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, (leaf, slot, dst, shape, copy) in enumerate(
            zip(leaves, self._slots, route.dsts, route.shapes, route.nodes)
        ):
            if dst is None:
                value = slot.value
                if leaf is not value and not (bind(value, leaf) if slot.rebound else same_constant(leaf, value)):
                    raise self._inputs.constant_error(slot, leaf)
            elif leaf is dst:
                if copy is not None:  # (the buffer holds the values: nothing to copy)
                    copy[0].off()
            else:
                if slot.adopted:
                    raise self._inputs.adopted_error(slot, leaf)
                if (
                    type(leaf) is not _Tensor and not isinstance(leaf, _Tensor)
                ) or leaf.shape != shape or (
                    leaf.device != slot.device
                ) or leaf.layout is not torch.strided:
                    raise self._input_error(leaves, n)
                if leaf.dtype != slot.dtype:
                    widened.append((self._widen(i, slot, leaf, leaves, n), leaf))
                    if copy is not None:
                        copy[0].off()
                    continue
                if copy is None or not point_or_off(copy[0], leaf, copy[1]):  # the graph's node, or a launch
                    dsts.append(dst)
                    srcs.append(leaf)
        if self._generator_pairs:
            check_pairs(self._generator_pairs, leaves, self._inputs.paths)
        grad = _grad_enabled()
        if grad and tracked_leaf(leaves) is not None:
            return _TRACKED  # before anything is written
        if n < self._clean_from:
            self._pad(n)
        # Copy-in before the old outputs are invalidated: an argument may be one of them.
        if dsts:  # autograd off for the copy: it must not record one
            try:
                (_copy_untracked if grad else _foreach_copy)(dsts, srcs)
            except RuntimeError:
                for slot, leaf in zip(self._slots, leaves):
                    if isinstance(leaf, _Tensor) and _compat.transformed(leaf):
                        raise self._inputs.tensor_error(slot, leaf) from None
                raise
        for dst, leaf in widened:  # after the padding refill, so it lands on top of it
            with torch.no_grad():
                dst.copy_(leaf)
        if self._writes:
            self._inputs.check_aliasing(leaves)
        self._clean_from = route.clean_after
        if self.pool.shared:
            self.pool.before_replay(self._position)
        outputs = route.outputs
        last = self._last
        if last is not outputs and last is not None:
            last.invalidate()  # every size writes the same output buffers
        route.replay()
        if self._writes:  # eager semantics: the real rows the callable wrote reach the caller
            self._copy_back(leaves, route)
            if self._inputs.large:  # a KV cache copied in and out at every call: say so, once
                self._inputs.note_same_large(leaves, self.name)
        stats = self.stats
        stats.replays += 1
        stats.size_hits[route.size] += 1
        stats.real_rows += n
        stats.padded_rows += route.pad
        self._last = outputs
        return outputs.emit(leaves)

    def _widen(self, i: int, slot: Any, leaf: torch.Tensor, leaves: Any, n: int) -> torch.Tensor:
        """Accept a lossless widening cast: return where the argument is copied; refuse every
        other dtype."""
        if not widens(leaf.dtype, slot.dtype):
            raise self._input_error(leaves, n)
        warn_widening(self._warned_casts, i, slot.path, leaf.dtype, slot.dtype)
        return self._routes[n].dsts[i]  # type: ignore[union-attr,return-value]

    def _copy_back(self, leaves: Any, route: _Route) -> None:
        """Copy what the graph wrote into the caller's tensors: the call's ``n`` rows of a
        varying argument (never the padding rows), the whole of a static one."""
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for i in self._inputs.written:
            src, leaf = route.dsts[i], leaves[i]
            if leaf is not src:
                dsts.append(leaf)
                srcs.append(src)  # type: ignore[arg-type]
        write_back(dsts, srcs)
        for i, own, _ in self._inputs.rebound:  # (the call's generators move on as the replay drew)
            hand_back(own, leaves[i])

    def _pad(self, n: int) -> None:
        """Write the fill value into rows ``n .. _clean_from-1`` of every varying buffer."""
        rows = self._clean_from - n
        for buf, d, fill in self._varying:
            buf.narrow(d, n, rows).fill_(fill)
        self._clean_from = n

    def _new_size(
        self, n: int, leaves: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """A size without a route yet: check the call, then capture, build the route, or fall back."""
        self._check_call(leaves, n)
        decision = decide(self.options, n, self._graphs, name=self.name, where=self._plan.where())
        if decision.action == "error":
            raise ReplayInputError(decision.message)
        if decision.action == "eager":
            return self._eager(n, decision.message, args, kwargs)
        assert decision.size is not None
        if decision.action == "capture":
            log.debug("torchreplay: capturing '%s' at size %d (first call of size %d)",
                      self.name, decision.size, n)
            self._capture_size(decision.size, warmup=False, snapshot=None)
        self._routes[n] = self._build_route(n, self._graphs[decision.size])
        return self._run(args, kwargs)

    def _run_agreed(
        self, n: int, leaves: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Ranks agree first (collectives inside): with ``sync_sizes`` every rank runs what the
        largest call of any rank needs, its ``n`` rows padded up to it; else sizes must match."""
        ranks = self._ranks
        assert ranks is not None
        if ranks.sync_sizes:
            agreed = ranks(n, GRAPH)
        else:
            s = target_size(self.sizes, n)
            ranks(s or 0, GRAPH if s is not None else EAGER)
            agreed = n
        if agreed == n:
            route = self._routes[n] if n <= self._max else None
        else:  # another rank's call is larger: the graph of the agreed size, if known
            size = self._agreed[agreed] if agreed <= self._max else None
            route = self._wide.get((n, size)) if size is not None else None
        if route is not None:
            return self._replay(route, n, leaves)  # not _TRACKED: __call__ decided that first
        decision = decide(self.options, agreed, self._graphs, name=self.name, where=self._plan.where())
        if decision.action == "error":
            raise ReplayInputError(decision.message)
        if decision.action == "eager":
            return self._eager(agreed, decision.message, args, kwargs, None if agreed == n else n)
        assert decision.size is not None
        self._agreed[agreed] = decision.size
        route = self._routes[n] if n <= self._max else None
        if route is None or route.size != decision.size:
            route = self._wide.get((n, decision.size))
        if route is None:
            self._check_call(leaves, n)
            if decision.action == "capture":
                self._capture_size(decision.size, warmup=False, snapshot=None)
            route = self._build_route(n, self._graphs[decision.size])
            if target_size(self.sizes, n) == decision.size:
                self._routes[n] = route
            else:
                self._wide[(n, decision.size)] = route
        return self._replay(route, n, leaves)

    def _eager(
        self, n: int, message: str, args: tuple[Any, ...], kwargs: dict[str, Any],
        padded_from: int | None = None,
    ) -> Any:
        """Run the call without graphs; ``padded_from``: its rows, padded to ``n`` (agreed)."""
        self.stats.fallbacks += 1
        if n not in self._warned_sizes:
            self._warned_sizes.add(n)
            log.warning("%s", message)
        if padded_from is None:  # no autograd, as the graph, unless it must record one (core/modes.py)
            with torch.set_grad_enabled(tracked_leaf(self._inputs.flatten(args, kwargs)) is not None):
                return self._eager_fn()(*args, **kwargs)
        plan = self._out_plan
        out_dims = ["size" if leaf.kind == "size" else leaf.dims for leaf in plan.leaves]
        out = run_padded(flat_call(self._eager_fn(), self._inputs.spec), self._inputs.flatten(args, kwargs),
                         padded_from, n, self._plan.dims, self._plan.fills, out_dims)
        return _compat.tree_unflatten(out, plan.spec)

    def _build_route(self, n: int, entry: _SizeGraph) -> _Route:
        s = entry.size
        dsts = route_views(self._slots, self._plan.dims, n, self._max)
        shapes = [None if t is None else t.shape for t in dsts]
        plan = self._out_plan
        leaves: list[Any] = []
        owned_ids: set[int] = set()
        for i, leaf in enumerate(plan.leaves):
            if leaf.kind == "owned":
                t = narrow_leading(self._outs[i], leaf.dims, n)
                owned_ids.add(id(t))
                leaves.append(t)
            elif leaf.kind == "external":
                leaves.append(narrow_leading(entry.externals[i], leaf.dims, n))
            elif leaf.kind == "size":
                leaves.append(n)
            else:  # an argument: its buffer, which Outputs hands out as the caller's tensor
                leaves.append(dsts[leaf.value] if leaf.kind == "argument" else leaf.value)
        statics = {t.untyped_storage().data_ptr() for t in dsts if t is not None}
        outputs = Outputs(  # a view of an argument's buffer is checked, or a view of the caller's
            _compat.tree_unflatten(leaves, plan.spec), self.config.outputs, self.name,
            lambda t: id(t) in owned_ids or t.untyped_storage().data_ptr() in statics,
            reuse=True, inputs=dsts,
        )
        clean_after = s if self._writes_inputs else n
        route = _Route(n, s, _compat.direct_replay(entry.graph), dsts, shapes, outputs, clean_after)
        for i, node in entry.copies.items():  # (a call of n rows copies n rows' bytes)
            route.nodes[i] = (node, dsts[i].nbytes)  # type: ignore[union-attr]
        return route

    def invalidate_outputs(self) -> None:
        """Mark the outputs handed out so far stale (another graph may overwrite them)."""
        if self._last is not None:
            self._last.invalidate()

    def _make_clones(self) -> None:
        outputs_to_clones(self, [r and r.outputs for r in (*self._routes, *self._wide.values())])

    @property
    def captured_sizes(self) -> list[int]:
        """The sizes that have a graph now, ascending."""
        return sorted(self._graphs)

    # -- fallbacks and errors -------------------------------------------------------------------

    def _mode_fallback(self, args: tuple[Any, ...], kwargs: dict[str, Any], why: str) -> Any:
        what = self._inputs.tracked_path(args, kwargs) if why == GRAD else ""
        return self._eager_calls.run(self._eager_fn(), args, kwargs, why, self.stats, what)

    def _check_call(self, leaves: list[Any], n: int) -> None:  # (raises: fits no size)
        check_call(self._plan, self._inputs, self._max, leaves, n)

    def _input_error(self, leaves: list[Any], n: int | None) -> ReplayInputError:  # (the first misfit's)
        return input_error(self._plan, self._inputs, self._max, leaves, n)

    def __repr__(self) -> str:
        return (
            f"BucketedGraph({self.name}, sizes=[{format_sizes(self.sizes)}], "
            f"device={self.device}, {self.stats.explain()})"
        )

