"""One piece of a program captured for real, inside a first call's capture of a size.

The values the piece writes are put back before each warm-up (:func:`~.putback.reset_copies`),
so a sum it adds does not compound; the warm-ups run one at the piece's first capture, one at
each later size (as cudagraph trees do). A piece that fails to capture runs ungraphed from
then on, with a warning (``strict``: the error). After its capture it replays once, so that its
outputs hold real values for the steps that follow, and what it writes into values an eager
step made is copied there.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from torchreplay import _compat
from torchreplay.core.capture import capture
from torchreplay.core.io import MAX_COPY_NODES, graph_copyable
from torchreplay.errors import CaptureError
from torchreplay.pieces.entries import PieceGraph
from torchreplay.pieces.handoff import graph_reads
from torchreplay.pieces.putback import reset_copies

__all__ = ["capture_piece"]

log = logging.getLogger("torchreplay.pieces.runtime")  # (its warnings are the runtime's)

_Tensor = torch.Tensor


def capture_piece(
    rt: Any, k: int, vals: list[Any], inputs: dict[int, _Tensor] | None = None,
    handing: dict[int, frozenset[int]] | None = None,
) -> tuple[PieceGraph | None, Any]:
    """Capture piece ``k`` of ``rt`` (a :class:`~torchreplay.pieces.runtime.PiecewiseRuntime`)
    on the slot values ``vals``; return its graph and outputs, or ``(None, None)`` when it
    failed to capture (it runs ungraphed from then on; ``strict``: raise). ``inputs``: the
    first piece's, the static buffers of the call's tensors (by input index), which its graph
    copies in itself where it can (_compat/copy_nodes.py), as it does the values of eager
    steps a later piece reads; ``handing``: the eager steps before it that hand their outputs
    off at this key (:mod:`.handoff`), with their slots."""
    piece = rt._pieces[k]
    made = list(vals)  # the values as eager steps made them (before the copies below)
    handed = {w for ws in (handing or {}).values() for w in ws}
    copies, written = graph_reads(piece, vals, rt._inputs, rt._from_eager, handed, rt._alloc)
    # What the graph copies in by its own first nodes: the call's inputs (all or none: one
    # launch left costs what the nodes save), or the plain buffers of eager steps' values.
    targets = dict(inputs) if inputs and graph_copyable(list(inputs.values())) else {}
    by_node = [(pos, buf) for pos, buf in copies if type(buf) is _Tensor and graph_copyable([buf])]
    by_node = by_node[: 0 if targets else MAX_COPY_NODES]
    initial = reset_copies(rt, [(piece.reads[pos], vals[pos]) for pos in sorted(written)])
    backs = [(pos, buf) for pos, buf in copies if pos in written and isinstance(buf, _Tensor)]

    def reset() -> None:
        for v, init in initial:
            _compat.copy_back(v, init)

    try:
        captured = capture(
            piece.fn,
            tuple(vals),
            {},
            device=rt.device,  # type: ignore[arg-type]
            stream=rt._stream,
            pool=rt.pool,  # type: ignore[arg-type]
            config=rt.config if k not in rt._warmed else dataclasses.replace(
                rt.config, num_warmup_iters=min(1, rt.config.num_warmup_iters)),
            sync=k not in rt._warmed,  # _capture_batch syncs once after the sizes
            grad=torch.is_grad_enabled(), reset=reset if initial else None, collectives=False,
            find_generators=False,  # (core/capture.py: no watch; such a piece runs eagerly)
            copy_in=list(targets.values()) + [buf for _, buf in by_node],
        )
    except CaptureError as exc:
        reset()  # the piece runs ungraphed next, from the call's state
        if rt.strict:
            raise CaptureError(f"'{rt.name}' {piece.name}: {exc} (strict=True)") from exc
        rt._graphable[k] = False
        rt.failures[k] = str(exc)
        # Its outputs are an eager step's from now on: a graph after it copies them in. Read
        # where they are, they were this call's temporaries, freed and reused at the next
        # call (HF Mixtral compiled with float32 experts: a wrong result, silently).
        rt._from_eager.update(piece.writes)
        log.warning(
            "torchreplay: '%s' %s could not be captured and runs compiled but without a CUDA "
            "graph (counted in stats.fallbacks; strict=True raises instead): %s",
            rt.name, piece.name, exc,
        )
        return None, None
    rt._graphs.append(captured.graph)
    rt._warmed.add(k)
    reset()
    if k < len(rt._pieces) - 1:  # real values in its outputs, for the steps that follow
        captured.graph.replay()
        with torch.no_grad():
            for pos, buf in backs:
                made[pos].copy_(buf)
    rt.stats.captures += 1
    rt.stats.capture_seconds += captured.seconds
    found = list(captured.copies)  # (none when the driver did not show them: copied by launches)
    ins = dict(zip(targets, found[: len(targets)]))
    nodes = dict(zip((pos for pos, _ in by_node), found[len(targets):]))
    rt.stats.graph_copies = max(rt.stats.graph_copies, len(ins))
    graph = PieceGraph(captured.graph, captured.out, copies, backs, nodes, ins, captured.spares)
    return graph, captured.out
