"""``nn.Module``'s hook dicts, which are private attributes (there is no public query): which hooks
a module has, and which forward hooks a call of it runs. Torch's own make_graphed_callables reads
the same ones. A torch without one of them counts it empty."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["module_hooks", "forward_hooks", "global_forward_hooks", "hook_handles_made"]

_EMPTY: dict[Any, Any] = {}
_module = torch.nn.modules.module


def module_hooks(module: torch.nn.Module) -> bool:
    """Does ``module`` itself have forward, forward-pre, backward or backward-pre hooks?"""
    names = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    return any(getattr(module, n, None) for n in names)


def forward_hooks(module: torch.nn.Module) -> tuple[dict[int, Any], dict[int, Any]]:
    """``module``'s forward pre-hooks and forward hooks, each keyed by its handle's id."""
    return getattr(module, "_forward_pre_hooks", _EMPTY), getattr(module, "_forward_hooks", _EMPTY)


def global_forward_hooks() -> tuple[dict[int, Any], dict[int, Any]]:
    """The forward pre-hooks and forward hooks every module runs
    (``register_module_forward_pre_hook`` / ``register_module_forward_hook``)."""
    return (getattr(_module, "_global_forward_pre_hooks", _EMPTY),
            getattr(_module, "_global_forward_hooks", _EMPTY))


#: ``next_id`` of this class counts every hook handle torch has made (module, tensor, optimizer
#: hooks): a class attribute, read per call to see whether any hook may have come since.
hook_handles_made = torch.utils.hooks.RemovableHandle
