"""Run a :class:`~torchreplay.pieces.program.Program` as CUDA graphs, piece by piece.

Memory and copies, the properties this module is built for:

- one memory pool for every piece of every size, captured largest first: it grows with the
  largest size;
- the call's tensor inputs are copied once per call into one set of static buffers at the
  largest size (a call of ``n`` rows fills the leading ``n`` rows; the padding rows are zeroed);
- a graphed piece reads an earlier graphed piece's outputs where they lie in the pool, and the
  output of an eager step that calls a custom op where the step made it (:mod:`.handoff`; a
  small one is copied by the piece's own first nodes instead); other values made by an eager
  step are copied into the piece's own buffers;
- an in-place write to an input reaches the caller's tensor after the call, as in eager;
- the caller's outputs follow ``tr.graph``'s output policy (``checked`` by default).

Safety: a piece that fails to capture runs ungraphed (one warning, counted in ``stats.fallbacks``)
or raises (``strict=True``); so does the rest of a call whose eager step made a value of another
shape than at capture, and a call inside another graph's capture (recorded there, no warning).
Calls from several threads: :mod:`~torchreplay.core.threads`."""

from __future__ import annotations

import bisect
import functools
import logging
import time
import weakref
from typing import Any, Callable, Container, Sequence

import torch

from torchreplay import _compat
from torchreplay.config import SAFE, GraphConfig
from torchreplay.core.capture import side_stream
from torchreplay.core.io import write_back
from torchreplay.core.outputs import Outputs
from torchreplay.core.pool import Pool
from torchreplay.core.threads import Callers, follow_stream, get_ident, outputs_to_clones
from torchreplay.pieces.capturing import capture_piece
from torchreplay.pieces.entries import (
    NOT_EXPANDED, Entry, PieceGraph, Route, copy_expanded, copy_inputs, entry_key, hand_out, hold_weakly,
    make_route, pad_shared, retire_outputs, set_sources, stage_entry,
)
from torchreplay.pieces.handoff import DEMOTED, MISSES, MOVED, handed_slots, hands_off
from torchreplay.pieces.instances import MOVING, Instances, drop_entries, outputs_held, ptrs_of
from torchreplay.pieces.padding import check_first_call, rows_differ
from torchreplay.pieces.putback import PutBack, put_back, to_put_back
from torchreplay.pieces.program import Program, run_in_order
from torchreplay.pieces.saved import BLOCKED, SavedActivations, guarded, saved_refs, user_outputs
from torchreplay.stats import GraphStats

__all__ = ["PiecewiseRuntime"]

log = logging.getLogger(__name__)

_Tensor = torch.Tensor

