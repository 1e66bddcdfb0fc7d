"""Training with breaks: ``tr.make_graphed_callables(model, sample_args, breaks=[...])``.

One eager run of the model is recorded as a program of segments and breaks
(:mod:`.program`). Each segment, the ops between two breaks, is graphed forward and backward as
one autograd node (:func:`torchreplay.training.callables.graph_callables`: one pool, in the order
they run, backwards in reverse). At each call :class:`BreakTraining` (the model's new
``forward``) replays the segments and calls the breaks eagerly between them, with eager autograd,
so a break's backward runs eagerly too (attention over host-side lengths). None of the model's
own Python runs at a call, only the breaks'.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch
import torch.nn as nn

from torchreplay import _compat
from torchreplay.breaks.auto import AutoBreak, find_on_copies
from torchreplay.breaks.functions import function_calls
from torchreplay.breaks.plan import resolve_breaks
from torchreplay.breaks.program import Call, Program, Rebound, Ref, Segment, observe, record
from torchreplay.core.args import CallArgs, infer_device
from torchreplay.core.eager_form import EagerForm
from torchreplay.core.generators import Draws, check_pairs, fits, not_fitting, pairs
from torchreplay.core.effects import PyState
from torchreplay.core.graphed import resolve_config, resolve_pool
from torchreplay.core.modes import (
    AUTOCAST, DISPATCH_MODE, HOOKS, PY_VALUE, REPLICA, REQUIRES_GRAD, TRAIN_MODE, replica_elsewhere,
)
from torchreplay.core.modes import EagerCalls, GradFlags, Hooks, refuse_inference_capture, warn_hooks_with_effects
from torchreplay.core.placed import CHANGES, GONE, Placed
from torchreplay.core.pool import Pool
from torchreplay.core.snapshot import StateSnapshot
from torchreplay.errors import CaptureError, ReplayInputError
from torchreplay.stats import TrainingStats
from torchreplay.training.callables import GraphedCallable, Launchless, graph_callables, make_graphed_callables
from torchreplay.training.verify import check_verify, resolve_tolerance

__all__ = ["BreakTraining", "auto_breaks", "break_modules", "graph_around_breaks", "inside"]

log = logging.getLogger(__name__)

_Tensor = torch.Tensor
_Handles = _compat.hook_handles_made  # its next_id counts every hook handle torch made
_dispatch_modes = _compat.dispatch_modes
_dynamo_tracing = _compat.dynamo_tracing
_no_watch = contextlib.nullcontext
_any_autocast = _compat.any_autocast
_cuda_autocast = _compat.cuda_autocast


class BreakTraining(EagerForm):
    """A model's ``forward`` after ``make_graphed_callables(model, ..., breaks=...)``: its
    segments replayed (each its forward graph and an autograd node whose backward replays its
    backward graph), its breaks called eagerly between them.

    Attributes:
        segments: one :class:`~torchreplay.training.callables.GraphedCallable` per segment.
        stats: calls and eager fallbacks of the whole forward (each segment keeps its own).
    """

    _eager_attr = "_original"  # (core/eager_form.py: what copies, pickles and inspect see)

    def __init__(
        self, model: nn.Module, program: Program, runners: list[GraphedCallable | Launchless], original: Any,
        device: torch.device | None = None, reads: Any = None,
    ) -> None:
        self._model = model
        self._reads = reads  # tensors in Python state the segments read (core/effects.py)
        # Weights and submodules the segments read where the record found them (core/placed.py);
        # a module break's own state is its business (it runs eagerly).
        breaks = break_modules(model, [c.brk for c in program.steps if isinstance(c, Call)])
        self._placed = Placed.of(model, device, objects=True, skip=breaks) if device is not None else None
        self._multi = device.index if device is not None and torch.cuda.device_count() > 1 else None
        # hooks of the modules between breaks and of the breaks themselves (none runs at a call;
        # the model's own run around this forward, those inside a break run with it)
        self._hooks = Hooks(model, own=False, backward=True, skip=inside(breaks))
        # the reasons to run a call eagerly, and their warnings, as every graph's
        self._eager = EagerCalls(type(model).__name__, model.training)
        self._eager.values = reads.values if reads is not None else None
        self._eager.hooks = self._hooks
        # parameters frozen at the build, outside module breaks: unfrozen since, they would get
        # no gradient from a segment's backward graph, which was captured without theirs
        in_breaks = {id(p) for b in breaks for p in b.parameters()}
        self._grad_flags = GradFlags(
            [p for p in model.parameters() if id(p) not in in_breaks], [model], only_unfrozen=True
        )
        self._program = program
        self._generator_pairs = pairs(program.generators)
        self._original = original
        self._training = model.training
        self.segments = runners
        self.stats = TrainingStats()
        self._eager_by_reason: dict[str, int] = {}  # fallbacks by reason, for explain()
        by_index = {s.index: r for s, r in zip(program.segments, runners)}
        # per step: (True, the graphed segment, its inputs, its outputs) or (False, the break
        # call, what rebuilds its arguments, whether it returned a tuple of leaves)
        self._steps = [
            (True, by_index[s.index], s.inputs, s.outputs) if isinstance(s, Segment) else
            (False, s, _compat.call_unflattener(s.spec), _compat.unflattener(s.out_spec) is tuple)
            for s in program.steps
        ]
        self._leaf_count = n = len(program.paths)
        # the sample's arguments were n positional leaves: a call of n tensors is taken as it
        # is, without the pytree walk (the guards still hold)
        self._plain = _compat.tree_flatten(((0,) * n, {}))[1] == program.spec

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _dynamo_tracing():  # called from code torch.compile traces: run outside it
            return _compat.call_untraced(self, args, kwargs)
        prog = self._program
        if self._model.training != self._training:
            return self._fallback(args, kwargs, TRAIN_MODE)
        # a tracer, FlopCounterMode: they see each op, eagerly (before the hooks: that one adds some)
        if _dispatch_modes():
            return self._fallback(args, kwargs, DISPATCH_MODE)
        hooks = self._hooks
        if hooks.at != _Handles.next_id and not hooks.look():  # added or removed since the build
            return self._fallback(args, kwargs, HOOKS)
        autocast = self._eager.autocast  # the recorded ops are autocast's casts and kernels
        if (autocast is not None or _any_autocast()) and _cuda_autocast() != autocast:
            return self._fallback(args, kwargs, AUTOCAST)
        if self._grad_flags.changed():
            return self._fallback(args, kwargs, REQUIRES_GRAD, self._grad_flags.describe())
        if self._multi is not None and replica_elsewhere(self, self._multi):  # nn.DataParallel's
            return self._fallback(args, kwargs, REPLICA)
        values = self._eager.values
        if values is not None and values.changed():  # a flag, a scale the model's code read
            return self._fallback(args, kwargs, PY_VALUE)
        placed = self._placed
        if placed is not None and (
            placed.seen != CHANGES[0] or placed.table.get(placed.key, GONE).data_ptr() != placed.at
        ) and placed.moved():
            raise placed.error(type(self._model).__name__)
        if self._reads is not None:
            stale = self._reads.replaced(type(self._model).__name__)
            if stale is not None:
                raise stale
        if self._plain and not kwargs and len(args) == self._leaf_count and all(type(a) is _Tensor for a in args):
            leaves, spec = args, prog.spec
        else:
            leaves, spec = _compat.tree_flatten((args, kwargs))
        if spec != prog.spec:
            raise ReplayInputError(
                f"{type(self._model).__name__} (graphed around breaks) was called with another "
                f"structure of arguments than its sample ({len(leaves)} leaves, {self._leaf_count} "
                "at capture); call it as it was graphed"
            )
        for k, value in prog.guarded.items():
            now = leaves[k]
            if now is not value and not (type(now) is type(value) and now == value):
                raise _guard_error(prog.paths[k], now, value)
        if prog.generators:  # (each segment's graph binds its stand-in to the call's)
            self._check_generators(leaves)
        env: list[Any] = [None] * prog.n_values
        for k, v in prog.inputs.items():
            env[v] = leaves[k]
        for segment, step, ins, outs in self._steps:
            if segment:
                got = step(*[env[i] for i in ins])
                for v, o in zip(outs, got):
                    env[v] = o
            else:
                self._call_break(step, ins, outs, env, leaves)
        self.stats.replays += 1
        out = [env[x.i] if type(x) is Ref else x for x in prog.out_flat]
        return _compat.tree_unflatten(out, prog.out_spec)

    def _check_generators(self, leaves: Any) -> None:
        """A generator argument may be any CUDA generator on the sample's device, passed in
        one place where the sample passed one generator in two, and in two where it passed two."""
        prog = self._program
        for k, sample in prog.generators.items():
            if not fits(sample, leaves[k]):
                raise not_fitting(prog.paths[k], leaves[k], sample)
        check_pairs(self._generator_pairs, leaves, prog.paths)

    def _call_break(
        self, step: Call, unflatten: Callable[[list[Any]], Any], tuple_out: bool, env: list[Any], leaves: Any,
    ) -> None:
        flat = [env[x.i] if type(x) is Ref else leaves[x.leaf] if type(x) is Rebound else x for x in step.flat]
        a, k = unflatten(flat)
        out = step.call(*a, **k)
        # (another structure than the recorded one fails the count or the checks below)
        if type(out) is _Tensor:
            got = [out]
        else:
            got = list(out) if tuple_out and type(out) is tuple else _compat.tree_flatten(out)[0]
        if len(got) != len(step.outs):
            raise ReplayInputError(
                f"break {step.brk.name} (at {step.where}) returned {len(got)} values, "
                f"{len(step.outs)} when the model was graphed around it"
            )
        for v, o, meta in zip(step.outs, got, step.meta):
            if v is None:
                if meta[0] == "value" and not (o is meta[1] or type(o) is type(meta[1]) and o == meta[1]):
                    raise ReplayInputError(
                        f"break {step.brk.name} (at {step.where}) returned {o!r} where it returned "
                        f"{meta[1]!r} when the model was graphed around it; the code after it ran "
                        "once, with that value. Return it as a tensor, or keep it fixed"
                    )
                continue
            if not isinstance(o, _Tensor) or (tuple(o.shape), o.dtype, o.device) != meta:
                seen = (tuple(o.shape), o.dtype, o.device) if isinstance(o, _Tensor) else type(o).__name__
                raise ReplayInputError(
                    f"break {step.brk.name} (at {step.where}) returned {seen} where it returned "
                    f"{meta} when the model was graphed around it; the segment after it reads "
                    "that shape. Keep a break's outputs' shapes fixed (pad them)"
                )
            env[v] = o

    def _fallback(self, args: tuple[Any, ...], kwargs: dict[str, Any], why: str, what: str = "") -> Any:
        self._eager_by_reason[why] = self._eager_by_reason.get(why, 0) + 1
        return self._eager.run(self._eager_fn(), args, kwargs, why, self.stats, what)

    def explain(self) -> str:
        """Each step in order: a segment with its ops and counters, or a break."""
        reasons = ", ".join(f"{why}: {n}" for why, n in self._eager_by_reason.items())
        lines = [
            f"{type(self._model).__name__}: graphed around its breaks for training, "
            f"{len(self.segments)} segment(s); calls={self.stats.replays} fallbacks={self.stats.fallbacks}"
            + (f" ({reasons})" if reasons else "")
        ]
        by_index = {s.index: (s, r) for s, r in zip(self._program.segments, self.segments)}
        for step in self._program.steps:
            if isinstance(step, Segment):
                seg, r = by_index[step.index]
                lines.append(
                    f"  {seg.name}: {len(seg.ops)} ops{function_calls(seg.ops)}, {len(seg.inputs)} in, "
                    f"{len(seg.outputs)} out; "
                    + (Launchless.WHY if isinstance(r, Launchless) else r.stats.explain())
                )
            else:
                lines.append(f"  break {step.brk.name} at {step.where}: eager")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"BreakTraining({type(self._model).__name__}, {len(self.segments)} segments)"


def _guard_error(path: str, now: Any, value: Any) -> ReplayInputError:
    """A call whose non-tensor argument ``now`` is not the ``value`` the segments ran with (a
    CUDA generator is not one: it is taken from each call)."""
    return ReplayInputError(
        f"{path} is {now!r}, but the model was graphed around its breaks with {value!r}: the "
        "code between breaks ran once with it. Pass it to a break only (it is then taken from "
        "each call), or as a tensor, or graph again"
    )


def break_modules(model: nn.Module, breaks: Any) -> list[nn.Module]:
    """The modules of ``model`` that are module or class breaks."""
    return [m for m in model.modules() if any(
        b.kind == "module" and b.target is m or b.kind == "class" and isinstance(m, b.target) for b in breaks)]


def inside(breaks: list[nn.Module]) -> list[nn.Module]:
    """The modules inside module breaks (not the breaks themselves): a break calls them, hooks
    and all, at every call."""
    return [d for b in breaks for d in b.modules() if d is not b]


def _check_hooks(model: nn.Module, breaks: Any) -> None:
    """Hooks at the build: a backward hook of a module between breaks (or of a break, whose
    ``forward`` is called without its hooks) is refused, since a segment's backward is graphed
    from ops recorded below autograd and runs none of its code; forward hooks whose Python does
    more than compute tensors run it at the build only (a warning, as for every graph)."""
    mods = break_modules(model, resolve_breaks(breaks))
    hooks = Hooks(model, own=False, backward=True, skip=inside(mods))
    name = type(model).__name__
    back = hooks.backward_ones()
    if back:
        raise CaptureError(
            f"make_graphed_callables(breaks=...): {name} has backward hooks (on "
            f"{', '.join(sorted(set(back))[:5])}): a segment's backward is graphed from the ops "
            "its forward ran and would run none of their code, so a gradient they change would "
            "differ from eager's. Remove them while training with breaks, register them on a "
            "module inside a break (which runs eagerly), or graph without breaks"
        )
    warn_hooks_with_effects(name, hooks)


def _warn_program(name: str, program: Program) -> None:
    """What the program takes as the recorded run did, said once at the build."""
    if program.branches:
        log.warning(
            "torchreplay: %s graphed around its breaks: a branch on a tensor's value between "
            "breaks (%s) is taken as it went in the recorded run at every call, as in a "
            "graph; if it can go the other way, name the code around it in breaks=",
            name, "; ".join(program.branches),
        )
    if program.saved_hooks is not None:
        log.warning(
            "torchreplay: %s graphed around its breaks: saved-tensor hooks were active between "
            "breaks (%s, at %s): activation checkpointing (use_reentrant=False) or offloading "
            "(save_on_cpu). A segment's graphed backward reads what its forward saved in the "
            "graph's own memory and runs none of them: gradients are eager's, but the memory "
            "they save is not saved", name, *program.saved_hooks,
        )


def record_checked(
    model: nn.Module, call: CallArgs, breaks: Any, device: torch.device,
    build: Callable[[Program], Any] = lambda program: None, draws: Draws | None = None,
) -> tuple[Program, Any, Any]:
    """:func:`~torchreplay.breaks.program.record`, with the Python state the model reaches
    compared around the recorded run (core/effects.py), as for any graph: the model's code
    between breaks ran once, so a change it makes there (a counter, a list grown, a tensor
    replaced after being read) is a :class:`CaptureError`; what a break changes is its own. One
    eager call first, without autograd, shows what every call changes (a first call's setup is
    no change). ``build(program)`` then graphs it. What these runs and the build write in place
    into tensors of Python state (a position counter) is put back. Returns the program, the
    tensors in Python state it reads (:class:`~torchreplay.core.reads.StateReads`, checked
    at each call; None: none) and what ``build`` returned. ``draws``: watches the first run,
    which finds the generators the model draws from where they stand (put back after)."""
    _check_hooks(model, breaks)
    python = PyState(type(model).__name__, model, call.args, call.kwargs, modules=lambda: [model], reads=True)
    # (autocast's cache would keep the run's casts of the weights, with their autograd graph
    # made on this stream, alive into the backward captures)
    with python.building(), _compat.autocast_cache_disabled():
        with python.warmup(last=True), torch.no_grad(), draws.watch(compare=False) if draws else _no_watch():
            seen = observe(model, call.args, call.kwargs, breaks)
        python.put_back_tensors()
        with python.captured():
            program = record(model, call.args, call.kwargs, breaks, device, python, seen)
        error = python.verdict()
        if error is not None:
            raise error
        _warn_program(type(model).__name__, program)
        python.put_back_tensors()
        built = build(program)
        python.put_back_tensors()
    return program, python.reads(), built


def auto_breaks(model: nn.Module, call: CallArgs, device: torch.device) -> list[AutoBreak]:
    """``breaks="auto"``: the modules :func:`torchreplay.breaks.auto.find_breaks` chooses
    around each op that cannot be captured (none: the whole model can be graphed), each with
    that op."""
    found = find_on_copies(model, call, device)
    for b in found:
        log.info("torchreplay: breaks='auto' breaks at %s", b)
    return found


def graph_around_breaks(
    model: Any,
    sample_args: Any,
    breaks: Any,
    *,
    sample_kwargs: Any,
    allow_unused_input: bool,
    num_warmup_iters: int | None,
    pool: Any,
    outputs: str | None,
    capture_error_mode: str | None,
    config: Any,
    verify: int,
    verify_tol: Any,
) -> nn.Module:
    """``tr.make_graphed_callables(model, sample_args, breaks=...)``: record the model
    (:func:`record_checked`), graph each segment, and return ``model`` with its ``forward``
    replaced by the :class:`BreakTraining` that runs them (as torch's tool replaces a
    module's ``forward``)."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"make_graphed_callables(breaks=...) graphs a module around its breaks: pass the "
            f"model (an nn.Module), got {type(model).__name__}; for a tuple of callables, graph "
            "each piece between the breaks yourself (without breaks=)"
        )
    if not isinstance(sample_args, (tuple, list)):
        raise TypeError(
            f"sample_args must be a tuple of the model's positional arguments, e.g. (x,), got "
            f"{type(sample_args).__name__}"
        )
    if sample_kwargs is not None and not isinstance(sample_kwargs, dict):
        raise TypeError(f"sample_kwargs must be a dict, got {type(sample_kwargs).__name__}")
    refuse_inference_capture("make_graphed_callables")
    call = CallArgs(model, tuple(sample_args), dict(sample_kwargs or {}))
    device = infer_device(model, call)
    verify = check_verify(verify)
    tol = resolve_tolerance(verify_tol)
    cfg = resolve_config(
        config, outputs=outputs, num_warmup_iters=num_warmup_iters, capture_error_mode=capture_error_mode
    )
    chosen: list[AutoBreak] = []  # (with breaks="auto": each module and the op that made it one)
    if isinstance(breaks, str) and breaks == "auto":
        chosen = auto_breaks(model, call, device)
        breaks = [b.module for b in chosen]
        if not breaks:  # nothing that cannot be captured: the whole model is one graph
            log.info("torchreplay: breaks='auto' found nothing to break at: %s is graphed whole", type(model).__name__)
            return make_graphed_callables(
                model, call.args, sample_kwargs=call.kwargs, pool=pool, config=cfg,
                allow_unused_input=allow_unused_input, verify=verify, verify_tol=verify_tol,
            )
    original = model.forward

    def graph(program: Program) -> list[GraphedCallable | Launchless]:
        segments = program.segments
        if not segments:
            why = "".join(f"; breaks='auto' broke at {b}" for b in chosen)
            raise CaptureError(
                f"make_graphed_callables(breaks=...): every op of {type(model).__name__} ran "
                "inside a break, so nothing is left to graph; break at smaller modules (the "
                f"attention, not the decoder layer){why}. Where an op made a module a break, "
                "changing that op graphs the module (tr.check(model, *args) says how for each)"
            )
        return graph_callables(
            [s.function() for s in segments],
            [tuple(program.samples[i] for i in s.inputs) for s in segments],
            [{} for _ in segments],
            device=device,
            pool=resolve_pool(pool) or Pool(device),
            config=cfg,
            # a value a segment reads but does not differentiate through (a rotary
            # embedding reads only the hidden states' dtype) is the model's business
            allow_unused=True,
            verify=verify,
            tol=tol,
            names=[s.name for s in segments],
        )

    # The recorded run and the captures run the model for real: its buffers (BatchNorm
    # statistics), copied whole, and the RNG are put back after.
    snapshot = StateSnapshot(model, device, large="copy")
    # (and the generators passed as arguments: the build leaves them where they stood)
    snapshot.draws.keep(call.leaves)
    try:
        program, reads, runners = record_checked(model, call, breaks, device, build=graph, draws=snapshot.draws)
    finally:
        snapshot.restore()
    program.samples.clear()
    runtime = BreakTraining(model, program, runners, original, device, reads)
    model.forward = runtime  # type: ignore[method-assign]
    log.info("torchreplay: %s", runtime.explain())
    return model
