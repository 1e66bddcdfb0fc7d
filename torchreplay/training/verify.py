"""``verify=K``: compare a graphed call with the same call run eagerly, and say what differs.

A graph replays what was captured; anything the callable read as a Python value at capture (a
global, a non-tensor attribute, a parameter object that has since been replaced) is frozen into
it. The first ``K`` calls of a graphed callable built with ``verify=K`` also run the callable
eagerly from the same state and compare the two results tensor by tensor; the first difference
beyond tolerance raises :class:`~torchreplay.VerifyError` naming the tensor, the largest error and
the call number.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Iterator

import torch

from torchreplay import _compat
from torchreplay.errors import VerifyError
from torchreplay.training.state import StateKeeper

__all__ = [
    "Tolerance",
    "resolve_tolerance",
    "tolerance_for",
    "check_close",
    "check_tree",
    "check_verify",
    "detached",
    "buffers_swapped",
    "named_buffers",
]

_Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How far a graphed value may be from the eager one: ``|graph - eager| <= atol + rtol*|eager|``.

    Args:
        rtol: relative tolerance (>= 0).
        atol: absolute tolerance (>= 0).
    """

    rtol: float
    atol: float

    def __post_init__(self) -> None:
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"verify tolerance {name} must be a number >= 0, got {value!r}")


# Graph and eager run the same kernels, so most results agree bitwise; these leave room for
# kernels whose reduction order is not fixed (atomics) and for rounding of low-precision types.
_DEFAULTS: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(1e-7, 1e-7),
    torch.float32: Tolerance(1e-4, 1e-5),
    torch.float16: Tolerance(1e-3, 1e-4),
    torch.bfloat16: Tolerance(1.6e-2, 1e-3),
}
_EXACT = Tolerance(0.0, 0.0)


def resolve_tolerance(verify_tol: Any) -> Tolerance | None:
    """Accept ``None`` (per-dtype defaults), an ``(rtol, atol)`` pair or a :class:`Tolerance`."""
    if verify_tol is None or isinstance(verify_tol, Tolerance):
        return verify_tol
    if isinstance(verify_tol, (tuple, list)) and len(verify_tol) == 2:
        return Tolerance(*verify_tol)
    raise ValueError(
        f"verify_tol must be None, (rtol, atol) or a torchreplay.training.verify.Tolerance, got {verify_tol!r}"
    )


def tolerance_for(dtype: torch.dtype, override: Tolerance | None = None) -> Tolerance:
    """Return ``override``, else the default tolerance for ``dtype`` (exact for integers)."""
    if override is not None:
        return override
    if dtype in _DEFAULTS:
        return _DEFAULTS[dtype]
    return _DEFAULTS[torch.float32] if dtype.is_floating_point or dtype.is_complex else _EXACT


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def check_close(
    what: str,
    got: Any,
    want: Any,
    *,
    call: int,
    name: str,
    tol: Tolerance | None = None,
) -> None:
    """Raise :class:`VerifyError` unless the graphed value ``got`` matches the eager ``want``.

    Args:
        what: the value's name in the message (``"output[0]"``, ``"parameter 'fc.weight'"``).
        got, want: graphed and eager values: tensors, ``None`` or other Python values.
        call: the 1-based number of the verified call.
        name: the graphed callable's name.
        tol: the tolerance; default per dtype (:func:`tolerance_for`).
    """
    head = f"verify: call {call} of graphed '{name}': {what}"
    if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor):
        if isinstance(got, torch.Tensor) != isinstance(want, torch.Tensor) or not _same_value(
            got, want
        ):
            raise VerifyError(
                f"{head} is {_short(got)} in the graph but {_short(want)} eagerly; "
                + _FIX,
                what=what,
                call=call,
                max_error=math.inf,
            )
        return
    if got.shape != want.shape or got.dtype != want.dtype:
        raise VerifyError(
            f"{head} is {_describe(got)} in the graph but {_describe(want)} eagerly; " + _FIX,
            what=what,
            call=call,
            max_error=math.inf,
        )
    if got.numel() == 0:
        return
    t = tolerance_for(want.dtype, tol)
    a = got.detach()
    b = want.detach().to(a.device)
    if not (a.dtype.is_floating_point or a.dtype.is_complex):
        bad = a != b
        if not bool(bad.any()):
            return
        diff = (a.to(torch.float64) - b.to(torch.float64)).abs()
    else:
        a64, b64 = a.to(torch.float64), b.to(torch.float64)
        diff = (a64 - b64).abs()
        both_nan = torch.isnan(a64) & torch.isnan(b64)
        ok = (a64 == b64) | both_nan | (diff <= t.atol + t.rtol * b64.abs())
        if bool(ok.all()):
            return
        # A NaN on one side only, or unequal infinities, count as an infinite error.
        diff = torch.where(ok, torch.zeros_like(diff), torch.nan_to_num(diff, nan=math.inf))
    flat = int(diff.reshape(-1).argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape)) if diff.dim() else ()
    max_error = float(diff.reshape(-1)[flat])
    gv = a.reshape(-1)[flat].item()
    ev = b.reshape(-1)[flat].item()
    where = f" at index {index}" if index else ""
    raise VerifyError(
        f"{head} differs from eager by up to {max_error:.3g}{where} (graph {gv:.6g}, eager "
        f"{ev:.6g}); allowed |graph - eager| <= {t.atol:g} + {t.rtol:g} * |eager| for "
        f"{str(want.dtype).removeprefix('torch.')}. " + _FIX,
        what=what,
        call=call,
        max_error=max_error,
    )


