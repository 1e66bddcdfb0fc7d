"""What an argument's value is, said and converted: descriptions for messages, constants
compared, the lossless widening casts a call may make into a static buffer (core/io.py)."""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

__all__ = ["conversion_fix", "copy_widening", "describe_tensor", "same_constant", "warn_widening", "widens"]

log = logging.getLogger(__name__)


def warn_widening(
    warned: set[tuple[int, torch.dtype]], i: int, path: str, got: torch.dtype, want: torch.dtype
) -> None:
    """Warn once per argument ``i`` and dtype that a lossless cast copies it in."""
    if (i, got) in warned:
        return
    warned.add((i, got))
    name = lambda dtype: str(dtype).removeprefix("torch.")  # noqa: E731
    log.warning(
        "torchreplay: %s is %s but the graph was captured with %s: copying it in with a lossless "
        "cast (the graph computes in %s; each call pays the cast). Pass %s, or graph with a "
        "sample of this dtype",
        path, name(got), name(want), name(want), name(want),
    )


def copy_widening(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each source into its static buffer with a (lossless) cast, unrecorded by autograd."""
    with torch.no_grad():
        for static, leaf in pairs:
            static.copy_(leaf)

# Lossless casts a call may make into a static buffer: every value of the source dtype is exactly
# representable in the target. Integer -> float and bool -> anything are left out on purpose: they
# change what the argument means, not only its precision.
_WIDENINGS: dict[torch.dtype, frozenset[torch.dtype]] = {
    torch.float16: frozenset({torch.float32, torch.float64}),
    torch.bfloat16: frozenset({torch.float32, torch.float64}),
    torch.float32: frozenset({torch.float64}),
    torch.int8: frozenset({torch.int16, torch.int32, torch.int64}),
    torch.uint8: frozenset({torch.int16, torch.int32, torch.int64}),
    torch.int16: frozenset({torch.int32, torch.int64}),
    torch.int32: frozenset({torch.int64}),
}


def widens(src: torch.dtype, dst: torch.dtype) -> bool:
    """Is casting ``src`` to ``dst`` lossless (every ``src`` value exact in ``dst``)?"""
    return dst in _WIDENINGS.get(src, ())


def describe_tensor(t: torch.Tensor) -> str:
    """Return ``'shape (8, 512) float32 on cuda:0'`` for error messages."""
    dtype = str(t.dtype).removeprefix("torch.")
    layout = "" if t.layout is torch.strided else f" {str(t.layout).removeprefix('torch.')}"
    return f"shape {tuple(t.shape)} {dtype}{layout} on {t.device}"


def same_constant(a: Any, b: Any) -> bool:
    """Is the call's non-tensor ``a`` the captured constant ``b`` (same type, equal)?"""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # an object whose == raises or is ambiguous: only identity counts
        return False


def conversion_fix(leaf: torch.Tensor, slot: Any) -> str:
    """The fix for a tensor of the right shape but another dtype, device or layout."""
    if leaf.dtype != slot.dtype:
        return f"cast it with .to({slot.dtype})"
    if leaf.device != slot.device:
        return f"move it with .to('{slot.device}')"
    return "pass a dense tensor (e.g. .to_dense())"
