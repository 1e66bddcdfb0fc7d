"""Which ``torch.distributed`` collectives a captured call issued, in order.

Every collective, the classic API (``dist.all_reduce``: ``c10d`` ops, DDP's bucketed all-reduce
among them) and the functional one (``_c10d_functional`` ops), reaches the dispatcher, so a
dispatch mode around the captured call sees each with its process group, dtype and size. The
list is the graph's *collective signature*: two ranks that replay graphs of different signatures
would launch mismatched NCCL kernels and hang, so the signature goes into the fingerprint the
ranks compare before each replay (:mod:`torchreplay.distributed.agree`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Sequence

import torch

from torchreplay import _compat

__all__ = [
    "Collective", "CollectiveLog", "COLLECTIVE_NAMESPACES", "NOT_COMMUNICATION", "fingerprint",
    "group_of", "groups_of", "describe",
]

COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd"})
# Bookkeeping ops of those namespaces that move no data between ranks.
NOT_COMMUNICATION = frozenset({"wait_tensor", "_wrap_tensor_autograd"})


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective a captured call issued."""

    op: str  #: e.g. ``"allreduce_"``, ``"all_gather_into_tensor"``
    group: str  #: the process group's name (``"0"`` is the default group)
    ranks: tuple[int, ...]  #: the group's global ranks
    dtype: str
    numel: int  #: elements this rank sends (the first tensor argument's, lists summed)

    def line(self) -> str:
        return f"{self.op}({self.numel} x {self.dtype}, group {self.group} = ranks {list(self.ranks)})"


class CollectiveLog(_compat.LightDispatchMode):
    """Records every collective issued inside it (this thread, and autograd's, which inherit
    the mode), in order, in ``collectives``; ``groups`` keeps each group object by name."""

    def __init__(self) -> None:
        super().__init__()
        self.collectives: list[Collective] = []
        self.groups: dict[str, Any] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace in COLLECTIVE_NAMESPACES:
            name = func.__name__.split(".")[0]  # "all_reduce.default" -> "all_reduce"
            if name not in NOT_COMMUNICATION:
                self._record(name, args, kwargs)
        return func(*args, **kwargs)

    def _record(self, op: str, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        group = None
        tensors: list[torch.Tensor] = []
        for a in [*args, *kwargs.values()]:
            if group is None:
                group = _compat.group_of_arg(a)
            if isinstance(a, torch.Tensor):
                tensors.append(a)
            elif isinstance(a, (list, tuple)):
                tensors.extend(t for t in a if isinstance(t, torch.Tensor))
        if group is None:  # a functional collective names its group by its last str argument
            names = [a for a in args if isinstance(a, str)]
            if names:
                group = _compat.group_named(names[-1])
        first = tensors[0] if tensors else None
        # The input is the first tensor of the functional ops and of the in-place c10d ops
        # (their list of tensors); _allgather_base_ and _reduce_scatter_base_ take (out, in).
        if op in ("_allgather_base_", "_reduce_scatter_base_") and len(tensors) > 1:
            first = tensors[1]
        numel = sum(t.numel() for t in tensors[:1]) if first is None else first.numel()
        gname = str(getattr(group, "group_name", "?")) if group is not None else "?"
        try:
            ranks = tuple(_compat.group_ranks(group)) if group is not None else ()
        except (RuntimeError, ValueError):
            ranks = ()
        if group is not None:
            self.groups[gname] = group
        dtype = str(first.dtype).removeprefix("torch.") if first is not None else "-"
        self.collectives.append(Collective(op, gname, ranks, dtype, numel))


def fingerprint(parts: Sequence[Any]) -> int:
    """A 62-bit number for ``parts`` (collective signatures, sizes), equal on every rank that
    captured the same thing; it never is 0 or 1 (those mean "eager" and "mode fallback")."""
    digest = hashlib.sha256(repr(list(parts)).encode()).digest()
    return (int.from_bytes(digest[:8], "little") >> 2) | 2


def group_of(log: CollectiveLog | None, collectives: Sequence[Collective]) -> Any:
    """The group the ranks must agree in: that of the collectives when they all use one, else the
    default group (every rank)."""
    names = {c.group for c in collectives}
    if log is not None and len(names) == 1:
        (name,) = names
        group = log.groups.get(name)
        if group is not None:
            return group
    return torch.distributed.group.WORLD


def groups_of(collectives: Sequence[Collective]) -> list[Any]:
    """Every process group ``collectives`` use (the default group where a name does not resolve)."""
    if not collectives or not _compat.dist_ready():
        return []
    out: list[Any] = []
    for name in dict.fromkeys(c.group for c in collectives):
        group = _compat.group_named(name) or torch.distributed.group.WORLD
        if all(group is not g for g in out):
            out.append(group)
    return out


def describe(collectives: Sequence[Collective], limit: int = 4) -> str:
    """A short text of the signature: the first ``limit`` collectives and a count."""
    if not collectives:
        return "no collectives"
    head = ", ".join(c.line() for c in collectives[:limit])
    more = f", ... ({len(collectives)} in all)" if len(collectives) > limit else ""
    return head + more
