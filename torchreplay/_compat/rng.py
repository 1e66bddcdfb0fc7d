"""CUDA generators: their position, which one is which, and registering one with a graph."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = [
    "can_register_generators", "default_generator", "is_default", "position", "register_generator", "same_device",
    "same_generator",
]

#: ``(seed, offset)``: where a philox generator stands (``initial_seed``, ``get_offset``)
Position = tuple[int, int]


def can_register_generators() -> bool:
    """Does this torch let a graph draw from a generator other than the default one
    (``CUDAGraph.register_generator_state``, torch >= 2.4; absent from a CPU build)?"""
    return hasattr(torch.cuda.CUDAGraph, "register_generator_state")


def register_generator(graph: torch.cuda.CUDAGraph, gen: torch.Generator) -> None:
    """Register ``gen`` with ``graph`` before its capture begins: the capture's draws from it are
    then taken relative to where it stands at each replay, which moves it on by what the capture
    drew (what torch does for the device's default generator by itself)."""
    graph.register_generator_state(gen)


def position(gen: torch.Generator) -> Position:
    """Where the CUDA generator ``gen`` stands: its seed and its philox offset."""
    return gen.initial_seed(), gen.get_offset()


def default_generator(device: torch.device) -> torch.Generator | None:
    """``device``'s default CUDA generator (None off CUDA, or on a build without one)."""
    if device.type != "cuda":
        return None
    try:
        gen = torch.cuda.default_generators[device.index or 0]
        gen.get_offset()
    except (AttributeError, IndexError, RuntimeError):
        return None
    return gen


def same_device(a: torch.Generator, b: torch.Generator) -> bool:
    """Are the generators ``a`` and ``b`` on one device? ``torch.Generator(device="cuda")``
    reports ``cuda`` without an index (it is on the device current when it was made), a
    default generator ``cuda:0``: an index left out is taken as the current device's."""
    da, db = a.device, b.device
    if da.type != db.type:
        return False
    if da.index == db.index or da.type != "cuda":
        return True
    here = torch.cuda.current_device()
    return (here if da.index is None else da.index) == (here if db.index is None else db.index)


def is_default(gen: torch.Generator) -> bool:
    """Is ``gen`` its CUDA device's default generator (``torch.cuda.default_generators[i]``, the
    object torch keeps for it)? Torch registers that one with every graph by itself."""
    gens = torch.cuda.default_generators if gen.device.type == "cuda" else ()
    index = gen.device.index or 0
    return index < len(gens) and gens[index] is gen


def same_generator(a: Any, b: Any) -> bool:
    """Are ``a`` and ``b`` the same CUDA generator? A dispatch mode is handed a new Python object
    for the generator an op draws from at every op (the user's own object, or a default
    generator's, is not passed through), and ``torch.Generator`` has no identity to compare: the
    two are the same when moving one moves the other (moved by four, the philox step, and put
    back)."""
    if a is b:
        return True
    if not same_device(a, b) or position(a) != position(b):
        return False
    seed, offset = position(a)
    a.set_offset(offset + 4)
    try:
        return b.get_offset() == offset + 4
    finally:
        with contextlib.suppress(RuntimeError):
            a.set_offset(offset)
