"""Graphs of the ``torch.compile`` backend that hold collectives (a tensor-parallel model): the
ranks agree before each replay, as ``tr.graph``'s do (:mod:`torchreplay.distributed`).

Dynamo turns ``dist.all_reduce`` and the functional collectives into ``_c10d_functional`` ops of
the FX graph, so which collectives a graph holds, in order, is read from the graph at compile
time (no capture needed). A graph that holds one (or any graph, with ``RankConfig(sync_sizes=
True)`` or a ``group``) gets an :class:`~torchreplay.distributed.Agreement` at its compile, made
by every rank at the same point (ranks compile the same graphs at the same call); Dynamo then
calls an :class:`AgreedRuntime` in place of the runtime: ``sync_sizes`` pads every rank to the
size the largest call of any rank needs, a call above the largest size runs without graphs on
every rank, and anything else that differs raises on every rank.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx

from torchreplay import _compat
from torchreplay.compile.split import node_value, op_name
from torchreplay.config import RankConfig
from torchreplay.core.pool import release_with
from torchreplay.distributed import Agreement, Collective, agreement
from torchreplay.distributed.collectives import COLLECTIVE_NAMESPACES, NOT_COMMUNICATION
from torchreplay.pieces.ranks import agree_size, run_eagerly_at
from torchreplay.pieces.runtime import PiecewiseRuntime

__all__ = ["AgreedRuntime", "agreed", "collectives_in"]


class _Groups:
    """What :func:`~torchreplay.distributed.agreement` reads of a capture's collective log."""

    def __init__(self, groups: dict[str, Any]) -> None:
        self.groups = groups


def collectives_in(gm: fx.GraphModule) -> tuple[list[Collective], dict[str, Any]]:
    """The collectives of ``gm``'s nodes, in order, and their process groups by name."""
    found: list[Collective] = []
    groups: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        namespace, _, rest = op_name(node).partition(".")  # "_c10d_functional.all_reduce"
        op = rest.split(".")[0]
        if namespace not in COLLECTIVE_NAMESPACES or op in NOT_COMMUNICATION:
            continue
        names = [a for a in node.args if isinstance(a, str)]
        group = _compat.group_named(names[-1]) if names else None
        gname = str(getattr(group, "group_name", "?")) if group is not None else "?"
        if group is not None:
            groups[gname] = group
        try:
            ranks = tuple(_compat.group_ranks(group)) if group is not None else ()
        except (RuntimeError, ValueError):
            ranks = ()
        first = next((a for a in node.args if isinstance(a, fx.Node)), None)
        value = node_value(first) if first is not None else None
        dtype = str(getattr(value, "dtype", "-")).removeprefix("torch.")
        numel = getattr(value, "numel", lambda: -1)()
        found.append(Collective(op, gname, ranks, dtype, numel if isinstance(numel, int) else -1))
    return found, groups


class AgreedRuntime:
    """Called by Dynamo in place of ``runtime``: the ranks agree first, then it replays the
    agreed size (or every rank runs the call without graphs)."""

    def __init__(self, runtime: PiecewiseRuntime, ranks: Agreement) -> None:
        self.runtime = runtime
        self._ranks = ranks

    def __call__(self, *args: Any) -> Any:
        rt = self.runtime
        size, rows = agree_size(self._ranks, rt, args)
        if size == -1:
            rt._count_fallback(
                "a call above the largest captured size on some rank: every rank runs it "
                "without graphs"
            )
            return tuple(run_eagerly_at(rt, rt._run_ungraphed, args, rows))
        return rt(*args, size=size)


def agreed(
    runtime: PiecewiseRuntime,
    gm: fx.GraphModule,
    ranks: RankConfig,
    sizes: Sequence[int] | None,
    device: torch.device,
) -> AgreedRuntime | None:
    """The front that makes the ranks agree before ``runtime``'s replays, or ``None`` (no
    process group, nothing to agree on: see :func:`~torchreplay.distributed.agreement`)."""
    if not _compat.dist_ready() and ranks.group is None and not ranks.sync_sizes:
        return None
    collectives, groups = collectives_in(gm)
    agreement_ = agreement(
        ranks, collectives, _Groups(groups), name=runtime.name,  # type: ignore[arg-type]
        parts=[tuple(sizes or ())], sizes=sizes is not None, device=device,
    )
    release_with(runtime, collectives, agreement_)
    if agreement_ is None:
        return None
    runtime.agreement = agreement_  # type: ignore[attr-defined]  # for tr.explain
    runtime.collectives = collectives  # type: ignore[attr-defined]
    return AgreedRuntime(runtime, agreement_)
