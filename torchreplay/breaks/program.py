"""A model's forward as a program of segments and breaks, recorded from one eager run: what
training with breaks (:mod:`.training`) graphs.

Inference graphs the stretches between breaks by capturing the model's own run
(:mod:`.graph`). Training needs more: each stretch must be an autograd node of its own, a
forward graph and a backward graph, with the breaks' eager autograd between them. So one eager
run of the model is recorded at the aten level (a ``TorchDispatchMode``, below autograd):

- every op outside the breaks, in order, with which earlier values it reads: a caller's
  tensor, a value an earlier op or break made, or a constant (a parameter, a buffer, any
  tensor made before the run, taken as it is: in-place updates by an optimizer reach it);
- every break call (:func:`torchreplay.breaks.plan.intercept`), with where each argument
  comes from, and what it returned.

The ops between two breaks form a **segment**: a plain function of the values it reads from
outside that re-runs its ops from Python, through autograd, and returns the values later steps
read. :mod:`.training` graphs each one with ``make_graphed_callables``' machinery (forward and
backward, one autograd node). Running the ops again rather than the model's code is what makes a
stretch callable on its own: its inputs and outputs are known tensor by tensor.

A ``torch.autograd.Function`` called between breaks is recorded as one op, its ``apply``
(:mod:`.functions`): its forward's ops, run with autograd off, would lose its backward.

What is refused at record time, as a graph would freeze or fail on it: an op between breaks
whose tensors are on another device than the model's (a CPU tensor other than a 0-dim scalar),
``.item()`` and other host reads of numbers, and a tensor made inside a break and read outside it
without being returned. The model's Python between breaks runs once, at record time: a branch is
taken as it went then, as in any graph. That includes a branch on a tensor's truth value (``if
mask.all():``, HF's check for packed sequences, which HF itself skips under a capture): the read
is left out of the program and listed in :attr:`Program.branches` (a warning names each line).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Sequence

import torch

from torchreplay import _compat
from torchreplay._compat.rng import same_generator
from torchreplay.breaks.functions import FunctionWatch, check_differentiable
from torchreplay.breaks.plan import Break, check_reached, intercept, made_anew, objects, resolve_breaks
from torchreplay.breaks.recorded import Call, Op, Program, Rebound, Ref, Segment
from torchreplay.check import user_line
from torchreplay.core.args import CallArgs
from torchreplay.core.generators import per_call
from torchreplay.errors import CaptureError

__all__ = ["Ref", "Rebound", "Op", "Segment", "Call", "Program", "Seen", "observe", "record", "sample"]

_Tensor = torch.Tensor
_Handles = _compat.hook_handles_made  # its next_id counts every hook handle torch made


class _Recorder(_compat.LightDispatchMode):
    """Records each op outside the breaks (see the module)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.ids: dict[int, int] = {}  # id(tensor) -> value
        self.keep: list[Any] = []  # every value's tensor, alive so that ids stay unique
        self.others: list[Any] = []  # the tensors breaks made, alive for the same reason
        self.producer: list[int] = []  # value -> step index (-1: a caller's)
        self.steps: list[Segment | Call] = [Segment(0)]
        self.inside = 0  # breaks running now
        self.running = 0  # ops running now (a custom op's Python, a mode's)
        self.made_in_break: set[int] = set()  # ids of tensors made inside breaks
        self.problem: str | None = None  # the first op a graph would freeze or fail on
        self.where = ""  # ... the user's line
        self.fix = ""  # ... and what to do
        self.branches: list[str] = []  # where a branch read a bool on the host
        self.handles = _Handles.next_id  # hook handles made so far, those of breaks included
        self.saved_hooks: tuple[str, str] | None = None  # the first saved-tensor hooks seen
        self.saved: list[tuple[int, Any, int | None]] = []  # (break's step, tensor, version) it saved
        #: the caller's CUDA generators, each with its value: an op drawing from one reads it
        self.generators: list[tuple[torch.Generator, int]] = []

    def value(self, t: _Tensor, producer: int) -> int:
        i = len(self.keep)
        self.ids[id(t)] = i
        self.keep.append(t)
        self.producer.append(producer)
        return i

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        self.running += 1  # (what the op runs in Python is below this op: not the model's)
        try:
            out = func(*args, **kwargs)
        finally:
            self.running -= 1
        if self.inside:
            for o in _compat.tree_flatten(out)[0]:
                if isinstance(o, _Tensor):
                    self.made_in_break.add(id(o))
                    self.others.append(o)  # (its id must stay unique)
            return out
        if _Handles.next_id != self.handles:  # a hook registered since the last op or break
            self.hooked()
        if func is _ITEM and args[0].dtype == torch.bool:  # `if mask.all():` decides a branch
            self.branches.append(user_line())  # (taken as it went now: the op is not kept)
            return out
        flat, spec = _compat.tree_flatten((args, kwargs))
        refs = self.refs(func, flat)
        if func in _HOST_READS:
            self.fail(f"{func} reads a value on the host (a sync), which a graph cannot")
        segment = self.steps[-1]
        assert isinstance(segment, Segment)
        outs: list[int | None] = []
        for o in _compat.tree_flatten(out)[0]:
            if isinstance(o, _Tensor):
                known = self.ids.get(id(o))  # an in-place op returns its argument
                if known is None and any(o is x for x in flat):  # a buffer written in place
                    outs.append(None)  # (stays a constant: later ops read the buffer itself)
                    continue
                outs.append(known if known is not None else self.value(o, len(self.steps) - 1))
                self._check_device(func, o)
            else:
                outs.append(None)
        grad = torch.is_grad_enabled()
        if grad and self.saved_hooks is None:
            hooks = _compat.saved_tensor_hooks()
            if hooks is not None:
                self.saved_hooks = (hooks, user_line())
        written = _compat.written_tensors(func, args, kwargs)
        effect = (
            getattr(func, "_schema", None) is None
            or torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
            or bool(written)
        )
        writes = tuple(i for t in written if (i := self.ids.get(id(t))) is not None)
        segment.ops.append(Op(func, refs, spec, grad, outs, "" if grad else user_line(), effect, writes))
        if self.problem is not None and not self.where:
            self.where = user_line()
        return out

    def refs(self, func: Any, flat: list[Any]) -> list[Any]:
        """An op's flat arguments, its tensors as the values they are (:class:`Ref`; a tensor
        made before the run is a constant); noting what it must not read."""
        refs: list[Any] = []
        for x in flat:
            if isinstance(x, _Tensor):
                i = self.ids.get(id(x))
                if i is None and id(x) in self.made_in_break:
                    self.fail(
                        f"{func} reads a tensor a break made and did not return (it keeps it, or "
                        "sets it on a module): the next call's break makes another, which a "
                        "segment would not see; return it from the break"
                    )
                self._check_device(func, x)
                if i is not None and self.producer[i] < 0 and x.device.type != self.device.type:
                    self.fail(
                        f"{func} reads the caller's {x.device.type} tensor of shape "
                        f"{tuple(x.shape)}: a graph would take its value at capture and keep it; "
                        "pass it to a break only (it is then taken from each call), or on the GPU"
                    )
                refs.append(Ref(i) if i is not None else x)
            elif isinstance(x, torch.Generator) and self.generators:
                # (an op is handed another Python object for the caller's generator)
                i = next((v for g, v in self.generators if same_generator(x, g)), None)
                refs.append(Ref(i) if i is not None else x)
            else:
                refs.append(x)
        return refs

    def fail(self, problem: str, fix: str = "") -> None:
        """Note the first thing a program cannot do as the model does (an op between breaks
        that a graph would freeze or fail on, by default), and its fix."""
        if self.problem is None:
            self.problem = problem if fix else f"between two breaks, {problem}"
            self.fix = fix or _BREAK_IT

    def hooked(self) -> None:
        """A hook handle was made between breaks: a tensor's gradient hook (or a module's hook)
        registered by the code a segment replaces; its backward is graphed from the recorded
        ops and would run none of the hook's code."""
        self.fail(
            "a hook was registered while the code between breaks ran (a tensor's register_hook "
            "or a module hook): that code runs once, at the build, and a segment's graphed "
            "backward runs none of the hook's code",
            "Register it inside a break (the code named in breaks= runs at every call), or "
            "graph without breaks",
        )
        self.handles = _Handles.next_id

    def _check_device(self, func: Any, t: _Tensor) -> None:
        if t.device.type != self.device.type and t.dim() > 0:
            self.fail(f"{func} works on a {t.device.type} tensor of shape {tuple(t.shape)}: a graph would freeze it")


