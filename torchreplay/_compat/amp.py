"""What a graph's every call reads of the call's context: is CUDA autocast on and in which
dtype, and is a ``TorchDispatchMode`` on; and keeping torch's AOT autograd cache from mixing
autocast dtypes (:func:`safe_aot_cache`)."""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Callable, Iterator

import torch

__all__ = ["any_autocast", "cuda_autocast", "dispatch_modes", "safe_aot_cache"]


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


@functools.cache
def _aot_cache_keys_autocast_dtype() -> bool:
    """Does torch's AOT autograd cache key hold the autocast dtype (pytorch/pytorch#181564,
    in torch 2.13; 2.11 keys only whether autocast is on)? Read from its source; unknown: no."""
    try:
        from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCacheDetails

        return "get_autocast_dtype" in inspect.getsource(AOTAutogradCacheDetails._record_runtime_state)
    except Exception:  # noqa: BLE001  (moved, renamed, no source: take it as missing)
        return False


@contextlib.contextmanager
def safe_aot_cache() -> Iterator[None]:
    """Around an Inductor compile: under autocast, on a torch whose AOT autograd cache does not
    key the autocast dtype, that cache is off. It would hand a compile under fp16 autocast the
    code compiled earlier under bf16 (in this process or, on disk, any earlier one): on the H200
    (torch 2.11) ``torch.compile``'s own Inductor trained a CNN with gradients 10% off eager's
    that way, after a bf16 run of the same model."""
    if not any_autocast() or _aot_cache_keys_autocast_dtype():
        yield
        return
    import torch._functorch.config as functorch_config

    if not hasattr(functorch_config, "enable_autograd_cache"):
        yield
        return
    with functorch_config.patch(enable_autograd_cache=False):
        yield
