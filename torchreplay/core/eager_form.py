"""What ``copy.deepcopy``, ``pickle`` and ``inspect.signature`` make of a graphed callable.

A CUDA graph replays into the memory it was captured with: it cannot be copied, and a copy that
shared it would run the original's weights. (torch's ``make_graphed_callables`` does that: the
deep copy of a module keeps the original's graphed forward, so ``ema = copy.deepcopy(model)``
silently evaluates the live model.) Ours:

- a deep copy of a graphed callable is the copy of the eager callable it stands for: a module's
  forward bound to the module's copy, so ``copy.deepcopy(model)`` after
  ``tr.make_graphed_callables(model, ...)`` (timm's ``ModelEmaV2``, torch's ``AveragedModel``, a
  teacher model) is an eager model with its own weights; one warning per graph says so;
- pickled (``torch.save(model)``, a process spawned with the model), a module's graphed forward
  is saved as that module's own forward: the file loads as the eager model, without torchreplay
  installed; one warning per graph;
- a shallow copy (``copy.copy``) is the graph itself, as a shallow copy of the module shares it;
- anything else that has no eager form to save raises :class:`UnsupportedError` naming the fix;
- under ``nn.DataParallel`` (which makes a replica of the module, sharing its ``__dict__`` and so
  its graphed forward, on each GPU at every call), a call the graph cannot serve runs the eager
  forward of the replica that made it, with that replica's weights, not the original's;
- its signature is the eager callable's (a module's: its forward's): code that reads which
  arguments a forward takes (Hugging Face's ``Trainer`` drops the dataset columns the forward
  does not name, ``generate`` passes ``cache_position`` only if it does) sees the model's, not
  ``(*args, **kwargs)``.
"""

from __future__ import annotations

import copy
import inspect
import logging
import types
from typing import Any

import torch

from torchreplay import _compat
from torchreplay.errors import UnsupportedError

__all__ = ["EagerForm", "own_forward"]

log = logging.getLogger(__name__)


class _EagerSignature:
    """``__signature__`` of a graphed callable: the eager callable's, read at the first look and
    kept (None on the class, and where the eager callable has none: inspect's default then)."""

    def __get__(self, obj: Any, cls: Any = None) -> inspect.Signature | None:
        if obj is None:
            return None
        eager = obj._eager_fn()
        if isinstance(eager, torch.nn.Module):
            eager = eager.forward
        try:
            sig: inspect.Signature | None = inspect.signature(eager) if eager is not obj else None
        except (TypeError, ValueError):
            sig = None
        obj.__dict__["__signature__"] = sig
        return sig


class EagerForm:
    """Mixin of every graphed callable: ``_eager_attr`` names the attribute that holds the eager
    callable it stands for (the function or module graphed, a module's own forward)."""

    _eager_attr = "fn"
    _copy_warned = False
    __signature__ = _EagerSignature()

    def __copy__(self) -> Any:
        return self

    def _eager_fn(self) -> Any:
        """What a call run eagerly (a fallback) calls: what was graphed, except a module this
        graph was then made the forward of (``layer.forward = tr.graph(layer, x)``): calling the
        module would call the graph again, without end, so its class's forward runs (the module's
        hooks ran around the call that got here)."""
        fn = getattr(self, self._eager_attr)
        replica = _compat.replica_calling(self)  # an nn.DataParallel replica: its own forward
        if replica is not None and isinstance(fn, types.MethodType) and isinstance(fn.__self__, torch.nn.Module):
            return types.MethodType(fn.__func__, replica)
        if replica is not None and isinstance(fn, torch.nn.Module):
            fn = replica
        elif replica is not None:  # (the original's forward would run on the replica's inputs)
            raise UnsupportedError(
                f"'{getattr(self, 'name', type(self).__name__)}' is called by an nn.DataParallel "
                f"replica on another GPU, but what it runs eagerly ({fn!r}) is not a method of "
                "the module, so the replica's own forward is unknown. Use "
                "DistributedDataParallel (torchrun: each process graphs its own model), or one "
                "GPU (CUDA_VISIBLE_DEVICES=0)"
            )
        if isinstance(fn, torch.nn.Module) and fn.__dict__.get("forward") is self:
            return types.MethodType(type(fn).forward, fn)
        return fn

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        self._warn_copied("copy.deepcopy", "the copy runs eagerly (a CUDA graph replays the memory "
                          "of the original, its weights included). Graph the copy to have it graphed")
        return copy.deepcopy(self._eager_fn(), memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        eager = self._eager_fn()
        owner = getattr(eager, "__self__", None)
        if isinstance(eager, types.MethodType) and isinstance(owner, torch.nn.Module):
            self._warn_copied("pickle (torch.save)", "saved as the eager forward: the graphs belong "
                              "to this process. Graph the model again after loading")
            # (what a bound method pickles as: no torchreplay needed to load it)
            return getattr, (owner, eager.__func__.__name__)
        raise UnsupportedError(
            f"'{getattr(self, 'name', type(self).__name__)}' ({type(self).__name__}) cannot be "
            "pickled: its CUDA graphs live in this process's memory. Save what was graphed "
            "instead (the model, or its state_dict()) and graph it again after loading; a "
            "module whose forward tr.make_graphed_callables replaced pickles as the eager model"
        )

    def _warn_copied(self, how: str, what: str) -> None:
        """One warning per graph (a checkpoint saved every epoch says it once)."""
        if not self._copy_warned:
            self._copy_warned = True
            log.warning("torchreplay: %s of '%s': %s", how, getattr(self, "name", type(self).__name__), what)


def own_forward(module: torch.nn.Module) -> Any:
    """``module``'s forward as it runs eagerly: where a graph took its place (a module graphed
    before, by any of ours), the forward that graph stands for."""
    forward = module.forward
    if not isinstance(forward, EagerForm):
        return forward
    eager = forward._eager_fn()
    return eager.forward if isinstance(eager, torch.nn.Module) else eager

