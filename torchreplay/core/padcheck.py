"""Whether padding changed a call's real rows: the comparison every many-size front end makes
(``tr.graph(sizes=)``'s probe, a breakable graph's first capture, the compile backend's first
call) between a call padded to a captured size and the same rows unpadded.

A callable whose rows are independent returns the same real rows both ways, up to the rounding of
kernels picked per shape; a reduction or a normalisation across the rows (``x - x.mean(0)``,
attention over padded positions left unmasked) does not. :func:`first_difference` words the
report: the output, the rows, the difference, the fix.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Sequence

import torch

from torchreplay import _compat

__all__ = [
    "Checked", "DISTRIBUTED", "distributed", "first_difference", "not_checked", "padding_difference",
    "rng_state", "same_rng",
]

log = logging.getLogger(__name__)

_Tensor = torch.Tensor

# How far (normwise, relative) the real rows of a padded call may be from the same rows unpadded.
# Sizes run different kernels (cuBLAS picks its algorithm by shape, cuDNN by batch, TF32
# convolutions in fp32), so rows agree only up to rounding: measured on an H200 (RESULTS.md,
# session 44), at most about half an epsilon of the type that computes (ResNet-50: 1.6e-4 in fp32
# with TF32 convolutions, 4.2e-4 in fp16, 3.6e-3 in bf16; Llama, BERT and GPT-2 far less). Four
# epsilons of it: a mean over 5 rows taken over 8 is off by 0.5, BERT attending 44 padded
# positions by 0.04.
_TOLERANCE = {torch.float64: 1e-3, torch.float32: 1e-3, torch.float16: 4e-3, torch.bfloat16: 3e-2}
_DEFAULT_TOLERANCE = 1e-1  # the 8-bit float types
_CHUNK = 1 << 22  # elements compared at a time (a large output is not copied whole to float32)

#: why the check is skipped under torch.distributed: the ranks' calls may differ (their rows), and
#: a run that one rank makes and another does not would hang a collective inside it
DISTRIBUTED = "torch.distributed is set up"


def distributed() -> bool:
    """Whether a default process group exists: the check is skipped (:data:`DISTRIBUTED`)."""
    return _compat.dist_ready()


@dataclasses.dataclass(frozen=True)
class Checked:
    """The check's outcome: ``report``, the warning when padding changes the result (None when
    it does not); ``summary``, one line for ``stats.padding_check`` and ``tr.explain``."""

    report: str | None
    summary: str


def not_checked(why: str) -> Checked:
    """The outcome of a check that was skipped, and why."""
    return Checked(None, f"not checked: {why}")


def first_difference(
    name: str, pairs: Sequence[tuple[str, _Tensor, _Tensor]], rows: int, size: int, where: str,
    fills: str, hint: str = "",
) -> Checked:
    """Compare each ``(path, padded real rows, unpadded)`` pair of floating-point tensors; the
    report names the first that differs beyond its dtype's tolerance. ``where``: where a call's
    rows are read; ``fills``: each varying argument's fill value; ``hint``: the end of the fix."""
    worst = None  # (difference / tolerance, path, difference, tolerance) of the largest
    for path, a, b in pairs:
        if not a.is_floating_point() or a is b or a.shape != b.shape or a.dtype != b.dtype:
            continue
        tolerance = _TOLERANCE.get(a.dtype, _DEFAULT_TOLERANCE)
        difference = padding_difference(a, b)
        log.debug("torchreplay: '%s': padding check: %s of %d rows padded to %d: relative "
                  "difference %.3g (tolerance %g)", name, path, rows, size, difference, tolerance)
        if worst is None or difference / tolerance > worst[0]:
            worst = (difference / tolerance, path, difference, tolerance)
        if difference <= tolerance:
            continue
        by = "non-finite values where the unpadded call has none" if math.isinf(difference) else (
            f"a relative difference of {difference:.3g} (normwise; the tolerance of "
            f"{str(a.dtype).removeprefix('torch.')} is {tolerance:g})"
        )
        return Checked(
            f"'{name}' with sizes=: padding changes what the call returns. {path} of a "
            f"call of {rows} rows ({where}) padded to {size} with the fill value differs "
            f"from the same call unpadded by {by}. Padding is correct only when each row's result "
            "depends on that row alone: no reduction or normalisation across the rows, no "
            "attention over padded positions left unmasked. Calls of a size not in sizes= are "
            f"padded and may differ from eager this way. Fix: mask the padding rows (their value is the "
            f"fill value: {fills}; fill_value= sets it), or list every size you call with in "
            f"sizes= (an exact size is not padded){hint}",
            f"CHANGES the result: {path} of {rows} rows padded to {size} differs by "
            f"{difference:.3g} (tolerance {tolerance:g})",
        )
    if worst is None:
        return not_checked("no floating-point output the call computes")
    _, path, difference, tolerance = worst
    return Checked(None, f"rows independent: {rows} rows padded to {size}, largest difference "
                         f"{difference:.3g} ({path}; tolerance {tolerance:g})")


def padding_difference(padded: _Tensor, unpadded: _Tensor) -> float:
    """``|padded - unpadded| / |unpadded|`` (2-norms, in float32 chunks); ``inf`` where one has
    a non-finite value the other has not. Where ``unpadded`` is all zeros, the root mean square
    of ``padded`` instead (rounding of another kernel may leave a tiny value there; a real
    difference does not stay that small)."""
    a, b = padded.reshape(-1), unpadded.reshape(-1)
    num = den = 0.0
    count = 0
    for i in range(0, b.numel(), _CHUNK):
        x, y = a[i:i + _CHUNK].float(), b[i:i + _CHUNK].float()
        finite = torch.isfinite(y)
        if not bool(finite.all()):
            same = (
                torch.equal(torch.isfinite(x), finite)
                and torch.equal(torch.isnan(x), torch.isnan(y))
                and torch.equal(x[torch.isinf(y)], y[torch.isinf(y)])
            )
            if not same:
                return math.inf
            x, y = x[finite], y[finite]
        elif not bool(torch.isfinite(x).all()):
            return math.inf
        num += float(torch.sum(torch.square(x - y), dtype=torch.float64))
        den += float(torch.sum(torch.square(y), dtype=torch.float64))
        count += y.numel()
    if num == 0.0:
        return 0.0
    return math.sqrt(num / count) if den == 0.0 else math.sqrt(num / den)


def rng_state(device: torch.device) -> list[_Tensor]:
    """The generators a call may draw from: the CPU's and the device's."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def same_rng(a: list[_Tensor], b: list[_Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))
