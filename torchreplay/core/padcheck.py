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
    "Checked", "DISTRIBUTED", "StateCheck", "StateDifference", "copy_budget", "distributed",
    "fingerprint", "first_difference", "not_checked", "padding_difference", "rng_state", "same_rng",
    "with_state",
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
        if a.shape != b.shape:  # (its real rows, cut as every replay cuts them)
            return Checked(
                f"'{name}' with sizes=: padding changes what the call returns, its shape. "
                f"{path} of a call of {rows} rows ({where}) padded to {size} has shape "
                f"{tuple(a.shape)} where the same call unpadded returns {tuple(b.shape)}: no "
                "dimension of it follows the call's rows as the padded graph sees them. Fix: "
                f"list every size you call with in sizes= (an exact size is not padded){hint}",
                f"CHANGES the shape: {path} of {rows} rows padded to {size} is {tuple(a.shape)}, "
                f"unpadded {tuple(b.shape)}",
            )
        if not a.is_floating_point() or a is b or a.dtype != b.dtype:
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


def copy_budget(device: torch.device) -> int:
    """The bytes the state comparison may copy: a quarter of what the device has free (1 GiB
    off CUDA)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] // 4
    return 1 << 30


class StateCheck:
    """What the padding check's two calls leave in the state the caller keeps (module buffers,
    tensors Python state holds, arguments the graph copies in whole): written the same, up to
    rounding, or not.

    Eagerly a call of 3 rows writes what those rows write; padded to 8 it also runs 5 padding
    rows, and where they write is the model's: a KV cache's rows past the batch, a scratch slot,
    or the same slot as a real row (a position padded with 0 writes slot 0, over the real
    token's). Each tensor the first call wrote is kept after it (its result) and after the
    reset (the caller's value); after the second call, they are compared:

    - written by both calls: the values, normwise with the outputs' tolerance (exactly for
      integers): a difference means padding changes the real rows' state (a counter advanced
      by the padded size, a real slot overwritten by a padding row): reported as outputs are;
    - written by the unpadded call only: padding loses a write eager makes: reported;
    - written by the padded call only: the padding rows' own state; that is a note, not a
      warning: whether anything reads it before writing it again is the model's design.

    A tensor of up to 1 MiB is copied and compared element by element (copies of at most
    :func:`copy_budget` bytes in all). A larger one (a KV cache, sized to fill the device) is not
    copied: :func:`fingerprint` keeps three numbers per row of its last dimension (a slot's
    vector), and rows are compared by them, the values by their random projections, whose
    squared difference is on average the squared 2-norm of the rows' difference.
    """

    def __init__(self, device: torch.device) -> None:
        self._budget = copy_budget(device)
        # the first call's tensors: path, tensor, its result, the caller's value (copies or
        # fingerprints)
        self._first: list[tuple[str, _Tensor, _Tensor, _Tensor | None]] = []
        self._seen: set[int] = set()  # the first call's tensors, by id
        self._second: list[tuple[str, _Tensor, _Tensor]] = []  # written by the second only: path, t, B
        self.too_large: list[str] = []

    def _keep(self, path: str, t: _Tensor, copies: int) -> _Tensor | None:
        """A copy of ``t`` (small), its fingerprint (large), or None (named in ``too_large``)."""
        width = _row_width(t)
        if t.untyped_storage().nbytes() > _SMALL_BYTES:
            need = t.numel() // width * (_PROJECTIONS + 1) * 4 * copies if width else 0
            kept = fingerprint(t) if width and need <= self._budget else None
            self._budget -= need if kept is not None else 0
        elif t.nbytes * copies <= self._budget:
            self._budget -= t.nbytes * copies
            kept = t.detach().clone()
        else:
            kept = None
        if kept is None and path not in self.too_large:
            self.too_large.append(path)
        return kept

    def after_first(self, written: Sequence[tuple[str, _Tensor]]) -> None:
        """Right after the first call: keep what it wrote (its result)."""
        for path, t in written:
            if id(t) not in self._seen and (kept := self._keep(path, t, 2)) is not None:
                self._seen.add(id(t))
                self._first.append((path, t, kept, None))

    def after_reset(self) -> None:
        """After the caller's state is put back: keep the values the first call overwrote."""
        self._first = [(p, t, a, _again(t, a) if s is None else s) for p, t, a, s in self._first]

    def after_second(self, written: Sequence[tuple[str, _Tensor]]) -> None:
        """Right after the second call: keep what it alone wrote (compared after the reset)."""
        for path, t in written:
            if id(t) not in self._seen and (kept := self._keep(path, t, 1)) is not None:
                self._seen.add(id(t))
                self._second.append((path, t, kept))

    def compare_first(self) -> list[StateDifference]:
        """Before the last reset: each tensor the first call wrote, as the second left it."""
        found = [_compare(p, t, a, s, _again(t, a)) for p, t, a, s in self._first if s is not None]
        self._first = []
        return [d for d in found if d is not None]

    def compare_second(self) -> list[StateDifference]:
        """After the last reset: each tensor only the second call wrote, against the caller's."""
        found = [_compare(p, t, _again(t, b), _again(t, b), b) for p, t, b in self._second]
        self._second = []
        return [d for d in found if d is not None]