_BREAK_IT = "Name the module or function around it in breaks=, or use breaks='auto'"
_ITEM = torch.ops.aten._local_scalar_dense.default
_HOST_READS = {_ITEM, torch.ops.aten.nonzero.default,
               torch.ops.aten.masked_select.default, torch.ops.aten.unique_consecutive.default}


def _made_anew_problem(obj: Any, what: str) -> tuple[str, str]:
    return (
        f"{what} a {type(obj).__name__} the model makes anew at each call: the program would "
        "hand every call the recorded call's, with what was put in it then",
        "Make it once and pass it to the model, or leave it out (HF: use_cache=False)",
    )


def _check_copies_alias_nothing(program: Program, rec: _Recorder) -> None:
    """A value written on a copy (:attr:`Segment.copied`) must share its memory with no value
    made before that segment and read from it on: eagerly the write would show through the
    other tensor (a view of it, what it is a view of, a buffer), and through the copy it does
    not."""
    copied = [(s, v) for s in program.segments for v in s.copied]
    if not copied:
        return
    by_storage: dict[int, list[int]] = {}
    for i, t in enumerate(rec.keep):
        if isinstance(t, _Tensor):  # (not a generator argument)
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(i)
    position = {id(step): n for n, step in enumerate(program.steps)}
    for seg, v in copied:
        t = rec.keep[v]
        read = {x.i for x in program.out_flat if type(x) is Ref}
        for step in program.steps[position[id(seg)]:]:
            read.update(_refs(step))
        # (a value the segment makes from v after the write is made from the copy: fine)
        others = [u for u in by_storage[t.untyped_storage().data_ptr()]
                  if u != v and u in read and rec.producer[u] < seg.index]
        if others or t._is_view() and id(t._base) not in rec.ids:
            raise CaptureError(
                f"training with breaks: {seg.name} writes in place a tensor of shape "
                f"{tuple(t.shape)} made before the break, which shares its memory with another "
                "that is read after it (a view of it, what it is a view of, a buffer). A graph's "
                "input is a leaf that autograd lets no in-place op change, so the segment writes "
                "a copy, and the write would not show through the other. Write it out of place "
                "(h = h + x), or before the break"
            )


