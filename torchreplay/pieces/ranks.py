"""The ranks' agreement before a piecewise replay, for both front ends (breakable graphs and the
``torch.compile`` backend): which size every rank replays, or that every rank runs eagerly."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from torchreplay.core.padding import run_padded
from torchreplay.distributed import EAGER, GRAPH, Agreement
from torchreplay.pieces.runtime import PiecewiseRuntime

__all__ = ["agree_size", "run_eagerly_at"]


def agree_size(
    ranks: Agreement, rt: PiecewiseRuntime, leaves: Sequence[Any], mode_changed: bool = False
) -> tuple[int | None, int | None]:
    """Post this call to the other ranks; return the size to replay (``None``: the call's
    own; -1: every rank runs eagerly) and, with ``sync_sizes``, the rows every rank runs (the
    largest call of any rank). With ``sync_sizes`` the size is the one that holds those rows,
    else each rank's own, which must be equal (or all raise)."""
    n = rt.rows(leaves)
    if mode_changed:
        ranks(0, EAGER)
        return None, None
    if ranks.sync_sizes:
        agreed = ranks(n or 0, GRAPH)
        size = rt._bucket(agreed)
        return (-1 if size == -1 or agreed == 0 else size), agreed
    own = rt._bucket(n)
    eager = own == -1 or n == 0
    ranks(0 if eager or own is None else own, EAGER if eager else GRAPH)
    return None, None


def run_eagerly_at(
    rt: PiecewiseRuntime, call: Callable[[list[Any]], Sequence[Any]], leaves: Sequence[Any],
    rows: int | None,
) -> list[Any]:
    """``call`` on the program's flat inputs, without graphs, at the agreed ``rows``: a call
    with fewer rows is padded (its fill values, as a replay pads), so that every rank launches
    its collectives with the same shapes (see :func:`~torchreplay.core.padding.run_padded`)."""
    n = rt.rows(leaves)
    if rows is None or n is None or rows == n:
        return list(call(list(leaves)))
    inputs = rt.program.inputs
    return run_padded(
        call, leaves, n, rows,
        dims=[x.dim if x.kind == "tensor" else None for x in inputs],
        fills=[x.fill for x in inputs],
        out_dims=[() if d is None else (d,) for d in rt.program.output_dims],
        sizes=[x.kind == "int" and x.is_size for x in inputs],
    )