_SMALL_BYTES = 1 << 20  # state compared element by element (copied); larger: by fingerprint
_ROW_MAX = 4096  # the longest row a fingerprint sums
_ROW_MIN = 1024  # rows of the last dimension shorter than this are taken together
_PROJECTIONS = 2  # random projections per row: the mean of their squared differences estimates
# the squared 2-norm of the rows' difference
_FINGER = "fingerprint"  # (a name the kept tensors of large state are told apart by)


#: the projections of a fingerprint, by row width and device (a few KiB each)
_weights: dict[tuple[int, torch.device], _Tensor] = {}


def _again(t: _Tensor, like: _Tensor) -> _Tensor:
    """``t`` now, kept as ``like`` was: a copy, or a fingerprint."""
    return fingerprint(t) if getattr(like, _FINGER, False) else t.detach().clone()  # type: ignore[return-value]


def _row_width(t: _Tensor) -> int:
    """The elements of a row of :func:`fingerprint`: the last dimension, cut to 4096 elements
    or taken with the rows after it up to at least 1024 (a KV cache's 16-element head vectors
    would otherwise cost a fingerprint of 19% of the cache); 0: none (not contiguous,
    complex, empty)."""
    if not t.is_contiguous() or t.is_complex() or t.numel() == 0:
        return 0
    width, n = (t.shape[-1] if t.dim() else 1), t.numel()
    if width > _ROW_MAX:
        return _ROW_MAX if n % _ROW_MAX == 0 else 0
    while width < _ROW_MIN and n % (2 * width) == 0:
        width *= 2
    return width