def _check_saved_then_written(program: Program, rec: _Recorder) -> None:
    """A value a break saved for its backward and a later segment writes in place: eager's
    backward raises ("one of the variables needed for gradient computation has been modified by
    an inplace operation"). The segment writes a copy (:attr:`Segment.copied`), so the program's
    backward would not: refused, as eager would fail."""
    for seg in program.segments:
        for v in seg.copied:
            at = rec.keep[v].untyped_storage().data_ptr()
            for step, t, version in rec.saved:
                if step < seg.index and t.untyped_storage().data_ptr() == at and _compat.version_of(t) != version:
                    call = rec.steps[step]
                    raise CaptureError(
                        f"training with breaks: break {call.brk.name} (at {call.where}) saves a "
                        f"tensor of shape {tuple(rec.keep[v].shape)} (or a view of it) for its "
                        f"backward that {seg.name} then writes in place. Eagerly the backward raises (\"one of the variables needed "
                        "for gradient computation has been modified by an inplace operation\"); the "
                        "segment writes a copy and would not. Write it out of place (h = h + x), "
                        "or clone it before the break"
                    )


def _caller_leaves(leaves: Sequence[Any]) -> dict[Any, int]:
    """The caller's non-tensor leaves, to be found again in a break's arguments: objects by
    identity, numbers by value when one leaf alone has it (as :mod:`.plan` does)."""
    found: dict[Any, int] = {}
    by_value: dict[Any, list[int]] = {}
    for i, v in enumerate(leaves):
        if isinstance(v, _Tensor) or v is None or isinstance(v, str):
            continue
        if isinstance(v, (bool, int, float)):
            by_value.setdefault((type(v), v), []).append(i)
        else:
            found[id(v)] = i
    for key, idx in by_value.items():
        if len(idx) == 1:
            found[key] = idx[0]
    return found


@dataclasses.dataclass
class Seen:
    """What one eager call of the model handed its breaks and returned: the object leaves (see
    :func:`~torchreplay.breaks.plan.objects`) of each break call's arguments, and of the output."""

    calls: list[list[tuple[int, Any]]]
    out: list[tuple[int, Any]]


def observe(model: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], breaks: Any) -> Seen:
    """Call the model once, noting the objects its breaks get and it returns, for
    :func:`record` to compare its own run with: an object that is another one at each call
    (HF's ``DynamicCache``, made in the forward, filled by the attention) cannot be a constant."""
    calls: list[list[tuple[int, Any]]] = []

    def note(brk: Break, fn: Callable[..., Any], a: Any, k: Any) -> Any:
        calls.append(objects(_compat.tree_flatten((tuple(a), dict(k)))[0]))
        return fn(*a, **k)

    with intercept(model, resolve_breaks(breaks), note):
        out = model(*args, **kwargs)
    return Seen(calls, objects(_compat.tree_flatten(out)[0]))


