"""The eager calls a many-size graph makes before it captures: how its outputs slice, and whether
padding changes the real rows.

- Two calls, at the largest size and the next one down, learn which output dimensions equal the
  size (:func:`~torchreplay.sizes.outputs.plan_outputs`).
- One more call (none when the sample's rows are the next size down) gives the same real rows
  once padded to the largest size and once unpadded. A callable whose rows are independent
  returns the same real rows both times, up to the rounding of kernels picked per shape; a
  reduction or a normalisation across the rows (``x - x.mean(0)``, attention over padded
  positions left unmasked) does not. A difference beyond the tolerance of the output's dtype is
  reported once, at construction, naming the output, the rows and the fix: padding would hand the
  caller results that differ from eager.

Each call starts from the caller's state (module buffers, Python state, adopted arguments and
the buffers arguments are copied into, put back in between), so a callable that advances a
position at every call compares like with like. The check compares besides the outputs what the
two calls leave behind (core/padcheck.py :class:`StateCheck`): the rows of an argument written in
place, as outputs; module buffers, tensors Python state holds and fixed arguments, element by
element. A count that follows the padded size, a padding position that writes over a real row's
slot: reported as a wrong output is. Padding rows that write state of their own (a KV cache's
rows past the batch): a note in ``stats.padding_check``.

The padding check is skipped, with a debug line, when it cannot compare like with like: a call
that draws random numbers (dropout in training mode), one that writes an argument too large to
copy or (with ``restore_state=False``) a module buffer, which nothing puts back; and under
torch.distributed, where the ranks' samples may differ in rows, so one rank would make the extra
call and another not (a collective inside would hang).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, Sequence

import torch

from torchreplay import _compat
from torchreplay.core.capture import from_the_start, on_side_stream
from torchreplay.core.effects import PyState
from torchreplay.core.io import Inputs
from torchreplay.core.padcheck import (
    DISTRIBUTED, Checked, StateCheck, distributed, first_difference, not_checked, rng_state, same_rng,
    with_state,
)
from torchreplay.core.padding import pad_sample
from torchreplay.core.pystate import large_tensors
from torchreplay.core.rewind import Rewind
from torchreplay.sizes.guards import probe_error
from torchreplay.sizes.outputs import OutputPlan, plan_outputs
from torchreplay.sizes.plan import InputPlan

__all__ = ["Probed", "args_at", "describe", "padding_message", "probe"]

log = logging.getLogger(__name__)

_Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class Probed:
    """What the probe learned: the output plan, and whether padding changes the real rows."""

    plan: OutputPlan
    padding: Checked


def args_at(inputs: Inputs, plan: InputPlan, big: int, s: int, rows: int | None = None) -> tuple[Any, Any]:
    """The static arguments with every varying buffer narrowed to its leading ``s`` rows; with
    ``rows``, fresh tensors instead: the buffer's leading ``rows`` rows, padded to ``s`` with
    the fill value."""
    leaves = [slot.static if slot.static is not None else slot.value for slot in inputs.slots]
    for i in plan.varying:
        d = plan.dims[i]
        if rows is not None:
            leaves[i] = pad_sample(leaves[i].narrow(d, 0, rows), d, s, plan.fills[i])
        elif s != big:
            leaves[i] = leaves[i].narrow(d, 0, s)
    return _compat.tree_unflatten(leaves, inputs.spec)


def probe(
    name: str,
    fn: Callable[..., Any],
    inputs: Inputs,
    plan: InputPlan,
    sizes: Sequence[int],
    *,
    effects: PyState,
    snapshot: Any,
    adopted: Rewind | None,
    module: torch.nn.Module | None,
    stream: Any,
    device: torch.device,
) -> Probed:
    """Call ``fn`` eagerly at the largest size and the next one down (and once more to compare a
    padded call with an unpadded one); learn how outputs slice and whether padding changes them.

    ``snapshot``: the module's :class:`~torchreplay.core.snapshot.StateSnapshot` (or None);
    ``adopted``: the record of what the calls write into adopted arguments; ``module``: the
    module called (a plain function's modules come from the snapshot)."""
    big = sizes[-1]
    # the next size down; only size 1: every call has exactly one row, nothing is sliced
    small = sizes[-2] if len(sizes) > 1 else big // 2 if big > 1 else None
    # the real rows the padding check compares: the sample's, or the next size's when the
    # sample fills the largest size (then its unpadded call is the probe at that size)
    real = None if small is None else plan.size if plan.size < big else small
    outs: dict[Any, Any] = {}
    args: dict[Any, Sequence[Any]] = {}  # the argument leaves (an output may be one)
    finding = snapshot.running() if snapshot is not None else contextlib.nullcontext()
    # the padding check's two calls: the first, then the second; which one is padded
    pair: tuple[Any, Any] | None = None
    if real is not None and not distributed():  # (not checked under torch.distributed)
        pair = (small, "padded") if plan.size >= big else (big, "unpadded") if real != small else (big, small)
    held = _State(inputs, plan, snapshot, effects, module, device)
    check = StateCheck(device)
    written_rows: dict[str, tuple[Any, Any]] = {}  # a varying argument written: its real rows, first call's
    with on_side_stream(stream, device), torch.no_grad(), finding, held.recording():
        rng = rng_state(device)

        def reset() -> None:
            from_the_start(snapshot, effects)
            if adopted is not None:
                adopted.undo()
            held.reset_arguments()

        def call(key: Any, s: int, a: Any, k: Any) -> None:
            if outs:  # each call from the caller's state
                reset()
                if pair is not None and key == pair[1]:
                    check.after_reset()
            before = held.versions()
            flat = inputs.flatten(a, k)
            leaf_versions = [_compat.version_of(x) if isinstance(x, _Tensor) else None for x in flat]
            drawing = snapshot.draws.watch(compare=False) if snapshot is not None else contextlib.nullcontext()
            try:
                with effects.build_call(), drawing:  # its writes into Python state: put back
                    outs[key] = fn(*a, **k)
            except Exception as exc:
                if snapshot is not None:
                    snapshot.restore()
                effects.undo()
                held.reset_arguments()
                raise probe_error(name, plan, s, exc) from exc
            args[key] = flat
            if pair is not None and key in pair:
                first = key == pair[0]
                (check.after_first if first else check.after_second)(held.written(before))
                for i in plan.varying:  # the real rows a call wrote into an argument
                    leaf = flat[i]
                    if isinstance(leaf, _Tensor) and _compat.version_of(leaf) != leaf_versions[i]:
                        rows = leaf.narrow(plan.dims[i], 0, real).clone()  # (the reset puts it back)
                        got = written_rows.get(inputs.slots[i].path, (None, None))
                        written_rows[inputs.slots[i].path] = (rows, got[1]) if first else (got[0], rows)

        for s in (big,) if small is None else (big, small):
            call(s, s, *args_at(inputs, plan, big, s))
        skip = None
        if real is not None:
            if distributed():
                skip = DISTRIBUTED
            elif not same_rng(rng, rng_state(device)) or snapshot is not None and snapshot.draws.explicit:
                skip = "it draws random numbers"
            elif held.why_not() is not None:
                skip = held.why_not()
            else:
                try:
                    if plan.size >= big:  # the next size's rows padded to the largest
                        call("padded", big, *args_at(inputs, plan, big, big, rows=real))
                    elif real != small:  # the sample's rows unpadded
                        call("unpadded", real, *args_at(inputs, plan, big, real))
                except Exception as exc:  # (a call only the check makes: no error of the build)
                    skip = f"its call at {real} rows raised {type(exc).__name__}"
        differences = check.compare_first() if skip is None and pair is not None else []
        reset()  # (the warm-ups start from the caller's state)
        differences += check.compare_second() if skip is None and pair is not None else []

    # what an output may alias without being new: module state (a plain function's modules,
    # found just now) and the arguments' buffers (a view of one: the caller's, see Outputs)
    modules = snapshot.called if snapshot is not None and snapshot.called else [module]
    state = [t for m in modules if m is not None for t in (*m.parameters(), *m.buffers())]
    state += [slot.static for slot in inputs.slots if slot.static is not None]
    state_ptrs = {t.untyped_storage().data_ptr() for t in state}

    def is_external(t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in state_ptrs

    out_plan = plan_outputs(outs[big], big, outs.get(small) if small else None, small, is_external,
                            args[big], args.get(small, ()) if small else (), [s.path for s in inputs.slots])
    if real is None:
        return Probed(out_plan, not_checked("no call is padded (one row at every size)"))
    if skip is not None:
        log.debug("torchreplay: '%s': padding not checked: %s", name, skip)
        return Probed(out_plan, not_checked(skip))
    assert pair is not None
    padded_first = pair[0] == big
    padded, unpadded = (outs[pair[0]], outs[pair[1]]) if padded_first else (outs[pair[1]], outs[pair[0]])
    extra = [(f"{path} (written in place)", *(w if padded_first else w[::-1]))
             for path, w in written_rows.items() if w[0] is not None and w[1] is not None]
    checked = padding_message(name, out_plan, padded, unpadded, real, big, plan, extra)
    return Probed(out_plan, with_state(checked, name, differences, check.too_large, padded_first, real, big,
                                       *describe(plan)))


def padding_message(
    name: str, out_plan: OutputPlan, padded: Any, unpadded: Any, rows: int, size: int, plan: InputPlan,
    extra: Sequence[tuple[str, _Tensor, _Tensor]] = (),
) -> Checked:
    """Whether padding changes the real rows: the report names the first output whose ``rows``
    real rows in a call padded to ``size`` differ from the same call unpadded beyond its dtype's
    tolerance. Compared: the floating-point tensors the call computes (not module state, not its
    arguments)."""
    pads, unpads = _compat.tree_flatten(padded)[0], _compat.tree_flatten(unpadded)[0]
    pairs = []
    for leaf, a, b in zip(out_plan.leaves, pads, unpads):
        if leaf.kind != "owned" or not (isinstance(a, _Tensor) and isinstance(b, _Tensor)):
            continue
        for d in leaf.dims:
            a = a.narrow(d, 0, rows)
        pairs.append((leaf.path, a, b))
    return first_difference(name, [*pairs, *extra], rows, size, *describe(plan))


def describe(plan: InputPlan) -> tuple[str, str]:
    """Where a call's rows are read, and the fill value of each varying argument, for
    :func:`first_difference`."""
    return plan.where(), ", ".join(f"{plan.paths[i]}: {plan.fills[i]!r}" for i in plan.varying)


class _State:
    """What the probe's calls may write that outlives them, and how it is put back between
    them: module buffers (the snapshot's, which puts them back), the adopted arguments (the
    caller's own tensors, their rewind's), and the buffers the graph copies arguments into:
    those of up to 1 MiB copied here before the first call, the larger ones' writes recorded
    (core/rewind.py: a KV cache passed as an argument is not copied whole). Where a write
    cannot be put back (one no dispatch mode saw, or ``restore_state=False``'s buffers), the
    next call would start from another state: the padding check is then skipped
    (:meth:`why_not`)."""

    def __init__(self, inputs: Inputs, plan: InputPlan, snapshot: Any, effects: PyState,
                 module: torch.nn.Module | None, device: torch.device) -> None:
        self._snapshot = snapshot
        self._effects = effects
        slots = [(i, s) for i, s in enumerate(inputs.slots) if s.static is not None]
        copied = [(s.path, s.static) for _, s in slots if not s.adopted]
        large = {id(t) for t in large_tensors([t for _, t in copied])}
        with torch.no_grad():
            # (tensor, its copy, its version after the last put-back)
            self._args = [(t, t.clone(), _compat.version_of(t)) for _, t in copied if id(t) not in large]
        big = [(p, t) for p, t in copied if id(t) in large]
        self._rewind = Rewind([t for _, t in big], [p for p, _ in big]) if big else None
        # (restore_state=False: the module's buffers stay written, nothing puts them back)
        self._unsaved = [(t, _compat.version_of(t)) for t in module.buffers()] if snapshot is None and module is not None else []
        # what the padding check compares besides outputs: each fixed argument (no varying
        # dimension; a varying one's written rows are compared as outputs), the module's buffers
        self._fixed = [(s.path, s.static) for i, s in slots if plan.dims[i] is None]

    def recording(self) -> contextlib.AbstractContextManager[Any]:
        """Around the probe's calls: record what they write into the large argument buffers."""
        return self._rewind if self._rewind is not None else contextlib.nullcontext()

    def why_not(self) -> str | None:
        """Why the calls cannot start from the same state (None: they can)."""
        if any(v is None for _, _, v in self._args):  # (an inference tensor: writes unseen)
            return "it may write an argument (an inference tensor: no version counter)"
        if self._rewind is not None and self._rewind.unseen:
            return f"it writes {', '.join(self._rewind.unseen)} where no dispatch mode sees (compiled code)"
        if any(_compat.version_of(t) != v for t, v in self._unsaved):
            return "it writes a buffer (restore_state=False)"
        return None

    def _held(self) -> list[tuple[str, _Tensor, int | None]]:
        """The module buffers the snapshot keeps and the tensors Python state holds (a cache
        object's), each with its version counter when it was kept."""
        kept = self._snapshot.kept() if self._snapshot is not None else []
        return kept + self._effects.held_tensors()

    def versions(self) -> dict[int, int | None]:
        """The version counters of everything watched, now."""
        found = {id(t): _compat.version_of(t) for _, t in self._fixed}
        found.update((id(t), _compat.version_of(t)) for _, t, _ in self._held())
        return found

    def written(self, before: dict[int, int | None]) -> list[tuple[str, _Tensor]]:
        """What a call wrote since ``before`` (:meth:`versions`); a module's buffer found
        during the call, by its version when the snapshot kept it (before the call ran it)."""
        watched = [(p, t, before.get(id(t), v)) for p, t, v in self._held()]
        watched += [(p, t, before.get(id(t))) for p, t in self._fixed]
        return [(p, t) for p, t, v in watched if v is not None and _compat.version_of(t) != v]

    def reset_arguments(self) -> None:
        """Put back the argument buffers a call wrote."""
        if self._rewind is not None:
            self._rewind.undo()
        with torch.no_grad():
            for k, (t, copy, v) in enumerate(self._args):
                if _compat.version_of(t) != v:
                    t.copy_(copy)
                    self._args[k] = (t, copy, _compat.version_of(t))
