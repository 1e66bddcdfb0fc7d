"""The ranks' agreement before a piecewise replay, for both front ends (breakable graphs and the
``torch.compile`` backend): which size every rank replays, or that every rank runs eagerly."""

from __future__ import annotations

from typing import Any, Sequence

from torchreplay.distributed import EAGER, GRAPH, Agreement
from torchreplay.pieces.runtime import PiecewiseRuntime

__all__ = ["agree_size"]


def agree_size(
    ranks: Agreement, rt: PiecewiseRuntime, leaves: Sequence[Any], mode_changed: bool = False
) -> int | None:
    """Post this call to the other ranks; return the size to replay (``None``: the call's
    own; -1: every rank runs eagerly). With ``sync_sizes`` the size that holds the largest
    call of any rank, else each rank's own, which must be equal (or all raise)."""
    n = rt.rows(leaves)
    if mode_changed:
        ranks(0, EAGER)
        return None
    if ranks.sync_sizes:
        agreed = ranks(n or 0, GRAPH)
        size = rt._bucket(agreed)
        return -1 if size == -1 or agreed == 0 else size
    own = rt._bucket(n)
    eager = own == -1 or n == 0
    ranks(0 if eager or own is None else own, EAGER if eager else GRAPH)
    return None
