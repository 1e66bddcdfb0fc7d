"""``tr.graph(fn, *args, breaks=[...])``: CUDA graphs of everything between the calls that run eagerly.

A capture (once per size, largest first, all sizes in one pool) is one run of the model:

1. the stream capture begins; the model's Python runs;
2. at each break call the capture ends (segment ``k`` is a graph), the segment is replayed once so
   that its memory holds real values, the break runs eagerly for real on the capture stream, and
   the capture of segment ``k + 1`` begins; the break's outputs stay where segment ``k + 1`` read
   them;
3. after the model returns, the last segment ends.

A replay runs the :class:`~torchreplay.pieces.runtime.PiecewiseRuntime` (the runtime of the
``torch.compile`` backend: one runtime, two front ends): segment 0 replays, break 0 is called with
the tensors it got at capture (same addresses, this call's contents) and this call's host values,
its outputs are checked and copied to where segment 1 reads them, segment 1 replays, and so on. No
Python of the rest of the model runs.

What a break reads at replay (the rule, fixed at the first capture; see
:mod:`torchreplay.breaks.plan`): a CUDA tensor the caller passed is read in the graph's input
buffer, which holds this call's values; a tensor made inside the model is read where the segment
before left it; a non-tensor or CPU value the caller passed (sequence lengths, a block table on
the host) is taken from this call, never frozen; any other value (computed inside the model) is
the constant it was at capture.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Callable, Sequence

import torch

from torchreplay import _compat
from torchreplay.config import RANKS, BucketConfig, GraphConfig, RankConfig
from torchreplay.core.args import CallArgs, called_module, fn_name, infer_device, owning_module
from torchreplay.core.capture import on_side_stream, side_stream
from torchreplay.core.eager_form import EagerForm
from torchreplay.core.generators import bind, check_pairs, hand_back, not_fitting, pairs, stand_ins
from torchreplay.core.snapshot import BUILD_FIRST, SAMPLE_COPIES, StateSnapshot, copies
from torchreplay.core.effects import PyState
from torchreplay.core.modes import GRAD, REPLICA, EagerCalls, replica_elsewhere, tracked_leaf
from torchreplay.core.padcheck import Checked, StateCheck, distributed, rng_state, same_rng
from torchreplay.core.padding import flat_call
from torchreplay.core.placed import CHANGES, GONE, Placed
from torchreplay.core.pool import Pool, release_with
from torchreplay.core.writes import WriteWatch
from torchreplay.distributed import agreement
from torchreplay.errors import CaptureError, ReplayInputError, UnsupportedError
from torchreplay.breaks.auto import AutoBreak, find_on_copies
from torchreplay.breaks.sized import padding_sample
from torchreplay.breaks.policy import eager_by_policy
from torchreplay.breaks.report import report
from torchreplay.breaks.steps import BreakStep, returns_nothing
from torchreplay.breaks.plan import Break, BreakCall, Recorder, check_reached, intercept, resolve_breaks
from torchreplay.breaks.runtime import BreakableRuntime
from torchreplay.pieces.program import Input, Piece, Program, Split
from torchreplay.pieces.ranks import agree_size, run_eagerly_at
from torchreplay.sizes.plan import plan_inputs

__all__ = ["BreakableGraph"]

log = logging.getLogger(__name__)
_dynamo_tracing = _compat.dynamo_tracing

_Tensor = torch.Tensor
_LEAF = _compat.tree_flatten(0)[1]


class _Eager:
    """What the runtime hands back for a call it ran ungraphed: the model's own result."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _modules_run(front: weakref.ReferenceType[BreakableGraph]) -> list[torch.nn.Module]:
    """The modules a breakable graph's callable runs (its own, or those its plan found)."""
    g = front()
    return [] if g is None else g._runs or ([g._module] if g._module is not None else [])


def _no_segment(*_: Any) -> Sequence[Any]:
    raise AssertionError("a segment of a breakable graph has no code of its own to run")


