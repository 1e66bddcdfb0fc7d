"""What a many-size graph refuses: callables whose rows mix (batch statistics), and call
arguments that fit no captured size, each with an error that names the argument and the fix."""

from __future__ import annotations

import traceback
from typing import Any, Sequence

import torch

from torchreplay.core.failures import user_frame
from torchreplay.core.generators import fits as generator_fits
from torchreplay.core.io import Inputs, conversion_fix, describe_tensor, same_constant
from torchreplay.errors import CaptureError, ReplayInputError, UnsupportedError
from torchreplay.sizes.plan import InputPlan, disagreement_message

__all__ = ["refuse_row_mixing", "probe_error", "input_error", "fits", "check_call", "pattern"]

_Tensor = torch.Tensor

# Norm layers whose training-mode statistics mix the rows of a batch: padding rows would change
# the real rows' results (and the running statistics). Public classes only (the common base,
# ``_BatchNorm``, is private).
_ROW_MIXING = (
    torch.nn.BatchNorm1d,
    torch.nn.BatchNorm2d,
    torch.nn.BatchNorm3d,
    torch.nn.LazyBatchNorm1d,
    torch.nn.LazyBatchNorm2d,
    torch.nn.LazyBatchNorm3d,
    torch.nn.SyncBatchNorm,
)
_INSTANCE_NORMS = (
    torch.nn.InstanceNorm1d,
    torch.nn.InstanceNorm2d,
    torch.nn.InstanceNorm3d,
    torch.nn.LazyInstanceNorm1d,
    torch.nn.LazyInstanceNorm2d,
    torch.nn.LazyInstanceNorm3d,
)



def refuse_row_mixing(module: torch.nn.Module | None, name: str) -> None:
    """Raise :class:`~torchreplay.UnsupportedError` if a submodule of ``module`` in training mode
    computes batch statistics, which padding rows would change."""
    if module is None:
        return
    for sub_name, sub in module.named_modules():
        if not sub.training:
            continue
        mixes = isinstance(sub, _ROW_MIXING) or (
            isinstance(sub, _INSTANCE_NORMS) and sub.track_running_stats
        )
        if mixes:
            label = f"'{sub_name}' " if sub_name else ""
            raise UnsupportedError(
                f"'{name}' has {type(sub).__name__} {label}in training mode: its batch "
                "statistics mix the rows of a call, so the padding rows that sizes= adds would "
                "change the results; call .eval() before graphing with sizes=, or graph each "
                "batch size exactly (without sizes=)"
            )


def probe_error(name: str, plan: InputPlan, s: int, exc: Exception) -> CaptureError:
    """The error for an eager call at size ``s`` (learning how outputs slice) that raised."""
    where = user_frame(exc.__traceback__)
    at = f" at {where[0]}:{where[1]} ({where[2]})" if where else ""
    traceback.clear_frames(exc.__traceback__)
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return CaptureError(
        f"eager call of '{name}' at size {s} ({plan.where()}) raised {type(exc).__name__}: "
        f"{first}{at}; with sizes= the callable must accept every size in sizes (padding rows "
        "hold the fill value): fix the call, or change sizes or fill_value"
    )


