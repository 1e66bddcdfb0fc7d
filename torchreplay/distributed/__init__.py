"""Collectives in graphs: which ones a capture holds, and the ranks' agreement before replays.

- :mod:`~torchreplay.distributed.collectives`: the collectives a captured call issued, in order,
  and the fingerprint of what was captured.
- :mod:`~torchreplay.distributed.agree`: the per-call exchange that makes every rank replay the
  same graph (and the same padded size), or raise on every rank, never hang.
- :mod:`~torchreplay.distributed.watch`: a replay that hangs all the same (a rank died after the
  agreement) ends the process with the graph and call named, not a silent hang.

This layer sits under ``core/``: it knows nothing of graphs, only of process groups.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from torchreplay import _compat
from torchreplay.config import RankConfig
from torchreplay.distributed.agree import ABSENT, EAGER, GRAPH, Agreement
from torchreplay.distributed.collectives import (
    Collective,
    CollectiveLog,
    describe,
    fingerprint,
    group_of,
)
from torchreplay.errors import UnsupportedError

__all__ = [
    "Agreement", "Collective", "CollectiveLog", "GRAPH", "EAGER", "ABSENT", "agreement",
    "describe", "fingerprint",
]


def agreement(
    ranks: RankConfig,
    collectives: Sequence[Collective],
    log: CollectiveLog | None,
    *,
    name: str,
    parts: Sequence[Any] = (),
    sizes: bool = False,
    describe_call: Callable[[int, int], str] | None = None,
    device: torch.device | None = None,
) -> Agreement | None:
    """The agreement a graph needs, or ``None`` (no process group, no collective and nothing
    asked, ``check=False``, or a group of one rank). Every rank of the group must call this at
    the same point (right after the capture).

    Args:
        ranks: the options.
        collectives, log: what the capture recorded.
        name: the graph's name.
        parts: more of what was captured, for the fingerprint (the sizes).
        sizes: the graph has ``sizes=`` (``sync_sizes`` applies).
        describe_call: words for a rank's posted ``(size, choice)`` in errors.
        device: the graph's device: the hang watch records its markers on that device's
            current stream (where replays run); default: the current device's.
    """
    asked = ranks.group is not None or bool(ranks.sync_sizes)
    if not _compat.dist_ready():
        if asked:
            raise UnsupportedError(
                f"'{name}': sync_sizes/group given, but no torch.distributed process group is "
                "initialised in this process: call torch.distributed.init_process_group first"
            )
        return None
    if not ranks.check or (not collectives and not asked):
        return None
    group = ranks.group if ranks.group is not None else group_of(log, collectives)
    if len(_compat.group_ranks(group)) <= 1:
        return None
    sync = sizes and ranks.sync_sizes is not False
    if describe_call is None and sizes:
        describe_call = _sync_words if sync else _size_words
    signature = [(c.op, c.group, c.ranks, c.dtype, c.numel) for c in collectives]
    return Agreement(
        group,
        name,
        fingerprint([signature, *parts]),
        sync_sizes=sync,
        timeout=ranks.timeout,
        describe=describe_call,
        marker=_cuda_marker(torch.cuda.current_stream(device)) if collectives and _cuda() else None,
        on_hang=ranks.on_hang,
    )


def _cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _cuda_marker(stream: torch.cuda.Stream) -> Callable[[], Any]:
    """Record a CUDA event on ``stream`` (the caller's stream at capture, where replays run)."""

    def record() -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    return record


_EAGER_WORDS = "eager (its module is in the other train/eval mode, or its size has no graph)"


def _sync_words(n: int, choice: int) -> str:
    return _EAGER_WORDS if choice == EAGER else f"a call of size {n}"


def _size_words(n: int, choice: int) -> str:
    return _EAGER_WORDS if choice == EAGER else f"the graph of size {n}"
