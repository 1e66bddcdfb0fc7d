"""What ``sizes=`` adds to a breakable graph: which output dimension holds the rows, and the
padding check of :mod:`torchreplay.sizes.probe`.

The sample call the plan runs (:meth:`~torchreplay.breaks.graph.BreakableGraph._plan`) is the
unpadded call; the first capture, of the sample padded to the largest size, runs the model for
real (each segment replayed before its break, the last one replayed for the check): its outputs'
real rows are the padded call's. A break gets the padded rows, so one that reads past the real
count (attention over the padded positions) changes them, and so does anything a segment
reduces across the rows. What the two runs leave in module buffers and Python state's tensors is
compared as well (:class:`~torchreplay.core.padcheck.StateCheck`): the sample call's is kept
after it, the capture's run is read at its end.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

import torch

from torchreplay import _compat
from torchreplay.core.padcheck import (
    DISTRIBUTED, Checked, StateCheck, distributed, first_difference, not_checked, with_state,
)
from torchreplay.sizes.plan import InputPlan
from torchreplay.sizes.probe import describe

__all__ = ["Unpadded", "output_dims", "padding_sample", "check_padding"]

log = logging.getLogger(__name__)

_Tensor = torch.Tensor

_HINT = (
    "; a break gets the padded rows: pass it the real count (an int, or lengths on the CPU) "
    "and have it read only those"
)


@dataclasses.dataclass(frozen=True)
class Unpadded:
    """The sample call's output leaves (``(path, tensor or None)``) and the input plan."""

    plan: InputPlan
    outputs: list[tuple[str, _Tensor | None]]
    state: StateCheck | None = None  # what the sample call left in state, against the capture's


def padding_sample(
    name: str, out: Any, plan: InputPlan | None, sizes: Sequence[int] | None, drew: bool,
    state: StateCheck | None = None,
) -> Unpadded | Checked | None:
    """The sample call's outputs, kept until the first capture; None without sizes; the
    outcome ("not checked") when no capture pads the sample, when it draws random numbers (a
    padded run cannot match it), and under torch.distributed (the ranks' samples may differ:
    the last segment's replay for the check, made on one rank and not another, would hang a
    collective inside it)."""
    if plan is None or sizes is None:
        return None
    if drew or plan.size >= max(sizes) or distributed():
        why = ("it draws random numbers" if drew else DISTRIBUTED if distributed()
               else "the sample fills the largest size")
        log.debug("torchreplay: '%s': padding not checked: %s", name, why)
        return not_checked(why)
    return Unpadded(plan, [("output" + _compat.keystr(p), v if isinstance(v, _Tensor) else None)
                           for p, v in _compat.tree_flatten_with_path(out)[0]], state)


def check_padding(name: str, unpadded: Unpadded, outs: Sequence[Any], size: int, state_ptrs: set[int]) -> str:
    """The check's summary (``stats.padding_check``); log a warning when the sample's real rows of the padded capture's outputs ``outs`` (at
    ``size``) differ from the sample call's beyond rounding. Outputs in ``state_ptrs`` (module
    state, an argument) are not what the call computed: not compared."""
    rows, pairs = unpadded.plan.size, []
    for (path, b), a in zip(unpadded.outputs, outs):
        if b is None or not isinstance(a, _Tensor) or a.untyped_storage().data_ptr() in state_ptrs:
            continue
        for d in range(min(a.dim(), b.dim())):
            # (the size, or a fixed length below it: the leading rows buf[:n] of a buffer)
            if a.shape[d] > b.shape[d] == rows:
                a = a.narrow(d, 0, rows)
        pairs.append((path, a, b))
    checked = first_difference(name, pairs, rows, size, *describe(unpadded.plan), hint=_HINT)
    if unpadded.state is not None:  # (the state the sample call left, against the capture's run)
        differences = unpadded.state.compare_first()
        checked = with_state(checked, name, differences, unpadded.state.too_large, False, rows, size,
                             *describe(unpadded.plan))
    if checked.report is not None:
        log.warning("torchreplay: %s", checked.report)
    return checked.summary


def output_dims(seen: Sequence[tuple[int, Sequence[Any]]], n_out: int) -> tuple[int | None, ...]:
    """Which dimension of each output has the call's rows (sliced back to them): the first
    dimension equal to the size in every ``(size, output shapes)`` seen, the sample call's and
    each captured size's, or to the size clamped by a fixed length (the leading rows
    ``buf[:n]`` of an 8-row buffer: 3 at size 3, 8 at size 16; one size below the cap shows
    it follows the size); None for an output without one (or not a tensor)."""
    dims: list[int | None] = []
    for j in range(n_out):
        shapes = [(n, s[j]) for n, s in seen]
        if any(s is None for _, s in shapes):
            dims.append(None)
            continue
        rank = len(shapes[0][1])
        found = [d for d in range(rank) if all(len(s) == rank for _, s in shapes) and _rows_at(shapes, d)]
        dims.append(found[0] if found else None)
    return tuple(dims)


def _rows_at(shapes: Sequence[tuple[int, Sequence[int]]], d: int) -> bool:
    """Dimension ``d`` is the size in every shape seen, or the size clamped by the largest
    length seen, with some size below that length (else it may be a fixed length)."""
    if all(s[d] == n for n, s in shapes):
        return True
    cap = max(s[d] for _, s in shapes)
    return all(s[d] == min(n, cap) for n, s in shapes) and any(s[d] == n < cap for n, s in shapes)