def input_error(
    plan: InputPlan, inputs: Inputs, largest: int, leaves: Sequence[Any], n: int | None
) -> ReplayInputError:
    """Build the error that names the first argument that does not fit a call of size ``n``
    (``n`` None: the leading varying argument has no size)."""
    slots = inputs.slots
    lead_i, lead_dim = plan.lead, plan.dims[plan.lead]
    lead = leaves[lead_i]
    if n is None:
        if isinstance(lead, _Tensor):
            return ReplayInputError(
                f"{plan.paths[lead_i]}: {describe_tensor(lead)} has no dim "
                f"{lead_dim}, the dimension that varies; pass a tensor shaped like "
                f"{pattern(slots[lead_i].static, lead_dim, largest)}"
            )
        return ReplayInputError(
            f"{plan.paths[lead_i]}: expected a tensor, got {type(lead).__name__}; it is "
            "the argument whose size picks the graph"
        )
    for i, (leaf, slot) in enumerate(zip(leaves, slots)):
        if slot.static is None:
            if not accepted(leaf, slot):
                return inputs.constant_error(slot, leaf)
            continue
        if fits(leaf, slot, plan, i, n):
            continue
        d = plan.dims[i]
        if d is None:
            if isinstance(leaf, _Tensor) and leaf.shape != slot.shape:
                return ReplayInputError(
                    f"{plan.paths[i]}: {describe_tensor(leaf)}, but it is static (its dim is "
                    f"None) and was captured with shape {tuple(slot.shape)}; pass that shape, "
                    "or give its varying dimension in dim={...}"
                )
            return inputs.tensor_error(slot, leaf)
        if not isinstance(leaf, _Tensor):
            return ReplayInputError(
                f"{plan.paths[i]}: expected a tensor shaped like "
                f"{pattern(slot.static, d, largest)}, got {type(leaf).__name__}"
            )
        shaped = pattern(slot.static, d, largest)
        if leaf.dim() != slot.static.dim() or any(
            a != b for j, (a, b) in enumerate(zip(leaf.shape, slot.static.shape)) if j != d
        ):
            return ReplayInputError(
                f"{plan.paths[i]}: {describe_tensor(leaf)}, but the graph was captured for "
                f"shape {shaped}, where only dim {d} varies; pass a tensor of that shape "
                "(a graph never broadcasts or converts its inputs)"
            )
        if leaf.shape[d] != n:
            return ReplayInputError(
                disagreement_message(
                    plan.paths[lead_i], lead_dim, n, plan.paths[i], d, leaf.shape[d]
                )
            )
        fix = conversion_fix(leaf, slot)
        return ReplayInputError(
            f"{plan.paths[i]}: {describe_tensor(leaf)}, but the graph was captured with "
            f"{describe_tensor(slot.static)} (dim {d} varies); {fix} (a graph never "
            "broadcasts or converts its inputs)"
        )
    return ReplayInputError(f"the arguments do not fit a call of size {n}")  # pragma: no cover


def accepted(leaf: Any, slot: Any) -> bool:
    """Does the call's non-tensor ``leaf`` fit ``slot``: its captured constant, or, for a
    generator argument, any generator on the graph's device (core/generators.py)?"""
    if slot.rebound:
        return generator_fits(slot.value, leaf)
    return leaf is slot.value or same_constant(leaf, slot.value)


def fits(leaf: Any, slot: Any, plan: InputPlan, i: int, n: int) -> bool:
    """Is ``leaf`` a dense tensor that fits argument ``i`` of a call of size ``n``?"""
    if not isinstance(leaf, _Tensor):
        return False
    d = plan.dims[i]
    shape = slot.shape if d is None else plan.shape_at(slot.shape, i, n)
    return (
        leaf.shape == shape
        and leaf.dtype == slot.dtype
        and leaf.device == slot.device
        and leaf.layout is torch.strided
    )


def pattern(t: torch.Tensor, d: int | None, largest: int) -> str:
    """``'(N, 4096) float32 (N <= 16)'``: a varying buffer's shape with its varying dim named."""
    dims = [str(x) for x in t.shape]
    if d is not None:
        dims[d] = "N"
    inner = ", ".join(dims) + ("," if len(dims) == 1 else "")
    return f"({inner}) {str(t.dtype).removeprefix('torch.')} with N <= {largest}"


def check_call(plan: InputPlan, inputs: Inputs, largest: int, leaves: Sequence[Any], n: int) -> None:
    """Raise the input error of a call of ``n`` rows whose arguments do not fit any size."""
    for i, (leaf, slot) in enumerate(zip(leaves, inputs.slots)):
        if slot.static is None:
            if not accepted(leaf, slot):
                raise inputs.constant_error(slot, leaf)
        elif not fits(leaf, slot, plan, i, n):
            raise input_error(plan, inputs, largest, list(leaves), n)
