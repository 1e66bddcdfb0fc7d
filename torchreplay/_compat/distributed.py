"""The ``torch.distributed`` names torchreplay needs that torch keeps private.

Importing this module imports ``torch.distributed`` (present in every build, even where
``is_available()`` is false) and initialises no CUDA and no process group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["dist_ready", "group_of_arg", "group_named", "default_store", "group_ranks"]

# c10d ops pass their process group boxed as a TorchScript object; the C++ class gives it back.
_ProcessGroup = getattr(getattr(torch._C, "_distributed_c10d", None), "ProcessGroup", None)
_PG_TYPE = "ProcessGroup"


def dist_ready() -> bool:
    """A default process group exists in this process."""
    return dist.is_available() and dist.is_initialized()


def group_of_arg(value: Any) -> Any:
    """The process group a c10d op's argument holds, or None for any other argument."""
    if _ProcessGroup is None:
        return None
    if isinstance(value, _ProcessGroup):
        return value
    if isinstance(value, torch.ScriptObject):
        try:
            if not value._type().qualified_name().endswith(_PG_TYPE):  # a ReduceOp, a Work
                return None
            return _ProcessGroup.unbox(value)
        except (AttributeError, RuntimeError):  # a torch without unbox: the group is unknown
            return None
    return None


def group_named(name: str) -> Any:
    """The process group a functional collective names by its ``group_name``, or None."""
    from torch.distributed.distributed_c10d import _resolve_process_group  # private, 2.3+

    try:
        return _resolve_process_group(name)
    except (KeyError, RuntimeError, ValueError):
        return None


def default_store() -> Any:
    """The store of the default process group (the rendezvous every rank already shares)."""
    from torch.distributed.distributed_c10d import _get_default_store  # private, 1.x+

    return _get_default_store()


def group_ranks(group: Any) -> list[int]:
    """The global ranks of ``group``, in group-rank order."""
    return list(dist.get_process_group_ranks(group))