class BreakableGraph(EagerForm):
    """A callable captured as CUDA graph segments around the calls named in ``breaks=``.

    Built by ``tr.graph(fn, *sample_args, breaks=[...])`` (see :func:`torchreplay.graph` for the
    options it shares). Attributes: ``stats`` (captures, replays, fallbacks), ``breaks`` (each
    break call of the plan, in order, with its rules and the model's ``file:line``), ``runtime``.

    With ``sizes=``, every segment is captured per size, in one pool, and a break gets the padded
    rows: its tensor arguments have the captured size, not the call's. To let a break see the
    real count, pass it as a host argument of the call (an int, or a CPU tensor of lengths): it is
    re-bound each call.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        sample_args: Sequence[Any],
        sample_kwargs: dict[str, Any],
        *,
        breaks: Any,
        sizes: Sequence[int] | None,
        dim: Any,
        fill_value: Any,
        config: GraphConfig,
        pool: Pool | None,
        device: torch.device | int | str | None,
        ranks: RankConfig = RANKS,
        options: BucketConfig | None = None,
    ) -> None:
        auto = isinstance(breaks, str) and breaks == "auto"
        resolved = () if auto else resolve_breaks(breaks)
        if not auto and not resolved:
            raise ValueError(
                "breaks= names nothing: give the modules, functions or ops to run eagerly "
                '(or "auto"), or graph without breaks='
            )
        call = CallArgs(fn, sample_args, sample_kwargs)
        # A CUDA generator argument is taken from every call, as tr.graph takes it: the segments
        # draw from a stand-in of the graph's own (the build draws from it: the sample's is not
        # moved), put where the call's generator stands, which then moves on as the replay drew.
        self._gens = stand_ins(call.leaves)
        self._generator_pairs = pairs(self._gens)
        if self._gens:
            call = call.with_leaves([self._gens.get(i, leaf) for i, leaf in enumerate(call.leaves)])
            sample_args, sample_kwargs = call.args, call.kwargs
        self.fn = fn
        self.name = fn_name(fn)
        self.device = infer_device(fn, call, device)
        self.config = config
        self._module = owning_module(fn)
        self._runs: list[torch.nn.Module] = []  # a plain function's modules, found by the plan
        #: the Python state a segment changes (core/effects.py); the breaks' changes are real
        self._python = PyState(self.name, fn, sample_args, sample_kwargs, reads=True,
                               modules=functools.partial(_modules_run, weakref.ref(self)))
        with self._python.building():  # (undone on any error)
            #: with ``breaks="auto"``: the modules chosen, each with the op that made it a break
            self.auto: list[AutoBreak] = []
            if auto:
                self.auto = self._find(call)
                resolved = tuple(Break("module", b.module, b.path) for b in self.auto)
            self._breaks = resolved
            self._placed: Placed | None = None  # at the first capture
            self._copy_large: set[int] | None = None  # the large buffers the sample call wrote
            self._spec = call.spec
            self._paths = tuple(call.paths)
            self._nargs = call.nargs
            self._only_args = len(call.leaves) == call.nargs and not call.kw_keys
            self._unflatten = call.unflatten
            dims = plan_inputs(call, dim, fill_value) if sizes is not None else None
            # what the sample call and the padded first capture leave in state (core/padcheck.py)
            # (none where no capture pads the sample, or under torch.distributed: not checked)
            padded = dims is not None and sizes is not None and dims.size < max(sizes) and not distributed()
            self._state_check = StateCheck(self.device) if padded else None
            self.breaks, out, written = self._plan(call)
            # the sample call's outputs, unpadded, until the first capture (padded) checks them
            self._unpadded = padding_sample(self.name, out, dims, sizes, self._drew, self._state_check)
            self._state_check = None
            out_leaves, self._out_spec = _compat.tree_flatten(out)
            self._out_single = len(out_leaves) == 1 and self._out_spec == _LEAF
            self._rebuild = _compat.unflattener(self._out_spec)
            self._sample_rows = dims.size if dims is not None else None
            self._sample_out = [tuple(t.shape) if isinstance(t, _Tensor) else None for t in out_leaves]
            program = self._program(call, dims, written, len(self._sample_out))
            self._options = options
            # capture="lazy", fallback="error" or max_graphs: each call's size goes through the policy
            self._policy_on = options is not None and (
                options.capture == "lazy" or options.fallback == "error" or options.max_graphs is not None
            )
            #: the collectives of the first capture (its segments and breaks), in order
            self.collectives: tuple[Any, ...] | None = None
            self._collective_log: Any = None
            self.runtime = BreakableRuntime(
                self, program, name=self.name, sizes=sizes, config=config, pool=pool,
                max_graphs=1 if sizes is None else 8,
            )
            self.stats = self.runtime.stats
            if isinstance(self._unpadded, Checked):  # (not checked: no capture pads the sample)
                self.stats.padding_check, self._unpadded = self._unpadded.summary, None  # type: ignore[union-attr]
            self.runtime.prepare(tuple(call.leaves))
            # after capture: hooks a warm-up removed (a lazy module's) are not counted as changed
            self._training = self._module.training if self._module is not None else False
            self._eager_calls = EagerCalls(self.name, self._training, self._module)  # core/modes.py
            self._multi = self.device.index if torch.cuda.device_count() > 1 else None  # (replicas)
            self._ranks = agreement(
                ranks, self.collectives or (), self._collective_log, name=self.name,
                parts=[sizes, [b.brk.name for b in self.breaks]], sizes=sizes is not None,
                device=self.device,
            )
            release_with(self.runtime, self.collectives or (), self._ranks)
            self._collective_log = None
        self._reads = self._python.reads()
        self._eager_calls.values = self._reads.values if self._reads is not None else None

    # ------------------------------------------------------------------ the plan
    def _check_devices(self, call: CallArgs) -> None:
        for path, leaf in zip(call.paths, call.leaves):
            if isinstance(leaf, _Tensor) and leaf.is_cuda and leaf.device != self.device:
                raise CaptureError(f"{path} is on {leaf.device}, but '{self.name}' runs on {self.device}")

    def _copies(self, call: CallArgs) -> list[Any]:
        """The sample's leaves, tensors copied (a run on them leaves the caller's alone)."""
        self._check_devices(call)
        named = [(p, x) for p, x in zip(call.paths, call.leaves) if isinstance(x, _Tensor)]
        with _compat.normal_tensors():  # their version counters tell the writes
            copied = iter(copies(named, self.device, fix=BUILD_FIRST, what=SAMPLE_COPIES, whole=True))
        return [next(copied)[1] if isinstance(x, _Tensor) else x for x in call.leaves]

    def _find(self, call: CallArgs) -> list[AutoBreak]:
        """``breaks="auto"``: one checked eager run on copies of the sample finds the modules."""
        self._check_devices(call)
        with self._python.build_call():  # (its writes into Python state are put back)
            found = find_on_copies(self.fn, call, self.device)
        for b in found:
            log.info("torchreplay: '%s' breaks at %s", self.name, b)
        return found

    def _plan(self, call: CallArgs) -> tuple[list[BreakCall], Any, set[int]]:
        """Run the model once, eagerly, on copies of the sample: which breaks it calls, in what
        order, with what, and which arguments it writes. Module state is put back after."""
        device = self.device
        leaves = self._copies(call)
        tensors = [i for i, x in enumerate(leaves) if isinstance(x, _Tensor) and x.is_cuda]
        recorder = Recorder(leaves, call.paths)
        reached: set[Any] = set()
        # (a module's large buffers: which of them the call writes, copied whole at capture)
        sums = self._module is not None and self.config.restore_state
        snapshot = StateSnapshot(self._module, device, find=self._module is None, sums=sums)
        watch = WriteWatch([leaves[i] for i in tensors])
        args, kwargs = call.unflatten(leaves)
        rng = rng_state(device)
        try:
            with on_side_stream(side_stream(device), device), torch.no_grad(), self._python.build_call():
                with (
                    watch, intercept(self.fn, self._breaks, recorder, reached), snapshot.running(),
                    snapshot.draws.watch(compare=False),  # (put back after; its padding check skipped)
                ):
                    out = self.fn(*args, **kwargs)
                self._copy_large = {id(t) for _, t in snapshot.written_large()} if sums else None
                if self._state_check is not None:  # (all of it: a segment's replay moves no version)
                    self._state_check.after_first(
                        [(n, t) for n, t, _ in snapshot.kept()] + [(n, t) for n, t, _ in self._python.held_tensors()])
            self._drew = not same_rng(rng, rng_state(device)) or snapshot.draws.explicit  # (outputs not comparable)
        except Exception as exc:
            raise CaptureError(
                f"the sample call of '{self.name}' raised {type(exc).__name__}: {exc}; it fails "
                "eagerly too: fix the call before graphing it"
            ) from exc
        finally:
            snapshot.restore()
            self._python.put_back_tensors()  # (the warm-ups start from the caller's state)
        if self._state_check is not None:
            self._state_check.after_reset()
        if snapshot.called is not None:  # a plain function: the modules it ran
            self._module = called_module(snapshot.called)
            self._runs = list(snapshot.called)
        check_reached(self._breaks, reached)
        read = {r.leaf for c in recorder.calls for r in c.rules if r.leaf is not None}
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, _Tensor) and not leaf.is_cuda and i not in read:
                raise UnsupportedError(
                    f"{call.paths[i]} is a CPU tensor that no break reads: a graph would hold its "
                    "value at capture. Pass it on the GPU, or break at the code that reads it "
                    "(breaks=[...]), where it is taken from each call"
                )
        return recorder.calls, out, {tensors[j] for j in watch.written}

    def _program(self, call: CallArgs, dims: Any, written: set[int], n_out: int) -> Program:
        rebound = {r.leaf for c in self.breaks for r in c.rules if r.kind == "rebound"}
        inputs = []
        for i, (path, leaf) in enumerate(zip(call.paths, call.leaves)):
            if isinstance(leaf, _Tensor) and leaf.is_cuda:
                d = dims.dims[i] if dims is not None else None
                fill = dims.fills[i] if d is not None else 0
                inputs.append(Input(path, "tensor", dim=d, written=i in written, fill=fill))
            else:
                inputs.append(Input(path, "host" if i in rebound else "other"))
        slot = len(inputs)
        pieces = []

        def take(n: int) -> tuple[int, ...]:
            nonlocal slot
            slot += n
            return tuple(range(slot - n, slot))

        made: tuple[int, ...] = ()  # the last break's outputs: the next segment copies them in
        for k, rec in enumerate(self.breaks):
            own = take(sum(r.leaf is None for r in rec.rules))  # read where the segment left them
            outputs = () if returns_nothing(rec) else rec.outputs
            bufs = take(len(outputs))
            mine = iter(own)
            reads = tuple(r.leaf if r.leaf is not None else next(mine) for r in rec.rules) + bufs
            pieces.append(Piece(_no_segment, made, own + bufs, True, f"segment {k}"))
            step = BreakStep(rec, f"{rec.brk.name}#{k}")
            # A break that returns nothing, called with its arguments as they are: the step is
            # the break itself (nothing to check or copy after it).
            fn = step.call if step.none and step.flat and not step.kw else step
            made = take(len(outputs))
            pieces.append(Piece(
                fn, reads, made, False, f"break {k}",
                Split(rec.brk.name, "named in breaks=", rec.where),
            ))
        final = take(n_out)
        pieces.append(Piece(_no_segment, made, final, True, f"segment {len(self.breaks)}"))
        return Program(tuple(inputs), pieces, final)

    # ------------------------------------------------------------------ the call
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _dynamo_tracing():  # called from code torch.compile traces: run outside it
            return _compat.call_untraced(self, args, kwargs)
        if self._only_args and not kwargs and len(args) == self._nargs:
            leaves: Sequence[Any] = args
        else:
            leaves = self._flatten(args, kwargs)
        module = self._module
        calls = self._eager_calls  # core/modes.py: what a replay cannot do as eager does
        grad = torch.is_grad_enabled()
        why = calls.reason(module, leaves if grad else None)
        if why is None and self._multi is not None and replica_elsewhere(self, self._multi):
            why = REPLICA  # nn.DataParallel's replica on another GPU: its own forward, eagerly
        mode_changed = why is not None
        placed = self._placed  # the model moved, or weights or submodules replaced
        moved = placed is not None and (
            placed.seen != CHANGES[0] or placed.table.get(placed.key, GONE).data_ptr() != placed.at
        ) and placed.moved()
        reads = self._reads  # a tensor in Python state it reads, replaced since (core/effects.py)
        stale = placed.error(self.name) if moved else reads and reads.replaced(self.name)  # type: ignore[union-attr]
        size = None
        if self._ranks is not None:  # collectives inside: the ranks agree first
            size, rows = agree_size(self._ranks, self.runtime, leaves, mode_changed or bool(stale))
        if stale:
            raise stale
        if self._ranks is not None:
            if size == -1 and not mode_changed:
                self.runtime._count_fallback("a call above the largest captured size (on a rank)")
                with torch.no_grad():
                    out = run_eagerly_at(self.runtime, flat_call(self._eager_fn(), self._spec), leaves, rows)
                return _compat.tree_unflatten(out, self._out_spec)
        if self._policy_on and not mode_changed and eager_by_policy(self, leaves, size):
            with torch.no_grad():
                return self._eager_fn()(*args, **kwargs)
        if why is not None:
            k = tracked_leaf(leaves) if why == GRAD else None
            what = self._paths[k] if k is not None else ""
            return calls.run(self._eager_fn(), args, kwargs, why, self.stats, what)
        if self._gens:
            return self._taking_generators(leaves, size, grad)
        return self._replay(leaves, size, grad)

    def _replay(self, leaves: Sequence[Any], size: int | None, grad: bool) -> Any:
        if grad:
            with torch.no_grad():
                out = self.runtime(*leaves, size=size)
        else:
            out = self.runtime(*leaves, size=size)
        if out.__class__ is _Eager:
            return out.value  # type: ignore[attr-defined]
        if self._out_single:
            return out[0]
        return self._rebuild(list(out))

    def _taking_generators(self, leaves: Sequence[Any], size: int | None, grad: bool) -> Any:
        """A call of a graph that draws from generator arguments: each stand-in is put where the
        call's generator stands; after the replay (or its failure), the call's generators stand
        where the replay left the stand-ins, as eager leaves them (core/generators.py)."""
        leaves = list(leaves)
        called = []
        for i, own in self._gens.items():
            gen = leaves[i]
            if not bind(own, gen):
                raise not_fitting(self._paths[i], gen, own)
            called.append((own, gen))
        if self._generator_pairs:
            check_pairs(self._generator_pairs, leaves, self._paths)
        for i, own in self._gens.items():
            leaves[i] = own
        try:
            return self._replay(leaves, size, grad)
        finally:
            for own, gen in called:
                hand_back(own, gen)

    def _flatten(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        leaves, spec = _compat.tree_flatten((args, kwargs))
        if spec != self._spec:
            raise ReplayInputError(
                f"'{self.name}' was captured with arguments {self._spec}, called with {spec}: "
                "pass the same structure (the same positional and keyword arguments)"
            )
        return leaves

    def run_eagerly(self, leaves: Sequence[Any]) -> _Eager:
        args, kwargs = self._unflatten(leaves)
        return _Eager(self._eager_fn()(*args, **kwargs))

    def explain(self) -> str:
        """What was graphed and what runs eagerly (:func:`torchreplay.breaks.report.report`)."""
        return report(self)

    def __repr__(self) -> str:
        names = sorted({c.brk.name for c in self.breaks})
        return (
            f"BreakableGraph({self.name}, {len(self.breaks)} break calls of {', '.join(names)}, "
            f"{len(self.breaks) + 1} segments, {self.stats.explain()})"
        )
