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
    "verified_call",
    "verify_backward",
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


# -- a verified call of make_graphed_callables ----------------------------------------------


def verified_call(runner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """One call of a ``GraphedCallable`` (training/graphed_callable.py) built with
    ``verify=K``, among its first K: the callable runs eagerly on clones of the arguments and
    the module's buffers, from the state the graph then replays from; outputs and buffers are
    compared here, and the gradients at the backward (:func:`verify_backward`)."""
    # The first K calls are compared, whatever their outcome: count this one now.
    runner._verify_left -= 1
    call = runner._verify_total - runner._verify_left
    grad_on = torch.is_grad_enabled()
    module = runner._module
    keeper = StateKeeper(runner.device, modules=[module] if module is not None else [], params=False)
    leaves, spec = _compat.tree_flatten((tuple(args), dict(kwargs)))
    ref_leaves = list(leaves)
    for k, i in enumerate(runner._tensor_idx):
        t = leaves[i]
        if isinstance(t, _Tensor):
            c = t.detach().clone()
            if grad_on and runner._sample_req[k]:
                c.requires_grad_(True)
            ref_leaves[i] = c
    ref_args, ref_kwargs = _compat.tree_unflatten(ref_leaves, spec)
    # The eager reference runs on clones of the module's buffers: autograd may save a buffer
    # for backward (cuDNN's BatchNorm saves its running statistics), and restoring the
    # originals in place afterwards would bump the version of what eager's backward reads.
    with keeper.discovering(), keeper.drawing(leaves), buffers_swapped(module) as swapped:
        ref_out = runner._run_fn(*ref_args, **ref_kwargs)
    eager_buffers = [(label, orig, clone) for label, orig, clone in swapped]
    seen = {id(orig) for _, orig, _ in swapped}
    eager_buffers += [
        (label, b, b.detach().clone())
        for label, b in named_buffers(keeper, None)
        if id(b) not in seen
    ]
    keeper.restore()  # the graph replays from the state eager started from (buffers, RNG)

    verify = None
    if grad_on and runner._has_backward:
        ref_flat = _compat.tree_flatten(ref_out)[0]
        if len(ref_flat) == len(runner._pair.leaves):
            ref_diff = [ref_flat[i] for i in runner._diff_idx]
            n_leaves = len(runner._tensor_idx)
            ref_ins: list[Any] = []
            for pos in runner._grad_pos:
                if pos < n_leaves:
                    ref_ins.append(ref_leaves[runner._tensor_idx[pos]])
                else:
                    ref_ins.append(runner._surface_t[pos - n_leaves])
            verify = (ref_diff, ref_ins, call)
    out = runner._run(args, kwargs, verify)
    check_tree("output", out, detached(ref_out), call=call, name=runner.name, tol=runner._tol)
    for label, b, want in eager_buffers:
        check_close(f"buffer {label}", b, want, call=call, name=runner.name, tol=runner._tol)
    runner.stats.verified += 1
    return out


def verify_backward(runner: Any, verify: Any, grads: tuple[torch.Tensor | None, ...]) -> None:
    """At the backward of a verified call: the eager reference's gradients, compared with the
    backward graph's (``verify``: what :func:`verified_call` left on the autograd node)."""
    ref_diff, ref_ins, call = verify
    usable = [
        (o, g) for o, g in zip(ref_diff, grads) if isinstance(o, _Tensor) and o.requires_grad
    ]
    if not usable:
        return
    wanted = [i for i, t in enumerate(ref_ins) if isinstance(t, _Tensor) and t.requires_grad]
    ref_grads = torch.autograd.grad(
        [o for o, _ in usable],
        [ref_ins[i] for i in wanted],
        grad_outputs=[g if g is not None else torch.zeros_like(o) for o, g in usable],
        allow_unused=True,
    )
    for i, want in zip(wanted, ref_grads):
        got = runner._static_grad_inputs[i]
        if want is None and got is not None:
            want = torch.zeros_like(got)
        if got is None and want is not None:
            got = torch.zeros_like(want)
        check_close(runner._grad_names[i], got, want, call=call, name=runner.name, tol=runner._tol)
