"""The per-size records of a :class:`~torchreplay.sizes.bucketed.BucketedGraph`: a captured
size, and the route of a call size to it."""

from __future__ import annotations

from typing import Any, Callable

import torch

from torchreplay.core.outputs import Outputs

__all__ = ["SizeGraph", "Route"]


class SizeGraph:
    """One captured size: its graph and the external outputs (module state) it returned."""

    __slots__ = ("size", "graph", "externals", "seconds", "written")

    def __init__(
        self,
        size: int,
        graph: Any,
        externals: dict[int, torch.Tensor],
        seconds: float,
        written: tuple[int, ...] = (),
    ):
        self.size = size
        self.graph = graph
        self.externals = externals
        self.seconds = seconds
        self.written = written


class Route:
    """Everything a call of ``n`` rows needs, built the first time that size comes.

    ``dsts[i]``/``shapes[i]``: where leaf i is copied and the shape it must have (the leading
    ``n`` rows of a varying buffer, the whole buffer of a static one, None for a constant).
    """

    __slots__ = ("n", "size", "pad", "replay", "dsts", "shapes", "outputs", "clean_after")

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
