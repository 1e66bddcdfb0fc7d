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

Each call starts from the caller's state (module buffers, Python state and adopted arguments put
back in between), so a callable that advances a position at every call compares like with like.
The padding check is skipped, with a debug line, when it cannot compare like with like: a call
that draws random numbers (dropout in training mode) or writes an argument the graph copies in
(or, with ``restore_state=False``, a module buffer, which nothing puts back);
and under torch.distributed, where the ranks' samples may differ in rows, so one rank would make
the extra call and another not (a collective inside would hang).
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
    DISTRIBUTED, Checked, distributed, first_difference, not_checked, rng_state, same_rng,
)
from torchreplay.core.padding import pad_sample
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
    args: dict[int, Sequence[Any]] = {}  # the argument leaves (an output may be one)
    finding = snapshot.running() if snapshot is not None else contextlib.nullcontext()
    copied = [slot.static for slot in inputs.tensor_slots if not slot.adopted]
    if snapshot is None and module is not None:  # (restore_state=False: its buffers stay written)
        copied += list(module.buffers())
    with on_side_stream(stream, device), torch.no_grad(), finding:
        rng, versions = rng_state(device), _versions(copied)

        def call(key: Any, s: int, a: Any, k: Any) -> Any:
            if outs:  # each call from the caller's state
                from_the_start(snapshot, effects)
                if adopted is not None:
                    adopted.undo()
            try:
                with effects.build_call():  # its writes into Python state: put back
                    outs[key] = fn(*a, **k)
            except Exception as exc:
                if snapshot is not None:
                    snapshot.restore()
                effects.undo()
                raise probe_error(name, plan, s, exc) from exc

        for s in (big,) if small is None else (big, small):
            a, k = args_at(inputs, plan, big, s)
            args[s] = inputs.flatten(a, k)
            call(s, s, a, k)
        skip = None
        if real is not None:
            if distributed():
                skip = DISTRIBUTED
            elif not same_rng(rng, rng_state(device)):
                skip = "it draws random numbers"
            elif versions is None or versions != _versions(copied):
                skip = "it writes an argument" + (" or a buffer (restore_state=False)" if snapshot is None else "")
            else:
                try:
                    if plan.size >= big:  # the next size's rows padded to the largest
                        call("padded", big, *args_at(inputs, plan, big, big, rows=real))
                    elif real != small:  # the sample's rows unpadded
                        call("unpadded", real, *args_at(inputs, plan, big, real))
                except Exception as exc:  # (a call only the check makes: no error of the build)
                    skip = f"its call at {real} rows raised {type(exc).__name__}"
        from_the_start(snapshot, effects)  # (the warm-ups start from the caller's state)

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
    padded = outs.get("padded", outs[big])
    unpadded = outs.get("unpadded", outs.get(small))
    return Probed(out_plan, padding_message(name, out_plan, padded, unpadded, real, big, plan))


def padding_message(
    name: str, out_plan: OutputPlan, padded: Any, unpadded: Any, rows: int, size: int, plan: InputPlan,
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
    return first_difference(name, pairs, rows, size, *describe(plan))


def describe(plan: InputPlan) -> tuple[str, str]:
    """Where a call's rows are read, and the fill value of each varying argument, for
    :func:`first_difference`."""
    return plan.where(), ", ".join(f"{plan.paths[i]}: {plan.fills[i]!r}" for i in plan.varying)


def _versions(tensors: list[_Tensor]) -> list[int] | None:
    """The version counters of the buffers the graph copies arguments into (None: one has none,
    an inference tensor, so writes to it cannot be seen)."""
    try:
        return [t._version for t in tensors]
    except RuntimeError:
        return None
