"""The module instances one compiled graph serves: graphs per set of parameter addresses.

Dynamo compiles the instances of one module class once and passes each instance's parameters
and buffers as inputs (regional compilation: each block of a model compiled on its own). A
piecewise runtime reads them in place, so a graph holds one instance's addresses. The runtime
keeps the graphs of each set of addresses it met (:class:`Instances`), captured at that set's
first call, and drops those of a set whose tensors were replaced (``p.data = ...``) or freed.

A backward graph reads in place its parameters and its forward's saved activations: its sets
are keyed by both, one per forward graph (instance and shape). Only the parameters and buffers
among them are watched for replacement: activations are freed after every backward by design.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Literal

__all__ = ["MAX_PARAM_SETS", "ParamSet", "Instances", "drop_entries"]

log = logging.getLogger(__name__)

#: The most sets of parameter addresses (module instances) one runtime keeps graphs for; past
#: it the least recently used one is dropped.
MAX_PARAM_SETS = 256


class ParamSet:
    """The graphs of one set of parameters and buffers: its id (the last item of its entries'
    keys), the addresses, weak references to the tensors, its routes and how many entries."""

    __slots__ = ("id", "ptrs", "refs", "routes", "entries")

    def __init__(self, id: int, ptrs: list[int | None], refs: list[tuple[int, Any]]) -> None:
        self.id = id
        self.ptrs = ptrs
        self.refs = refs
        self.routes: dict[Any, Any] = {}
        self.entries = 0


class Instances:
    """The sets of parameters and buffers of one runtime, the current one, most recent last.

    Args:
        statics: the positions of the inputs read in place (parameters and buffers; for a
            backward, its forward's saved activations too).
        name: the runtime's name, for messages.
        watched: which of those tensors are watched for being replaced or freed (default:
            all); the others (saved activations) only key the sets.
    """

    def __init__(
        self, statics: list[int], name: str, watched: Callable[[Any], bool] | None = None
    ) -> None:
        self.statics = statics
        self.name = name
        self.watched = watched
        self.sets: dict[tuple[int | None, ...], ParamSet] = {}
        self.current: ParamSet | None = None
        self._ids = 0

    def __len__(self) -> int:
        return len(self.sets)

    def add(self, args: tuple[Any, ...], ptrs: list[int | None]) -> ParamSet:
        """A new set for the tensors of ``args`` at ``ptrs``, made current."""
        watched = self.watched
        refs = [
            (i, weakref.ref(args[i])) for i in self.statics if watched is None or watched(args[i])
        ]
        made = ParamSet(self._ids, ptrs, refs)
        self._ids += 1
        self.sets[tuple(ptrs)] = made
        self.current = made
        return made

    def __contains__(self, ptrs: list[int | None]) -> bool:
        return tuple(ptrs) in self.sets

    def switch(
        self,
        args: tuple[Any, ...],
        ptrs: list[int | None],
        drop: Callable[[ParamSet, str], None],
    ) -> Literal["found", "new"]:
        """Make the set at ``ptrs`` current: ``"found"`` (its graphs exist) or ``"new"`` (made:
        capture its graphs). ``drop(set, why)`` drops a set's graphs: those whose tensors were
        replaced or freed, and past :data:`MAX_PARAM_SETS` the least recently used one."""
        key = tuple(ptrs)
        found = self.sets.pop(key, None)
        if found is not None:
            self.sets[key] = found  # the most recently used, last
            self.current = found
            return "found"
        gone = [s for s in self.sets.values() if not self._intact(s)]
        for s in gone:
            drop(s, "a parameter or buffer it read was replaced or freed")
            del self.sets[tuple(s.ptrs)]
        if gone:
            log.warning(
                "torchreplay: a parameter or buffer of '%s' is a new tensor since capture (it "
                "was replaced, not updated in place); capturing again", self.name,
            )
        elif len(self.sets) >= MAX_PARAM_SETS:
            oldest = next(iter(self.sets.values()))
            log.warning(
                "torchreplay: '%s' met %d sets of parameters and buffers (instances of one "
                "module class, or tensors that move); dropping the graphs of the least "
                "recently used one", self.name, len(self.sets),
            )
            drop(oldest, f"more than {MAX_PARAM_SETS} sets of parameters met")
            del self.sets[tuple(oldest.ptrs)]
        elif self.sets:
            log.info(
                "torchreplay: '%s' is called with %s (Dynamo compiled the module's class once); "
                "capturing its graphs, %d set(s) so far", self.name,
                "the parameters and buffers of another instance" if self.watched is None else
                "the parameters or saved activations of another forward graph (another "
                "instance or shape)", len(self.sets) + 1,
            )
        self.add(args, ptrs)
        return "new"

    def _intact(self, s: ParamSet) -> bool:
        """Are the set's tensors alive and where they were at capture?"""
        for i, ref in s.refs:
            t = ref()
            if t is None or t.data_ptr() != s.ptrs[i]:
                return False
        return True

    def ptrs(self) -> set[int]:
        """Every address of every set."""
        return {p for s in self.sets.values() for p in s.ptrs if p is not None}


def drop_entries(
    entries: dict[tuple[Any, ...], Any],
    graphs: list[Any],
    set_id: int,
    why: str,
    keep: Callable[[Any], None] | None = None,
) -> None:
    """Remove the entries of set ``set_id`` (the last item of their keys) from ``entries``:
    the outputs they handed out raise when read, saying ``why``; their CUDA graphs are freed
    and removed from ``graphs``, but for one handed to ``keep`` (:meth:`Pool.keep
    <torchreplay.core.pool.Pool.keep>`: the pool's last graph must outlive the next capture)."""
    freed = set()
    for key in [k for k in entries if k[-1] == set_id]:
        entry = entries.pop(key)
        if entry.outputs is not None:
            entry.outputs.retire(why)
        freed.update(id(g.graph) for g in entry.graphs if g is not None and g.graph is not None)
    dropped = [g for g in graphs if id(g) in freed]
    if dropped and keep is not None:
        keep(dropped.pop())
    for g in dropped:
        g.reset()
    graphs[:] = [g for g in graphs if id(g) not in freed]
