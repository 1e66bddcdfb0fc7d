"""What a breakable graph's call does before its replay, besides the ranks' agreement
(:func:`torchreplay.pieces.ranks.agree_size`): the many-size policy of ``capture=``,
``fallback=`` and ``max_graphs=`` (the same rules as ``tr.graph(sizes=)``,
:func:`~torchreplay.sizes.plan.decide`)."""

from __future__ import annotations

from typing import Any, Sequence

from torchreplay.errors import ReplayInputError
from torchreplay.sizes.plan import decide, target_size

__all__ = ["eager_by_policy"]


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