_FIX = (
    "The graph no longer computes what the callable computes now: a value it read at capture "
    "changed (a Python number or global, a non-tensor attribute, a parameter or buffer object "
    "that was replaced), or the callable is not deterministic. Graph it again after such a "
    "change, pass values that change as tensor arguments, or pass verify_tol=(rtol, atol) if "
    "the difference is expected"
)


def _same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an == that raises means "not comparable": different
        return False


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor ({_describe(value)})"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_tree(
    prefix: str,
    got: Any,
    want: Any,
    *,
    call: int,
    name: str,
    tol: Tolerance | None = None,
) -> None:
    """:func:`check_close` for every leaf of two pytrees, named ``prefix[0]['logits']`` etc."""
    got_leaves, got_spec = _compat.tree_flatten_with_path(got)
    want_leaves, want_spec = _compat.tree_flatten(want)
    if got_spec != _compat.tree_flatten(want)[1]:
        raise VerifyError(
            f"verify: call {call} of graphed '{name}': {prefix} has structure {got_spec} in the "
            f"graph but {want_spec} eagerly; " + _FIX,
            what=prefix,
            call=call,
            max_error=math.inf,
        )
    for (path, g), w in zip(got_leaves, want_leaves):
        check_close(prefix + _compat.keystr(path), g, w, call=call, name=name, tol=tol)


def check_verify(verify: Any) -> int:
    """Validate ``verify=`` (an int >= 0) and return it."""
    if isinstance(verify, bool) or not isinstance(verify, int) or verify < 0:
        raise ValueError(
            f"verify must be an int >= 0 (how many first calls to compare with eager), got {verify!r}"
        )
    return verify


# -- the eager reference's own copies ------------------------------------------------------------


def detached(tree: Any) -> Any:
    leaves, spec = _compat.tree_flatten(tree)
    return _compat.tree_unflatten(
        [t.detach() if isinstance(t, _Tensor) else t for t in leaves], spec
    )


@contextlib.contextmanager
def buffers_swapped(
    module: torch.nn.Module | None,
) -> Iterator[list[tuple[str, torch.Tensor, torch.Tensor]]]:
    """Within the block, every buffer of ``module`` is replaced by a clone of itself.

    Yields ``(label, original, clone)`` triples; afterwards the originals are registered again,
    untouched (same storage, same version), and each clone holds what the block left in it.
    """
    swapped: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    places: list[tuple[torch.nn.Module, str, torch.Tensor]] = []
    if module is not None:
        with torch.no_grad():
            for mname, m in module.named_modules():
                for bname, b in list(m._buffers.items()):
                    if b is None:
                        continue
                    clone = b.clone()
                    m._buffers[bname] = clone
                    places.append((m, bname, b))
                    swapped.append((f"'{mname + '.' if mname else ''}{bname}'", b, clone))
    try:
        yield swapped
    finally:
        for m, bname, b in places:
            m._buffers[bname] = b


def named_buffers(keeper: StateKeeper, module: torch.nn.Module | None) -> list[tuple[str, torch.Tensor]]:
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    if module is not None:
        for name, b in module.named_buffers():
            out.append((f"'{name}'", b))
            seen.add(id(b))
    for m in keeper.modules:
        for name, b in m.named_buffers(recurse=False):
            if id(b) not in seen:
                seen.add(id(b))
                out.append((f"'{name}' of {type(m).__name__}", b))
    return out