def fingerprint(t: _Tensor) -> _Tensor | None:
    """Three float32 numbers per row of ``t`` (:func:`_row_width`: 1024 to 4096 elements where
    the shape allows): two random projections and the sum of squares, 12 bytes a row. A row nothing
    wrote keeps its fingerprint bit for bit (the same kernels over the same values, on one
    stream); a row written with other values changes it (a change within float32 rounding of
    the row's sums, a millionth of its norm, may not: far below the check's tolerances). Computed a million elements at a time:
    no copy of ``t``. None where ``t`` cannot be cut into such rows without a copy (not
    contiguous) or is complex."""
    width = _row_width(t)
    if width == 0:
        return None
    rows = t.detach().reshape(-1, width)  # (a view: contiguous)
    weights = _weights.get((width, t.device))
    if weights is None:  # (drawn once per width and device: no host draw and copy a tensor)
        weights = torch.randn(width, _PROJECTIONS, generator=torch.Generator().manual_seed(width)).to(t.device)
        _weights[(width, t.device)] = weights
    out = torch.empty(rows.shape[0], _PROJECTIONS + 1, device=t.device)
    step = max(1, _CHUNK // 4 // width)  # (a million elements: 8 MiB of temporaries)
    floating = t.is_floating_point()  # (a float16 row is read as float32 by the ops themselves)
    for i in range(0, rows.shape[0], step):
        chunk = rows[i:i + step] if floating else rows[i:i + step].float()
        # Four launches a chunk, into ``out`` itself: a KV cache of a 32-size build takes 96
        # fingerprints of eight chunks. (No GEMM: no cuBLAS workspace for the side stream, 32
        # MiB on an H100.)
        torch.sum(chunk[:, :, None] * weights, dim=1, out=out[i:i + step, :_PROJECTIONS])
        norms = out[i:i + step, _PROJECTIONS]
        torch.linalg.vector_norm(chunk, dim=1, dtype=torch.float32, out=norms)
        norms.square_()
    setattr(out, _FINGER, True)
    return out


@dataclasses.dataclass(frozen=True)
class StateDifference:
    """How a tensor of state differs after the padded and the unpadded call (``first``: the
    first call of the pair; ``second``: the other)."""

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    first_only: int  # elements only the first call wrote
    second_only: int
    first_at: tuple[int, ...] | None  # where the first such element is
    both: int  # elements both wrote
    differ: float  # their normwise difference (integers: the share that differs)
    tolerance: float
    unit: int = 1  # elements per count: 1, or a row of the last dimension (large state)

    def summary(self, first: str, second: str) -> str:
        parts = []
        what = "elements" if self.unit == 1 else f"rows of {self.unit}"
        if self.differ > self.tolerance and self.tolerance == 0.0:  # (integers: the share that differs)
            parts.append(f"{round(self.differ * self.both)} of the {self.both} {what} both write differ")
        elif self.differ > self.tolerance:
            parts.append(f"{self.differ:.3g} apart (normwise) where both write (tolerance {self.tolerance:g})")
        for count, who in ((self.first_only, first), (self.second_only, second)):
            if count:
                unit = ("element" if count == 1 else "elements") if self.unit == 1 else (
                    f"row{'s' * (count != 1)} of {self.unit}")
                parts.append(f"{count} {unit} only the {who} call writes")
        at = f", first at {list(self.first_at)}" if self.first_at is not None else ""
        return f"{self.path}: {'; '.join(parts)}{at}"


def with_state(
    checked: Checked, name: str, differences: Sequence[StateDifference], too_large: Sequence[str],
    padded_first: bool, rows: int, size: int, where: str, fills: str,
) -> Checked:
    """``checked`` (the outputs' outcome) with what the two calls left in state: a warning where
    the real rows' state differs (values both wrote, or a write only the unpadded call made), a
    note where only the padding rows wrote; the tensors too large to compare, named."""
    first, second = ("padded", "unpadded") if padded_first else ("unpadded", "padded")
    wrong = [d for d in differences if d.differ > d.tolerance or (d.second_only if padded_first else d.first_only)]
    extra = [d for d in differences if d not in wrong]
    report, summary = checked.report, checked.summary
    if wrong:
        what = "; ".join(d.summary(first, second) for d in wrong)
        report = (report + "\n" if report else "") + (
            f"'{name}' with sizes=: padding changes the state a call leaves. A call of {rows} rows "
            f"({where}) padded to {size} with the fill value and the same call unpadded, each from "
            f"the same state, leave {what}. Eagerly the call writes what its {rows} rows write; "
            "the padding rows also wrote where the real rows do (a position padded with 0 "
            "writes slot 0, over the real token's), or a count followed the padded size. Fix: "
            f"make the padding rows write nowhere the real rows do (their value is the fill value: "
            f"{fills}; fill_value= sets it), or list every size you call with in sizes= (an exact "
            "size is not padded)"
        )
        summary = f"{summary}; CHANGES state: {what}" if checked.report else f"CHANGES state: {what}"
    if extra:
        named = [f"{d.path} ({d.first_only + d.second_only} "
                 f"{'elements' if d.unit == 1 else f'rows of {d.unit}'})" for d in extra]
        more = f"; and {len(named) - 2} more" if len(named) > 3 else ""
        summary += "; the padding rows also write " + "; ".join(named[:2] if more else named) + more
    if too_large:
        summary += f"; state not compared (over the copy budget, or large and not contiguous): {', '.join(too_large)}"
    return Checked(report, summary)


def _compare(path: str, t: _Tensor, a: _Tensor, s: _Tensor, b: _Tensor) -> StateDifference | None:
    """How ``a`` and ``b``, the two calls' results of ``t`` from the caller's ``s``, differ:
    element by element (copies), or row by row (fingerprints)."""
    if getattr(a, _FINGER, False):
        return _by_rows(path, t, a, s, b)
    return _state_difference(path, a, s, b)


def _by_rows(path: str, t: _Tensor, a: _Tensor, s: _Tensor, b: _Tensor) -> StateDifference | None:
    """:func:`_compare` over fingerprints: counts in rows of ``t``'s last dimension."""
    ca, cb = _changed(a, s).any(1), _changed(b, s).any(1)
    oa, ob, both = ca & ~cb, cb & ~ca, ca & cb
    only_a, only_b, n = int(oa.sum()), int(ob.sum()), int(both.sum())
    first = int((oa | ob).nonzero()[0, 0]) if only_a or only_b else None
    num = float(torch.sum(torch.square(a[both, :_PROJECTIONS].double() - b[both, :_PROJECTIONS].double()))) / _PROJECTIONS
    den = float(torch.sum(b[both, _PROJECTIONS].double()))
    integer = not (t.is_floating_point() or t.is_complex())
    if integer:  # (exactly: a row that differs)
        differ, tolerance = (float(torch.sum(_changed(a[both], b[both]).any(1))) / n if n else 0.0), 0.0
    else:
        differ, tolerance = _normwise(num, den), _TOLERANCE.get(t.dtype, _DEFAULT_TOLERANCE)
    if not (only_a or only_b or differ > tolerance):
        return None
    width = t.numel() // a.shape[0]
    at = _unravel(first * width, tuple(t.shape)) if first is not None else None
    return StateDifference(path, tuple(t.shape), t.dtype, only_a, only_b, at, n, differ, tolerance, width)


def _state_difference(path: str, a: _Tensor, s: _Tensor, b: _Tensor) -> StateDifference | None:
    """Compare ``a`` and ``b``, each a call's result from the caller's ``s``, element by element
    (in chunks): which elements only one call changed, and how far apart both changed ones are."""
    x_all, s_all, y_all = a.reshape(-1), s.reshape(-1), b.reshape(-1)
    floating = a.is_floating_point() or a.is_complex()
    only_a = only_b = both = 0
    first: int | None = None
    num = den = 0.0
    for i in range(0, x_all.numel(), _CHUNK):
        x, s_, y = x_all[i:i + _CHUNK], s_all[i:i + _CHUNK], y_all[i:i + _CHUNK]
        ca, cb = _changed(x, s_), _changed(y, s_)
        oa, ob, bb = ca & ~cb, cb & ~ca, ca & cb
        only_a += int(oa.sum())
        only_b += int(ob.sum())
        if first is None and bool((oa | ob).any()):
            first = i + int((oa | ob).nonzero()[0, 0])
        n = int(bb.sum())
        if not n:
            continue
        both += n
        if floating:
            xb, yb = x[bb].double(), y[bb].double()
            num += float(torch.sum(torch.square(torch.abs(xb - yb))))
            den += float(torch.sum(torch.square(torch.abs(yb))))
        else:
            num += float(torch.sum(x[bb] != y[bb]))
    if floating:
        differ, tolerance = _normwise(num, den), _TOLERANCE.get(a.dtype, _DEFAULT_TOLERANCE)
    else:
        differ, tolerance = (num / both if both else 0.0), 0.0
    if not (only_a or only_b or differ > tolerance):
        return None
    return StateDifference(path, tuple(a.shape), a.dtype, only_a, only_b,
                           _unravel(first, tuple(a.shape)) if first is not None else None, both, differ, tolerance)


def _normwise(num: float, den: float) -> float:
    """``sqrt(num / den)``: 0 where nothing differs, inf where the reference is all zeros or a
    sum overflowed."""
    return 0.0 if num == 0.0 else math.inf if den == 0.0 or not math.isfinite(num) else math.sqrt(num / den)


def _changed(x: _Tensor, s: _Tensor) -> _Tensor:
    """Where ``x`` differs from ``s`` (NaN where both are NaN: unchanged)."""
    ne = x != s
    if x.is_floating_point():
        ne &= ~(torch.isnan(x) & torch.isnan(s))
    return ne


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    at = []
    for n in reversed(shape):
        at.append(flat % n if n else 0)
        flat = flat // n if n else 0
    return tuple(reversed(at))