def record(
    model: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], breaks: Any, device: torch.device,
    python: Any = None, seen: Seen | None = None,
) -> Program:
    """Run ``model(*args, **kwargs)`` once, eagerly, recording it as a :class:`Program`.

    The caller puts module state and RNG back afterwards (the run is real: BatchNorm
    statistics move, dropout draws). ``python``: a :class:`~torchreplay.core.effects.PyState`
    comparing the Python state around the run; each break runs in its ``eager_part`` (what a
    break changes, it changes at every call). ``seen``: what an earlier call handed the breaks
    and returned (:func:`observe`); an object that differs here is made anew at each call.

    Raises:
        CaptureError: a break that never ran; an op between breaks that a graph would freeze or
            fail on (see the module), named with the user's line.
    """
    resolved = resolve_breaks(breaks)
    call = CallArgs(model, tuple(args), dict(kwargs))
    rec = _Recorder(device)
    inputs: dict[int, int] = {}
    for k, leaf in enumerate(call.leaves):
        if isinstance(leaf, _Tensor) or per_call(leaf):  # (a CUDA generator: taken from each call)
            inputs[k] = rec.ids[id(leaf)] if id(leaf) in rec.ids else rec.value(leaf, -1)
    rec.generators = [(leaf, inputs[k]) for k, leaf in enumerate(call.leaves) if per_call(leaf)]
    caller = _caller_leaves(call.leaves)
    rebound: set[int] = set()

    def on_break(brk: Break, fn: Callable[..., Any], a: Any, k: Any) -> Any:
        flat, spec = _compat.tree_flatten((tuple(a), dict(k)))
        refs: list[Any] = []
        for x in flat:
            if isinstance(x, _Tensor):
                i = rec.ids.get(id(x))
                refs.append(Ref(i) if i is not None else x)
                continue
            key = (type(x), x) if isinstance(x, (bool, int, float)) else id(x)
            leaf = caller.get(key) if x is not None and not isinstance(x, str) else None
            if leaf is not None:
                rebound.add(leaf)
                refs.append(Rebound(leaf))
            else:
                refs.append(x)
        where = user_line()
        calls = sum(isinstance(c, Call) for c in rec.steps)
        if seen is not None and calls < len(seen.calls) and rec.problem is None:
            anew = made_anew(objects(flat), seen.calls[calls])
            if anew is not None:
                rec.fail(*_made_anew_problem(anew, f"break {brk.name} gets"))
                rec.where = where
        if _Handles.next_id != rec.handles:  # registered just before the break
            rec.hooked()
            rec.where = rec.where or where
        rec.inside += 1
        at, into = len(rec.steps), rec.saved  # (where its Call goes)

        def saved(t: _Tensor) -> None:  # what it saves for its backward, with the version then
            # (t detached, see watch_saved; autograd keeps this hook as long as the node that
            # saved t, so it holds the list, never the recorder and the model's values)
            into.append((at, t, _compat.version_of(t)))

        try:
            with python.eager_part(f"break {brk.name} at {where}") if python is not None else contextlib.nullcontext(), \
                    _compat.watch_saved(saved):
                out = fn(*a, **k)
        finally:
            rec.inside -= 1
            rec.handles = _Handles.next_id  # (a break's own hooks are its business)
        step = len(rec.steps)
        outs: list[int | None] = []
        meta: list[tuple[Any, ...] | None] = []
        out_flat, out_spec = _compat.tree_flatten(out)
        for o in out_flat:
            if isinstance(o, _Tensor):
                known = rec.ids.get(id(o))
                outs.append(known if known is not None else rec.value(o, step))
                meta.append((tuple(o.shape), o.dtype, o.device))
            else:
                outs.append(None)
                meta.append(("value", o))  # a number it returns: the same at every call
        rec.steps.append(Call(brk, fn, refs, spec, outs, out_spec, meta, where))
        rec.steps.append(Segment(len(rec.steps)))
        return out

    reached: set[Break] = set()
    with rec, FunctionWatch(rec), intercept(model, resolved, on_break, reached):
        out = model(*call.args, **call.kwargs)
        if _Handles.next_id != rec.handles:  # (after the last op)
            rec.hooked()
            rec.where = rec.where or "after the last op"
    check_reached(resolved, reached)
    out_leaves, out_spec = _compat.tree_flatten(out)
    if seen is not None and rec.problem is None:
        anew = made_anew(objects(out_leaves), seen.out)
        if anew is not None:
            rec.fail(*_made_anew_problem(anew, "the model returns"))
            rec.where = "its output"
    if rec.problem is None:
        check_differentiable(rec)
    if rec.problem is not None:
        raise CaptureError(f"training with breaks: {rec.problem} (at {rec.where or '?'}). {rec.fix}")
    out_flat = [Ref(rec.ids[id(o)]) if isinstance(o, _Tensor) and id(o) in rec.ids else o for o in out_leaves]
    _drop_dead(rec.steps, out_flat)
    program = Program(
        steps=[s for s in rec.steps if not (isinstance(s, Segment) and not s.ops)],
        inputs=inputs,
        guarded={k: v for k, v in enumerate(call.leaves) if k not in inputs and k not in rebound},
        paths=list(call.paths),
        spec=call.spec,
        out_flat=out_flat,
        out_spec=out_spec,
        n_values=len(rec.producer),
        samples={},
        branches=sorted(set(rec.branches)),
        saved_hooks=rec.saved_hooks,
        generators={k: g for k, g in enumerate(call.leaves) if per_call(g)},
    )
    _link(program, rec.producer, rec.keep)
    for s in program.segments:  # (a copy is needed where autograd tracks the value)
        s.copied = [v for v in s.copied if rec.keep[v].requires_grad]
    _check_copies_alias_nothing(program, rec)
    _check_saved_then_written(program, rec)
    rec.saved.clear()
    for s in program.segments:
        for i in s.inputs:
            program.samples[i] = sample(rec.keep[i])
    return program


