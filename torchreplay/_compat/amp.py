"""What a graph's every call reads of the call's context: is CUDA autocast on and in which
dtype, and is a ``TorchDispatchMode`` on."""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["any_autocast", "cuda_autocast", "dispatch_modes"]


def _cuda_on() -> bool:
    return torch.is_autocast_enabled("cuda")


#: ``any_autocast()``: is autocast on for any device? ``torch._C._is_any_autocast_enabled``
#: (private) answers in one call what the public getters answer per device; a graph pays it on
#: every call, so it is the binding itself. A torch without it: CUDA's public getter.
any_autocast: Callable[[], bool] = getattr(torch._C, "_is_any_autocast_enabled", _cuda_on)


def cuda_autocast() -> torch.dtype | None:
    """The dtype CUDA autocast casts to, or ``None`` when it is off (public getters)."""
    if not any_autocast() or not torch.is_autocast_enabled("cuda"):
        return None
    return torch.get_autocast_dtype("cuda")


def _none() -> int:
    return 0


#: ``dispatch_modes()``: how many ``TorchDispatchMode``s are on (user modes such as
#: ``FlopCounterMode``, and infra modes such as ``FakeTensorMode`` or a tracer's proxy mode):
#: ``torch._C._len_torch_dispatch_stack`` (private, the binding itself: every call reads it). A
#: torch without it: 0 (no mode is seen).
dispatch_modes: Callable[[], int] = getattr(torch._C, "_len_torch_dispatch_stack", _none)