class PiecewiseRuntime:
    """Replay a program's graphed pieces and run its eager steps, for every size of one compile.

    Args:
        program: the pieces (see :class:`~torchreplay.pieces.program.Program`).
        name: shown in messages and the report.
        sizes: the padded sizes to capture (ahead, largest first, at the first call); ``None``:
            capture each new shape on its first call, up to ``max_graphs``.
        config: warm-up count, output policy, capture error mode.
        strict: a piece that fails to capture raises instead of running ungraphed.
        max_graphs: without ``sizes``, the most keys captured; later new shapes run ungraphed.
        guard_outputs: program outputs whose memory must be free again before the next replay
            (a forward graph's saved activations, :mod:`.saved`). While a replay's are still
            held and its backward has not replayed, a call that may overwrite them runs
            ungraphed, counted, into fresh memory.
        after_replay: called with the entry and the arguments after each replay (a backward
            tells its forward which saved activations it consumed).
        pool: a pool shared with other runtimes on the same device (the graphs of one compiled
            model, between Dynamo's graph breaks); default: a pool of its own.
    """

    #: at the first call's capture, whether padding changes the real rows (:mod:`.padding`)
    padding_check = True

    def __init__(
        self,
        program: Program,
        *,
        name: str = "program",
        sizes: Sequence[int] | None = None,
        config: GraphConfig = SAFE,
        strict: bool = False,
        max_graphs: int = 16,
        guard_outputs: Sequence[int] = (),
        after_replay: Callable[[Entry, tuple[Any, ...]], None] | None = None,
        pool: Pool | None = None,
    ) -> None:
        self.program = program
        self.guard_outputs = frozenset(guard_outputs)
        self.after_replay = after_replay
        self.saved = SavedActivations() if guard_outputs else None  # awaiting their backward
        #: a backward's test of new inputs read in place: False when that forward ran ungraphed
        self.admit: Callable[[tuple[Any, ...]], bool] | None = None
        #: called with the first call's outputs and rows (the compile backend marks them dynamic)
        self.on_first: Callable[[tuple[Any, ...], int | None], None] | None = None
        self.name = name
        self.sizes = tuple(sorted(set(sizes))) if sizes else None
        self.config = config
        self.strict = strict
        self.max_graphs = max_graphs
        # (weakly: a bound method here made every runtime a reference cycle, freed only by a
        # full collection, its pool's memory held till then)
        self.stats = GraphStats(functools.partial(_pool_bytes, weakref.ref(self)))
        self.pool: Pool | None = None
        self._shared_pool = pool
        self.device: torch.device | None = None
        #: per piece: the error that kept it ungraphed, if it failed to capture
        self.failures: dict[int, str] = {}
        self.fallback_reasons: dict[str, int] = {}
        self._inputs = program.inputs
        self._pieces = program.pieces
        self._last = program.last_reads()
        producers = program.producers()
        self._from_eager = {s for s, i in producers.items() if not program.pieces[i].graphed}
        # Eager steps whose outputs graphs read where they are (.handoff; not in a training
        # forward: its activations outlive the call), their pool, calls that missed.
        self._handoffs = {} if guard_outputs else handed_slots(program)
        self._alloc: _compat.PrivateAllocations | None = None
        self._misses = 0
        self._graphable = [p.graphed for p in program.pieces]
        self._sized = [i for i, x in enumerate(self._inputs) if x.kind == "tensor" and x.dim is not None]
        self._size_ints = [i for i, x in enumerate(self._inputs) if x.kind == "int" and x.is_size]
        self._tensors = [i for i, x in enumerate(self._inputs) if x.kind == "tensor"]
        self._statics = [i for i, x in enumerate(self._inputs) if x.kind == "static"]
        self._pinned = [i for i, x in enumerate(self._inputs) if x.kind == "pinned"]
        self._in_place = sorted(self._statics + self._pinned)  # key the sets of graphs
        # Inputs taken from the call as they are (parameters, constants, host values, ints).
        self._passed = [
            i for i, x in enumerate(self._inputs)
            if x.kind in ("static", "pinned", "other", "host") or (x.kind == "int" and not x.is_size)
        ]
        self._entries: dict[tuple[Any, ...], Entry] = {}
        self._routes: dict[int | None, Route] = {}
        self._buffers: dict[tuple[Any, ...], _Tensor] = {}
        # Per buffer shared by every size: the row from which on it holds the padding (pad_shared)
        self._clean: dict[int, int] = {}
        self._writes_varying = any(x.written and x.dim is not None for x in program.inputs)
        self._replays_mark = 0  # stats.replays when the current set became current (+1: new)
        # Per set of addresses of the parameters and buffers read in place: its graphs.
        self._instances = Instances(
            self._in_place, name, _compat.is_static_input if self._pinned else None
        )
        self._ranges: list[tuple[int, int]] = []  # the pool's address ranges after capture
        # Inputs that are part of the key besides shapes: ints other than the size, constants.
        self._keyed = [
            i for i, x in enumerate(self._inputs)
            if x.kind == "other" or (x.kind == "int" and not x.is_size)
        ]
        self._graphs: list[Any] = []
        self._warmed: set[int] = set()  # captured once: one warm-up at a next size, as trees do
        self._ready = False
        self._eager = False
        self._warned: set[str] = set()
        self.compile_seconds = 0.0
        self._callers = Callers()
        self._putback: PutBack | None = None  # while a first call captures

    # ------------------------------------------------------------------ the call
    def __call__(self, *args: Any, size: int | None = None) -> tuple[Any, ...]:
        """Run the program on ``args``; ``size``: replay the graphs of this captured size (a
        larger one than the call's rows need: the size the ranks agreed on)."""
        callers = self._callers
        with callers.lock:  # one call at a time: threads share the buffers and outputs
            if get_ident() != callers.thread:
                callers.another(get_ident(), self._make_clones)
            if not self._ready:
                self._setup(args)
                outs = self(*args, size=size)  # (set up now: the call itself; the lock is re-entrant)
                if self.on_first is not None:
                    self.on_first(outs, self.rows(args))
                return outs
            if self._eager:
                return self._run_ungraphed(args)
            if self._in_place and not self._instances.unchanged(args):
                if not self._switch(args):
                    return self._run_ungraphed(args)
            route = self._route(args, size)
            if route is None:
                return self._run_ungraphed(args)
            if self.saved is not None and self.saved.blocks(route.entry):  # its replay would
                route = self._unblocked(args, size)  # overwrite what awaits its backward
                if route is None:
                    return self._run_ungraphed(args)
            return self._replay(route, args)

    def _unblocked(self, args: tuple[Any, ...], size: int | None) -> Route | None:
        """The first copy of the call's graph (same shape, captured at its first need, later in
        the pool: :mod:`.saved`) whose replay overwrites nothing held; None (run ungraphed): no
        room for one (``max_graphs``), or ``sizes`` (the sizes share their input buffers)."""
        if self.sizes is not None:
            self._count_fallback(BLOCKED)
            return None
        copy = 1
        while True:  # (ends: each copy is an entry, up to max_graphs)
            route = self._route(args, size, copy)
            if route is None or not self.saved.blocks(route.entry):  # type: ignore[union-attr]
                return route
            copy += 1

    def _replay(self, route: Route, args: tuple[Any, ...]) -> tuple[Any, ...]:
        entry = route.entry
        if follow_stream(self.pool):  # ordered after a call on another stream; True: inside
            self.stats.fallbacks += 1  # another graph's capture, recorded there
            return self._run_ungraphed(args)
        if route.dsts or route.nodes:
            copy_inputs(route, args)
        if route.expanded and (why := copy_expanded(route, args)) is not None:
            self._count_fallback(f"input {self._inputs[why].name} {NOT_EXPANDED}")
            return self._run_ungraphed(args)
        if route.pads:  # buffers of one size
            _compat.foreach_zero_(route.pads)
            for view, value in route.fills:
                view.fill_(value)
        if route.bases:
            pad_shared(route, self._clean, self._writes_varying)
        pool = self.pool
        if pool is not None and pool.shared:
            pool.before_replay(entry.position)
        env = list(entry.inputs)
        for i in self._passed:
            env[i] = args[i]
        tainted = False
        for graph, fn, reads, writes, last, k in entry.steps:
            if graph is not None and not tainted:
                why = graph.copy_in(reads, env) if graph.copies else None
                if why is None:
                    graph.replay()  # its outputs are in env already (Entry.inputs)
                    for pos, buf in graph.backs:  # its writes to what eager steps made
                        env[reads[pos]].copy_(buf)
                    for f in last:
                        env[f] = None
                    continue
                tainted = True
                self._misses += why is MOVED
                self._count_fallback(f"{self._pieces[k].name}: {why}; the rest of the call runs ungraphed")
            elif graph is None and k in self.failures:
                self._count_fallback(f"{self._pieces[k].name} failed to capture and runs ungraphed")
            outs = fn(*[env[r] for r in reads])
            if writes:  # a step that writes no slot may return anything (a break: None)
                for w, t in zip(writes, outs):
                    env[w] = t
            outs = t = None  # only env holds them: dropped after their last read (.handoff)
            for f in last:
                env[f] = None
        if route.backs:  # eager semantics: the callable's writes reach the caller's tensors
            write_back([args[i] for i in route.back_idx], route.backs)
        if self.saved is not None:
            self.saved.replayed(entry, tainted)
        if self.after_replay is not None:
            self.after_replay(entry, args)
        self.stats.replays += 1
        n, size = route.n, entry.size
        if n is not None and size is not None:
            self.stats.size_hits[size] = self.stats.size_hits.get(size, 0) + 1
            self.stats.real_rows += n
            self.stats.padded_rows += size - n
        out = hand_out(entry, env, args, self.program, None if n == size else n, tainted, self._in_pool)
        if tainted and self._misses >= MISSES and self._handoffs:  # its outputs are clones
            self._copy_from_now_on()
        return out

    def _run_ungraphed(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """Run every piece as is on the caller's own tensors (no graph, no copies)."""
        return run_in_order(self.program, args, self._last)

    # ------------------------------------------------------------------ routing
    def rows(self, args: Sequence[Any]) -> int | None:
        """The call's size (rows of the varying dimension), ``None`` without one."""
        if self._sized:
            return args[self._sized[0]].shape[self._inputs[self._sized[0]].dim]
        return int(args[self._size_ints[0]]) if self._size_ints else None  # (the size alone)

    def _route(self, args: tuple[Any, ...], size: int | None = None, copy: int = 0) -> Route | None:
        n = self.rows(args)
        rkey: Any = n if size is None or size == self._bucket(n) else (n, size)
        if copy:
            rkey = ("copy", rkey, copy)
        route = self._routes.get(rkey)
        if route is not None:
            shapes = route.shapes
            for j, i in enumerate(self._tensors):
                if args[i].shape != shapes[j]:
                    break
            else:
                if not self._keyed or route.consts == [args[i] for i in self._keyed]:
                    return route
        return self._new_route(n, args, size, rkey, copy)

    def _bucket(self, n: int | None) -> int | None:
        if n is None or self.sizes is None:
            return n
        k = bisect.bisect_left(self.sizes, n)
        return self.sizes[k] if k < len(self.sizes) else -1

    def _key(self, size: int | None, args: tuple[Any, ...], copy: int = 0) -> tuple[Any, ...]:
        key = entry_key(size, args, self._inputs, self._tensors)
        if copy:  # (a copy of the graph: see _unblocked)
            key = (*key, ("copy", copy))
        current = self._instances.current
        return key if current is None else (*key, current.id)

    def _new_route(
        self, n: int | None, args: tuple[Any, ...], forced: int | None = None, rkey: Any = None,
        copy: int = 0,
    ) -> Route | None:
        size = self._bucket(n) if forced is None else forced
        if size == -1 or (n == 0 and forced is None):
            self._count_fallback(
                f"{n} rows: above the largest captured size {self.sizes[-1] if self.sizes else ''}"
                "; add a larger size to sizes="
            )
            return None
        odd = rows_differ(self, n, args)
        if odd is not None:  # padded together, or an out-of-bounds read at the other's size
            self._count_fallback(odd)
            return None
        key = self._key(size, args, copy)
        entry = self._entries.get(key)
        if entry is None:
            current = self._instances.current
            held = current.entries if current is not None else len(self._entries)
            if held >= (self.max_graphs if self.sizes is None else len(self.sizes) + self.max_graphs):
                self._count_fallback(BLOCKED if copy else (
                    f"a new input shape after {len(self._entries)} captured ones (max_graphs)"
                ))
                return None
            entry = self._capture_batch([(size, key)], args)[0]
        route = make_route(n, size, entry, args, self._inputs, self._tensors, self._keyed, self._buffers, self.sizes)
        if self.sizes is None or len(self._routes) < 4 * len(self.sizes) + 64:
            self._routes[n if rkey is None else rkey] = route
        return route

    # ------------------------------------------------------------------ capture
    def _setup(self, args: tuple[Any, ...], device: torch.device | None = None) -> None:
        self._ready = True
        self._n_slots = self.program.n_slots
        if device is None:
            device = next((a.device for a in args if isinstance(a, _Tensor) and a.is_cuda), None)
        if device is None or not torch.cuda.is_available():
            self._eager = True
            log.info(
                "torchreplay: '%s' has no CUDA tensor input (or no CUDA); running the compiled "
                "code without CUDA graphs",
                self.name,
            )
            return
        self.device = device
        if self._handoffs:
            self._alloc = _compat.private_allocations(device.index or 0)
            self._handoffs = self._handoffs if self._alloc is not None else {}
        shared = self._shared_pool
        self.pool = shared if shared is not None and shared.device in (None, device) else Pool(device)
        self._stream = side_stream(device)
        if self._in_place:
            self._instances.add(args, ptrs_of(args, self._in_place))
            self._replays_mark = self.stats.replays + 1  # this call captures and replays once
            self._routes = self._instances.current.routes  # type: ignore[union-attr]
        self.pool.track(self, self._graphs, functools.partial(retire_outputs, self._entries))
        n = self.rows(args)
        if self.sizes is not None and n is not None:
            todo = [(s, self._key(s, args)) for s in reversed(self._ahead(n))]
            if self._bucket(n) == -1:
                log.warning(
                    "torchreplay: '%s' first call has %d rows, above the largest size %d",
                    self.name, n, self.sizes[-1],
                )
            self._capture_batch(todo, args)

    def _ahead(self, n: int) -> Sequence[int]:
        """The sizes captured at the first call (of ``n`` rows); the others on first use."""
        return self.sizes or ()

    def _capture_batch(
        self, todo: list[tuple[int | None, tuple[Any, ...]]], args: tuple[Any, ...]
    ) -> list[Entry]:
        """Capture every key in ``todo`` (largest first), module state put back afterwards."""
        assert self.device is not None
        kept = [(self._inputs[i].name, args[i]) for i in self._statics + self._pinned
                if i in self._pinned or to_put_back(args[i], self._inputs[i].written, self.config.restore_state)]
        start = time.perf_counter()
        entries = []
        with put_back(kept, self.device) as restore:
            self._putback = restore  # (its copies are a piece's reset's while unwritten)
            try:
                for j, (size, key) in enumerate(todo):
                    if j:
                        restore()  # each size from the caller's state
                    entries.append(self._capture_key(size, key, args))
            finally:
                self._putback = None
            # The warm-ups of later sizes were not waited for one by one (the GPU ran them while
            # the host captured): an asynchronous error surfaces here, still in the first call.
            self._stream.synchronize()
            self._ranges = self.pool.segment_ranges() if self.pool is not None else []
            self._clean.clear()  # staging and warm-ups wrote the buffers
            if self.padding_check and self.sizes is not None:  # (the first call's capture)
                self.padding_check = False
                check_first_call(self, args, restore, kept)
        log.info(
            "torchreplay: '%s' captured %d size(s) %s in %.2f s (%d graphs, %d eager steps)",
            self.name, len(todo), [s for s, _ in todo], time.perf_counter() - start,
            sum(g is not None for e in entries for g in e.graphs), sum(not p.graphed for p in self._pieces),
        )
        return entries

    def _stage(self, size: int | None, args: tuple[Any, ...]) -> tuple[Entry, list[Any]]:
        return stage_entry(size, args, self._inputs, self._buffers, self.sizes, self._n_slots,
                           self._passed)

    def _capture_key(self, size: int | None, key: tuple[Any, ...], args: tuple[Any, ...]) -> Entry:
        assert self.pool is not None and self.device is not None
        entry, env = self._stage(size, args)
        graphs: list[PieceGraph | None] = []
        handing: dict[int, frozenset[int]] = {}  # the eager steps handed off at this key, their slots
        for k, piece in enumerate(self._pieces):
            vals = [env[r] for r in piece.reads]
            graph = None
            if self._graphable[k]:  # (the first copies the call's tensors in itself)
                graph, outs = capture_piece(
                    self, k, vals, {i: env[i] for i in self._tensors} if k == 0 else None, handing)
            if graph is None:
                outs = (self._alloc.wrap(piece.fn) if k in self._handoffs else piece.fn)(*vals)  # type: ignore[union-attr]
                slots = self._handoffs.get(k)  # (small values: the next graph's copy nodes)
                if slots and hands_off([t for w, t in zip(piece.writes, outs) if w in slots]):
                    handing[k] = slots
            graphs.append(graph)
            if self._putback is not None:  # (what it wrote no longer equals the put-back's copy)
                self._putback.wrote([vals[p] for p in piece.written])
            for w, t in zip(piece.writes, outs):
                env[w] = t
            for f in self._last[k]:
                env[f] = None
        entry.graphs = graphs
        graphed = {w for k, g in enumerate(graphs) if g is not None for w in self._pieces[k].writes}
        # an input itself (a copied-in buffer, or a parameter a forward saves): the call's own
        inputs = {id(env[i]): i for i in self._tensors} | {id(args[i]): i for i in self._in_place}
        pool_outs = set_sources(entry, self.program, env, graphed, inputs)
        in_place = set(self._in_place)  # the parameters a forward saves, for its backward
        kept = [args[i] for k, (kind, i) in enumerate(entry.sources)
                if kind == "input" and i in in_place and k in self.guard_outputs]
        self._seal(entry, pool_outs, kept, handing)
        self._entries[key] = entry
        if self._instances.current is not None:
            self._instances.current.entries += 1
        return entry

    def _seal(
        self, entry: Entry, pool_outs: list[_Tensor], kept: Sequence[_Tensor] = (), handing: Container[int] = ()
    ) -> None:
        """Give ``entry`` (its ``sources`` set) the output policy over ``pool_outs`` and its
        place in the pool's replay order; ``kept``: inputs read in place a forward saves;
        ``handing``: its eager steps whose outputs a graph reads where they are."""
        assert self.pool is not None
        if self.config.outputs == "clone":
            hold_weakly(entry, pool_outs, self._pool_has)
        if self.guard_outputs:  # before the loop below fills entry.inputs with outputs
            self._ranges = self.pool.segment_ranges()
        saved = saved_refs(entry, self.guard_outputs)
        entry.guard = guarded(entry, pool_outs, saved, self._in_pool)
        # The replay loop, per piece; a graph's outputs are constant per entry: they sit in the
        # slot values every call starts from, so a replay only replays.
        entry.steps = []
        for k, (graph, piece) in enumerate(zip(entry.graphs, self._pieces)):
            fn = piece.replay_fn or piece.fn
            if k in handing:  # its allocations from the private pool, the same each call
                fn = self._alloc.wrap(fn)  # type: ignore[union-attr]
            entry.steps.append((graph, fn, piece.reads, piece.writes, self._last[k], k))
            if graph is not None:
                for w, t in zip(piece.writes, graph.out):
                    entry.inputs[w] = t
        entry.outputs = Outputs(
            pool_outs,
            self.config.outputs,
            self.name,
            self._pool_has,
            reuse=not torch.is_grad_enabled() and not self.guard_outputs,
            # what blocks a replay while held (.saved): the saved activations, and the outputs
            # an eager autograd node may have saved
            watch=entry.guard,
            watch_callers=user_outputs(entry, self.guard_outputs) if self.saved is not None else frozenset(),
        )
        entry.position = self.pool.register(entry)
        if self.saved is not None:
            saved_all = [pool_outs[r] for r in saved] + list(kept)
            self.saved.sealed(entry, saved_all, [pool_outs[r] for r in entry.guard])

    # ------------------------------------------------------------------ upkeep
    def _switch(self, args: tuple[Any, ...]) -> bool:
        """The inputs read in place moved (another instance of the module's class, replaced
        tensors, or for a backward another forward graph's activations: :mod:`.instances`):
        use that set's graphs, captured at its first call. False: this call runs ungraphed (a
        backward whose forward ran ungraphed, or parameters that keep moving)."""
        replayed = self.stats.replays > self._replays_mark
        found = self._instances.find(args, replayed)
        if found is not None:  # (the common case: another block of a regional model)
            self._replays_mark = self.stats.replays
            self._routes = found.routes
            return True
        ptrs = ptrs_of(args, self._in_place)
        if self.admit is not None and ptrs not in self._instances and not self.admit(args):
            self._count_fallback(
                "an input read in place (a saved activation) is not in the forward graph's "
                "pool: its forward ran without its graph"
            )
            return False
        held = lambda s: outputs_held(self._entries, s.id)  # noqa: E731
        outcome = self._instances.switch(args, ptrs, self._drop_set, held, replayed)
        self._replays_mark = self.stats.replays + (outcome == "new")  # its capture replays once
        if outcome == "moving":
            self._count_fallback(MOVING)
            return False
        self._routes = self._instances.current.routes  # type: ignore[union-attr]
        if outcome == "new" and self.sizes is not None and (self._sized or self._size_ints):
            self._capture_batch([(s, self._key(s, args)) for s in reversed(self.sizes)], args)
        return True

    def reads(self, saved: SavedActivations) -> None:
        """A backward's: its sets read ``saved``'s activations (:attr:`.Instances.feeds`)."""
        self._instances.feeds = saved

    def _drop_set(self, dropped: Any, why: str) -> None:
        keep = self.pool.keep if self.pool is not None else None
        drop_entries(self._entries, self._graphs, dropped.id, why, keep)
        if self.saved is not None:
            self.saved.keep_only(list(self._entries.values()))

    def _copy_from_now_on(self) -> None:  # handoffs kept missing: captured again, with copies
        self._handoffs = {}
        drop_entries(self._entries, self._graphs, None, DEMOTED, self.pool and self.pool.keep)
        self._instances.forget_entries()
        self._routes.clear()

    def _make_clones(self) -> None:
        outputs_to_clones(self, [e.outputs for e in self._entries.values()])

    def _count_fallback(self, reason: str) -> None:
        self.stats.fallbacks += 1
        self.fallback_reasons[reason] = self.fallback_reasons.get(reason, 0) + 1
        if reason not in self._warned:
            self._warned.add(reason)
            log.warning("torchreplay: '%s' ran ungraphed: %s", self.name, reason)

    def _in_pool(self, t: _Tensor) -> bool:
        ptr = t.untyped_storage().data_ptr()
        return any(lo <= ptr < hi for lo, hi in self._ranges)

    def _pool_has(self, t: _Tensor) -> bool:
        """Is ``t`` in the pool? Its segments only grow: asked again (milliseconds) on a miss."""
        if not self._in_pool(t):
            self._ranges = self.pool.segment_ranges() if self.pool is not None else []
        return self._in_pool(t)

    def static_ptrs(self) -> set[int]:
        """Where the live parameters and buffers it reads in place are, of each instance it has."""
        return self._instances.live()

    @property
    def instances(self) -> int:
        """How many sets of parameters and buffers (module instances) it holds graphs for."""
        return len(self._instances)

    @property
    def copies(self) -> int:
        """How many of its graphs are copies of another of the same shape (:meth:`_unblocked`)."""
        return sum(any(part[:1] == ("copy",) for part in key[-2:] if isinstance(part, tuple)) for key in self._entries)

    def captured_sizes(self) -> list[int | None]:
        return sorted({e.size for e in self._entries.values()}, key=lambda s: (s is None, s))

    def __repr__(self) -> str:
        graphed = sum(p.graphed for p in self._pieces)
        return (
            f"PiecewiseRuntime({self.name}, {graphed} graphed / {len(self._pieces)} pieces, "
            f"{self.stats.explain()})"
        )


def _pool_bytes(runtime: weakref.ReferenceType[PiecewiseRuntime]) -> int:
    rt = runtime()
    return rt.pool.reserved_bytes() if rt is not None and rt.pool is not None else 0
