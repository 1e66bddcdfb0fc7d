"""What a breakable graph's call does before its replay: the ranks' agreement (graphs that hold
collectives) and the many-size policy of ``capture=``, ``fallback=`` and ``max_graphs=`` (the
same rules as ``tr.graph(sizes=)``, :func:`~torchreplay.sizes.plan.decide`)."""

from __future__ import annotations

from typing import Any, Sequence

from torchreplay.distributed import EAGER, GRAPH
from torchreplay.errors import ReplayInputError
from torchreplay.sizes.plan import decide, target_size

__all__ = ["agree_size", "eager_by_policy"]


def eager_by_policy(front: Any, leaves: Sequence[Any], size: int | None) -> bool:
    """``capture=``, ``fallback=``, ``max_graphs=`` as :func:`~torchreplay.sizes.plan.decide`
    rules them for ``tr.graph(sizes=)``: raise, or say the call runs eagerly (counted)."""
    opts = front._options
    assert opts is not None
    rt = front.runtime
    n = rt.rows(leaves) if size is None else size
    if opts.capture == "lazy":
        decision = decide(opts, n or 0, rt.captured_sizes(), name=front.name)
    elif target_size(opts.sizes, n or 0) is None:  # above the largest, or no rows
        decision = decide(opts, n or 0, (), name=front.name)
    else:
        return False
    if decision.action == "error":
        raise ReplayInputError(decision.message)
    if decision.action == "eager":
        rt._count_fallback(decision.message.removeprefix("torchreplay: "))
        return True
    return False


def agree_size(front: Any, leaves: Sequence[Any], mode_changed: bool) -> int | None:
    """Post this call to the other ranks; return the size to replay (``None``: the call's
    own; -1: every rank runs eagerly). With ``sync_sizes`` the size that holds the largest
    call of any rank, else each rank's own, which must be equal (or all raise)."""
    ranks = front._ranks
    rt = front.runtime
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