def sample(x: Any) -> Any:
    """A segment's sample argument: the recorded tensor detached (the run's autograd graph, and
    the gradient accumulators of the parameters in it, must not outlive the run: a capture of a
    backward would accumulate into them across streams), wanting a gradient as it did; a
    generator argument as it is."""
    if not isinstance(x, _Tensor):
        return x
    d = x.detach()
    if x.requires_grad and (x.dtype.is_floating_point or x.dtype.is_complex):
        d.requires_grad_(True)
    return d


def _drop_dead(steps: list[Segment | Call], out_flat: list[Any]) -> None:
    """Leave out each op whose results nothing reads and that writes nothing and draws no random
    numbers (a branch's condition, autograd's own ``detach`` of what it saves): a graph need not
    run it."""
    live = {x.i for x in out_flat if type(x) is Ref}
    for step in steps:
        if isinstance(step, Call):
            live.update(x.i for x in step.flat if type(x) is Ref)
    for step in reversed(steps):
        if not isinstance(step, Segment):
            continue
        kept = []
        for op in reversed(step.ops):
            if op.effect or any(v is not None and v in live for v in op.outs):
                kept.append(op)
                live.update(x.i for x in op.flat if type(x) is Ref)
        step.ops = kept[::-1]


def _refs(step: Segment | Call) -> list[int]:
    flats = [op.flat for op in step.ops] if isinstance(step, Segment) else [step.flat]
    return [x.i for flat in flats for x in flat if type(x) is Ref]


def _link(program: Program, producer: list[int], keep: list[Any]) -> None:
    """Each segment's inputs (what it reads from outside), outputs (what later steps or the
    model's output read), the values it writes on a copy (made before it and written in place
    in it, directly or through a view it makes of them) and its name."""
    last_reader: dict[int, int] = {}  # value -> the last position of a step that reads it
    for pos, step in enumerate(program.steps):
        for v in _refs(step):
            last_reader[v] = pos
    end = len(program.steps)
    for x in program.out_flat:
        if type(x) is Ref:
            last_reader[x.i] = end
    after, n = "first", 0
    for pos, step in enumerate(program.steps):
        if isinstance(step, Call):
            after = f"after {step.brk.name} at {step.where}"
            continue
        seen: set[int] = set()
        made: list[int] = []
        view_of: dict[int, int] = {}  # a view this segment makes -> the value it is a view of
        for op in step.ops:
            refs = [x.i for x in op.flat if type(x) is Ref]
            for i in refs:
                if producer[i] != step.index and i not in seen:
                    seen.add(i)
                    step.inputs.append(i)
            for v in op.outs:
                if v is not None and producer[v] == step.index:
                    made.append(v)
                    if keep[v]._is_view():
                        at = keep[v].untyped_storage().data_ptr()
                        view_of.update((v, i) for i in refs[:1] if i < v and isinstance(keep[i], _Tensor)
                                       and keep[i].untyped_storage().data_ptr() == at)
            for v in op.writes:
                while v in view_of:  # (written through a view: the copy is of what it views)
                    v = view_of[v]
                if producer[v] >= 0 and producer[v] != step.index and v not in step.copied:
                    step.copied.append(v)
        made += step.copied  # (the copy is what later steps read)
        step.outputs = sorted({v for v in made if last_reader.get(v, -1) > pos})
        step.name = f"segment {n} ({after})"
        n += 1
