"""``nn.Module``'s hook dicts, which are private attributes (there is no public query): which hooks
a module has, and which forward hooks a call of it runs. Torch's own make_graphed_callables reads
the same ones. A torch without one of them counts it empty."""

from __future__ import annotations

import importlib
from typing import Any

import torch

__all__ = [
    "module_hooks", "forward_hooks", "global_forward_hooks", "backward_hooks", "global_backward_hooks",
    "tensor_hooks", "optimizer_hooks", "global_optimizer_hooks", "hook_handles_made",
]

_EMPTY: dict[Any, Any] = {}
_module = torch.nn.modules.module
_optimizer = importlib.import_module("torch.optim.optimizer")  # the module, not the class


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


def backward_hooks(module: torch.nn.Module) -> tuple[dict[int, Any], dict[int, Any]]:
    """``module``'s backward pre-hooks and backward hooks (full or not), keyed by handle id."""
    return getattr(module, "_backward_pre_hooks", _EMPTY), getattr(module, "_backward_hooks", _EMPTY)


def global_backward_hooks() -> tuple[dict[int, Any], dict[int, Any]]:
    """The backward pre-hooks and backward hooks every module runs
    (``register_module_full_backward_pre_hook`` / ``register_module_full_backward_hook``)."""
    return (getattr(_module, "_global_backward_pre_hooks", _EMPTY),
            getattr(_module, "_global_backward_hooks", _EMPTY))


def tensor_hooks(t: torch.Tensor) -> tuple[dict[int, Any], dict[int, Any]]:
    """A tensor's gradient hooks (``register_hook``) and, for a leaf, its post-accumulate-grad
    hooks (``register_post_accumulate_grad_hook``); ``None`` until the first is registered."""
    return (getattr(t, "_backward_hooks", None) or _EMPTY,
            getattr(t, "_post_accumulate_grad_hooks", None) or _EMPTY)


def optimizer_hooks(opt: torch.optim.Optimizer) -> tuple[dict[int, Any], dict[int, Any]]:
    """An optimizer's step pre-hooks and step post-hooks."""
    return (getattr(opt, "_optimizer_step_pre_hooks", _EMPTY),
            getattr(opt, "_optimizer_step_post_hooks", _EMPTY))


def global_optimizer_hooks() -> tuple[dict[int, Any], dict[int, Any]]:
    """The step pre-hooks and post-hooks every optimizer runs (``register_optimizer_step_pre_hook``
    / ``register_optimizer_step_post_hook``)."""
    return (getattr(_optimizer, "_global_optimizer_pre_hooks", _EMPTY),
            getattr(_optimizer, "_global_optimizer_post_hooks", _EMPTY))


#: ``next_id`` of this class counts every hook handle torch has made (module, tensor, optimizer
#: hooks): a class attribute, read per call to see whether any hook may have come since.
hook_handles_made = torch.utils.hooks.RemovableHandle
