"""The piecewise runtime of a breakable graph (``breaks/graph.py``), captured the breakable way:
one run of the model per size, cut into segments at each break call (:class:`BreakableRuntime`)."""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, Callable, Sequence

import torch

from torchreplay import _compat
from torchreplay._compat import copy_nodes
from torchreplay.core.capture import Segments, bind_copies, capture
from torchreplay.core.io import graph_copyable
from torchreplay.core.placed import Placed
from torchreplay.core.snapshot import BUILD_FIRST, WRITTEN_COPIES, StateSnapshot, copies
from torchreplay.errors import CaptureError, UnsupportedError
from torchreplay.breaks.plan import BreakCall, Recorder, intercept, outside_breaks, same_path
from torchreplay.breaks.sized import check_padding, output_dims
from torchreplay.breaks.steps import returns_nothing
from torchreplay.pieces.entries import Entry, PieceGraph
from torchreplay.pieces.program import Program
from torchreplay.pieces.runtime import PiecewiseRuntime

__all__ = ["BreakableRuntime"]

log = logging.getLogger(__name__)

_Tensor = torch.Tensor


class BreakableRuntime(PiecewiseRuntime):
    """The piecewise runtime, captured the breakable way: one run of the model per size."""

    padding_check = False  # (checked at the first capture, without a call of its own)

    def __init__(self, front: Any, program: Program, **kwargs: Any) -> None:
        super().__init__(program, **kwargs)
        self._front_ref = weakref.ref(front)  # (a cycle would leave both to a full collection)
        self._snapshot: StateSnapshot | None = None
        self._warm = False
        self._segments: Segments | None = None
        self._pending: list[tuple[_Tensor, _Tensor]] = []
        self._state_ptrs: set[int] = set()
        self._capturing: int | None = None
        # Per break call of the capture running: the outputs the next segment copies into its
        # buffers by its own first nodes, and their spares (copy_nodes.record)
        self._break_copies: list[tuple[list[int], list[_Tensor]]] = []

    @property
    def _front(self) -> Any:
        """The breakable graph it serves (weakly held: the graph holds the runtime)."""
        return self._front_ref()

    def prepare(self, args: tuple[Any, ...]) -> None:
        """Capture now (every size with ``sizes=``, else the sample's shapes)."""
        self._setup(args, self._front.device)
        if self.sizes is None:
            self._route(args)

    def _ahead(self, n: int) -> Sequence[int]:
        # A size below the sample's rows would run the breaks with the sample's host values
        # (lengths of more rows than the tensors have): it is captured at its first call.
        ahead = [s for s in self.sizes or () if s >= n]
        opts = self._front._options
        return ahead[-1:] if opts is not None and opts.capture == "lazy" else ahead

    def _run_ungraphed(self, args: tuple[Any, ...]) -> Any:
        return self._front.run_eagerly(args)

    def _capture_batch(self, todo: list[tuple[int | None, tuple[Any, ...]]], args: tuple[Any, ...]) -> list[Entry]:
        assert self.device is not None
        module = self._front._module
        # (copied whole: saving what each segment's replay overwrites put a dispatch mode over
        # every op of every capture, twice the Llama's 32-size build, for no memory saved)
        # restore_state=False: the large ones (a KV cache) are left as the captures write them
        large = "copy" if self.config.restore_state else "leave"
        self._snapshot = StateSnapshot(module, self.device, large=large, copy_large=self._front._copy_large)
        state = [*module.parameters(), *module.buffers()] if module is not None else []
        state += [a for a in args if isinstance(a, _Tensor)]
        self._state_ptrs = {t.untyped_storage().data_ptr() for t in state}
        try:
            entries = super()._capture_batch(todo, args)
        finally:
            self._snapshot.restore()
            changed = [n for n, _ in self._snapshot.written_large(versions=False)]
            self._snapshot = None
        if changed:  # (a write the sample call did not make: nothing to put back from)
            log.warning(
                "torchreplay: '%s': the captures wrote %s, which the sample call did not write, "
                "so it was not copied to be put back: it keeps what the captures wrote", self.name,
                ", ".join(changed))
        if self._front._placed is None:  # the breaks run eagerly: their own state may change
            eager = [getattr(c.call, "__self__", None) for c in self._front.breaks]
            skip = [m for m in eager if isinstance(m, torch.nn.Module)]
            self._front._placed = Placed.of(module, self.device, skip=skip)
        self._learn_output_dims()
        return entries

    def _run_break(self, rec: BreakCall, call: Callable[..., Any], a: Any, k: Any) -> Any:
        """A break call in the captured run: end the segment; replay it, so that its memory
        holds real values for the break to read; run the break for real; begin the next segment,
        and hand the model buffers in the pool that hold the break's new tensors (the break's
        own memory is gone at replay: the next segment copies each replay's new outputs there,
        by its own first nodes where it can, ``PieceGraph.copy_in``)."""
        segments = self._segments
        assert segments is not None
        graph = segments.cut()
        self._flush()
        if graph is not None:
            self._front._python.before_replay()  # (what it will write into large Python state)
            graph.replay()
        try:
            with self._front._python.eager_part(f"break {rec.brk.name} at {rec.where}"):
                out = call(*a, **k)
        except Exception as exc:
            size = self._capturing
            at = f" at size {size} (a break gets the padded rows)" if size is not None else ""
            raise CaptureError(
                f"break {rec.brk.name} (called at {rec.where}) raised {type(exc).__name__} "
                f"while '{self.name}' was captured{at}: {exc}. It runs eagerly, so it fails "
                "eagerly too with these arguments"
            ) from exc
        outs, spec = _compat.tree_flatten(out)
        # Outputs that alias memory the break got (a view of an argument, module state) stay
        # what they are: later segments must read and write that memory itself.
        kept = self._state_ptrs | {
            v.untyped_storage().data_ptr() for v in rec.values if isinstance(v, _Tensor)
        }
        new = [j for j, o in enumerate(outs)
               if isinstance(o, _Tensor) and o.is_cuda and o.untyped_storage().data_ptr() not in kept]
        # The next segment copies them into its buffers by its own first nodes, pointed at
        # each replay's new tensors (all or none; spares outside the pool: copy_nodes.record).
        on_device = all(outs[j].get_device() == self._stream.device.index for j in new)
        by_node = new if on_device and graph_copyable([outs[j] for j in new]) else []
        spares = [torch.empty_like(outs[j], memory_format=torch.contiguous_format) for j in by_node]
        segments.resume(copies=len(by_node))
        handed = list(outs)
        for j in new:
            o = outs[j]
            with _compat.normal_tensors():  # replays copy into it, in either mode
                buf = torch.empty_like(o)  # allocated in the pool: the capture is on
            self._pending.append((buf, o))
            handed[j] = buf
        if by_node:
            copy_nodes.record([handed[j] for j in by_node], spares, self._stream)
        self._break_copies.append((by_node, spares))
        return _compat.tree_unflatten(handed, spec)

    def _flush(self) -> None:
        """Copy the last break's outputs into the buffers the model got, eagerly."""
        with torch.no_grad():
            for buf, o in self._pending:
                buf.copy_(o)
        self._pending.clear()

    def _capture_key(self, size: int | None, key: tuple[Any, ...], args: tuple[Any, ...]) -> Entry:
        assert self.pool is not None and self.device is not None
        front = self._front
        entry, env = self._stage(size, args)
        self._capturing = size
        leaves = env[: len(self._inputs)]
        written = [(front._paths[i], leaves[i]) for i in self._tensors if self._inputs[i].written]
        initial = copies(written, self.device, fix=BUILD_FIRST, what=WRITTEN_COPIES)
        snapshot = self._snapshot

        def reset() -> None:
            if snapshot is not None:
                snapshot.restore()
            with torch.no_grad():
                for t, init in initial:
                    _compat.copy_back(t, init)

        self._state_ptrs |= {leaves[i].untyped_storage().data_ptr() for i in self._tensors}
        recorder = Recorder(leaves, front._paths, run=self._run_break)
        reached: set[Any] = set()

        def segmented(segments: Segments) -> contextlib.AbstractContextManager[Any]:
            self._segments = segments
            return intercept(front.fn, front._breaks, recorder, reached)

        # The first segment copies the call's tensors in itself, by its own first nodes (as a
        # piece's graph does: pieces/capturing.py), all or none; a break first: a launch.
        targets = {i: leaves[i] for i in self._tensors}
        if not graph_copyable(list(targets.values())):
            targets = {}
        call_args, call_kwargs = front._unflatten(leaves)
        fn = front.fn
        if front._unpadded is not None and size is not None:  # (the first size: it pads)
            def fn(*a: Any, **k: Any) -> Any:  # (the warm-ups run outside the segments)
                out = front.fn(*a, **k)
                return self._check_padding(size, out) if self._segments is not None else out
            fn.__qualname__ = fn.__name__ = front.name
        try:
            captured = capture(
                fn, call_args, call_kwargs, device=self.device, stream=self._stream,
                pool=self.pool, config=self.config, warmup=not self._warm, snapshot=snapshot,
                reset=reset, segmented=segmented,
                diagnose_fn=outside_breaks(front.fn, front._breaks),
                collectives=front.collectives is None,  # the first capture's are agreed on
                effects=front._python, owner=front,  # (owner: fn differs at the first size)
                copy_in=list(targets.values()),
            )
        finally:
            self._segments = None
            self._pending.clear()
            break_copies, self._break_copies = self._break_copies, []
        self._warm = True
        if front.collectives is None:
            front.collectives, front._collective_log = captured.collectives, captured.collective_log
        reset()  # the captured run ran the breaks (and replayed the segments) for real
        same_path(front.name, front.breaks, recorder.calls, front._out_spec, captured.out, size)
        segs = captured.graphs
        self._graphs.extend(g for g in segs if g is not None)
        self.stats.captures += sum(g is not None for g in segs)
        self.stats.capture_seconds += captured.seconds
        # What the breaks read in the pool is held without owning it: once this size is
        # captured, the next one may use the same memory (each replay writes it before the
        # break reads it), so the pool grows with the largest size, not with their number.
        def held(v: Any) -> Any:
            if isinstance(v, _Tensor) and v.is_cuda:
                if v.untyped_storage().data_ptr() not in self._state_ptrs and self._pool_has(v):
                    return _compat.weak_alias(v)
            return v

        graphs: list[PieceGraph | None] = []
        copied: list[tuple[int, Any]] = []  # what the next segment copies in (break k's outputs)
        nodes: dict[int, Any] = {}
        spares: Sequence[_Tensor] = ()
        for k, rec in enumerate(recorder.calls):
            own = [held(v) for r, v in zip(rec.rules, rec.values) if r.leaf is None]
            outputs = [held(o) for o in (() if returns_nothing(rec) else rec.outputs)]
            graphs += [PieceGraph(segs[k], own + outputs, copied, (), nodes, None, spares), None]
            copied = [(j, o) for j, o in enumerate(outputs) if isinstance(o, _Tensor) and o.is_cuda]
            nodes, spares = self._bind_copies(segs[k + 1], rec, *break_copies[k])
        outs = _compat.tree_flatten(captured.out)[0]
        graphs.append(PieceGraph(segs[-1], outs, copied, (), nodes, None, spares))
        first = graphs[0]
        assert first is not None
        first.inputs = dict(zip(targets, captured.copies))  # (none: a break first, or not found)
        first.spares = captured.spares  # (not found: the graph copies into them, kept as long)
        self.stats.graph_copies = max(self.stats.graph_copies, len(first.inputs))
        entry.graphs = graphs
        entry.sources, pool_outs = self._sources(outs, leaves)
        self._seal(entry, pool_outs)
        self._entries[key] = entry
        return entry

    def _bind_copies(
        self, graph: Any, rec: BreakCall, by_node: list[int], spares: list[_Tensor]
    ) -> tuple[dict[int, Any], Sequence[_Tensor]]:
        """The nodes by which ``graph`` (the segment after the break call ``rec``, ``None``:
        it recorded no work) copies the break's new tensors in, by output position, and the
        spares it must keep (its nodes not found: each replay copies into them)."""
        statics = [rec.outputs[j] for j in by_node]
        found, kept = bind_copies(graph, statics, spares, f"'{self.name}', the segment after break {rec.brk.name}")
        return dict(zip(by_node, found)), tuple(kept)

    def _check_padding(self, size: int, out: Any) -> Any:
        """At the end of the first capture's run (the sample padded to ``size``): end and replay
        the last segment, and check the real rows of ``out`` (breaks/sized.py); returns it."""
        front, segments = self._front, self._segments
        assert segments is not None
        unpadded, front._unpadded = front._unpadded, None
        last = segments.cut()
        self._flush()  # (the last break's outputs, which the last segment reads)
        if last is not None:
            front._python.before_replay()  # (what it will write into large Python state)
            last.replay()
        with front._python.eager_part("the padding check"):
            self.stats.padding_check = check_padding(
                front.name, unpadded, _compat.tree_flatten(out)[0], size, self._state_ptrs)
        return out

    def _sources(self, outs: list[Any], leaves: list[Any]) -> tuple[list[tuple[str, Any]], list[_Tensor]]:
        """Where each output leaf of a replay comes from (see Entry.sources)."""
        by_id = {id(v): i for i, v in enumerate(leaves) if not isinstance(v, (int, float, bool))}
        buffers = {leaves[i].untyped_storage().data_ptr(): i for i in self._tensors}
        sources: list[tuple[str, Any]] = []
        pool_outs: list[_Tensor] = []
        for j, v in enumerate(outs):
            where = f"output {j} of '{self.name}'"
            if id(v) in by_id:
                sources.append(("input", by_id[id(v)]))
            elif not isinstance(v, _Tensor):
                sources.append(("const", v))
            elif not v.is_cuda:
                raise UnsupportedError(
                    f"{where} is a CPU tensor made inside the model: a graph would return its "
                    "value at capture every call. Make it in a break, or return it on the GPU"
                )
            elif v.untyped_storage().data_ptr() not in self._state_ptrs and self._pool_has(v):
                sources.append(("pool", len(pool_outs)))
                pool_outs.append(v)
            elif v.untyped_storage().data_ptr() in buffers:
                i = buffers[v.untyped_storage().data_ptr()]
                raise UnsupportedError(
                    f"{where} is a view of the argument {self._inputs[i].name}; a breakable graph "
                    "returns the caller's argument itself but not a view of it: return a clone"
                )
            else:
                sources.append(("const", v))  # module state (a cache buffer): returned as is
        return sources, pool_outs

    def _learn_output_dims(self) -> None:
        """With sizes: which dimension of each output has the call's rows (sliced back to them)."""
        if self.sizes is not None:
            front = self._front
            seen = [(front._sample_rows, front._sample_out)] + [
                (e.size, [tuple(t.shape) if isinstance(t, _Tensor) else None for t in e.graphs[-1].out])
                for e in self._entries.values() if e.graphs[-1] is not None]
            self.program.output_dims = output_dims(seen, len(front._sample_out))
