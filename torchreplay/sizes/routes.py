"""The per-size records of a :class:`~torchreplay.sizes.bucketed.BucketedGraph`: a captured
size, and the route of a call size to it."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from torchreplay.core.outputs import Outputs
from torchreplay.sizes.plan import format_sizes

__all__ = ["SizeGraph", "Route", "copy_targets", "log_summary", "retire_routes", "route_views"]

log = logging.getLogger("torchreplay.sizes.bucketed")


class SizeGraph:
    """One captured size: its graph and the external outputs (module state) it returned."""

    __slots__ = ("size", "graph", "externals", "seconds", "written", "copies", "spares")

    def __init__(
        self,
        size: int,
        graph: Any,
        externals: dict[int, torch.Tensor],
        seconds: float,
        written: tuple[int, ...] = (),
        copies: dict[int, Any] | None = None,
        spares: tuple[torch.Tensor, ...] = (),
    ):
        self.size = size
        self.graph = graph
        self.externals = externals
        self.seconds = seconds
        self.written = written
        #: slot position -> the graph's own copy into that argument's buffer (_compat/copy_nodes.py)
        self.copies = copies or {}
        self.spares = spares  # (copies not found: written at every replay, kept with the graph)


def copy_targets(inputs: Any, dims: Any, s: int, largest: int) -> dict[int, torch.Tensor]:
    """What the graph of size ``s`` copies in itself (_compat/copy_nodes.py), by slot position:
    each tensor argument's buffer, its leading ``s`` rows where it varies; none unless every one
    can be (``Inputs.copied_by_graph``) and varies, if at all, along its first dimension, whose
    rows are a prefix of its bytes: a call copies its ``n`` rows, and the padding stays."""
    statics = inputs.copied_by_graph()
    slots = [i for i, slot in enumerate(inputs.slots) if slot.static is not None and not slot.adopted]
    if not statics or any(dims[i] not in (None, 0) for i in slots):
        return {}
    return {i: t if dims[i] is None or s == largest else t.narrow(0, 0, s) for i, t in zip(slots, statics)}


def route_views(slots: Any, dims: Any, n: int, largest: int) -> list[torch.Tensor | None]:
    """What a call of ``n`` rows copies into, per argument slot: its static buffer, narrowed to
    ``n`` rows along its varying dimension (``dims[i]``), or ``None`` for a constant."""
    return [
        None if slot.static is None
        else slot.static if d is None or n == largest else slot.static.narrow(d, 0, n)
        for slot, d in zip(slots, dims)
    ]


class Route:
    """Everything a call of ``n`` rows needs, built the first time that size comes.

    ``dsts[i]``/``shapes[i]``: where leaf i is copied and the shape it must have (the leading
    ``n`` rows of a varying buffer, the whole buffer of a static one, None for a constant).
    """

    __slots__ = ("n", "size", "pad", "replay", "dsts", "shapes", "outputs", "clean_after", "nodes")

    def __init__(
        self,
        n: int,
        size: int,
        replay: Callable[[], None],
        dsts: list[torch.Tensor | None],
        shapes: list[torch.Size | None],
        outputs: Outputs,
        clean_after: int,
    ) -> None:
        self.n = n
        self.size = size
        self.pad = size - n
        self.replay = replay
        self.dsts = dsts
        self.shapes = shapes
        self.outputs = outputs
        self.clean_after = clean_after
        #: per slot, the size's graph's copy node and the bytes of this call's rows (or None)
        self.nodes: list[tuple[Any, int] | None] = [None] * len(dsts)


def log_summary(graph: Any) -> None:
    """Log what a BucketedGraph captured (at INFO)."""
    if not log.isEnabledFor(logging.INFO):
        return  # reserved_bytes() walks the allocator's segments: only when it is logged
    lazy = graph.options.capture == "lazy"
    log.info(
        "torchreplay: captured '%s' at %s on %s in %.2f s%s; pool %.1f MiB, buffers %.1f MiB "
        "(outputs=%s)",
        graph.name,
        f"its largest size {graph._max}" if lazy else f"{len(graph.sizes)} sizes "
        f"({format_sizes(graph.sizes)})",
        graph.device,
        graph.stats.capture_seconds,
        "; the other sizes are captured on first use (capture='lazy')" if lazy else "",
        graph.pool.reserved_bytes() / 2**20,
        graph.buffer_bytes / 2**20,
        graph.config.outputs,
    )


def retire_routes(routes: list[Route | None], wide: dict[tuple[int, int], Route]) -> None:
    """The graph is being destroyed: outputs handed out by any size raise when read."""
    for route in [*routes, *wide.values()]:
        if route is not None:
            route.outputs.retire()
