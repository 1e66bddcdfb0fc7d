"""The module instances one compiled graph serves: graphs per set of parameter addresses.

Dynamo compiles the instances of one module class once and passes each instance's parameters
and buffers as inputs (regional compilation: each block of a model compiled on its own). A
piecewise runtime reads them in place, so a graph holds one instance's addresses. The runtime
keeps the graphs of each set of addresses it met (:class:`Instances`), captured at that set's
first call, and drops those of a set whose tensors were replaced (``p.data = ...``) or freed.

A backward graph reads in place its parameters and its forward's saved activations: its sets
are keyed by both, one per forward graph (instance and shape). Only the parameters and buffers
among them are watched for replacement: activations are freed after every backward by design.

A set whose tensors were replaced, moved or freed is never replayed again, but its graphs go only
once nothing holds the outputs they handed out: FSDP frees a block's unsharded parameters right
after its forward, while that forward's output is the next block's input. Parameters that keep
moving (FSDP's resharding reallocates them around every call, so their graphs would never
replay) stop being captured after :data:`MAX_MOVES` moves in a row whose graphs never replayed:
those calls run without graphs. A move after graphs that did replay (weights swapped in now and
then by ``p.data = ...``) starts the count again: such a model keeps its graphs. Only replays for
the set's own tensors count: where another module's parameters sit at a set's addresses (FSDP2
allocates one block's where the last one's were just freed), the set is found and its graphs
replay for them, which says nothing of the set's own tensors. (The runtime calls
:meth:`Instances.switch` for that too, though the addresses are the same: it compares one
watched tensor's identity as well as the addresses.)

A call whose set is not the current one is looked up first by the address of its first tensor
read in place (:meth:`Instances.find`: the blocks of a model compiled block by block switch at
every call, 24 times a training step of 12 blocks); only what that does not find (other
tensors at a set's addresses, moved tensors, a new set) builds the key of every address.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Literal

from torchreplay import _compat

__all__ = [
    "MAX_PARAM_SETS", "MAX_MOVES", "MOVING", "ParamSet", "Instances", "drop_entries",
    "outputs_held", "ptrs_of",
]

log = logging.getLogger(__name__)

#: The most sets of parameter addresses (module instances) one runtime keeps graphs for; past
#: it the least recently used one is dropped.
MAX_PARAM_SETS = 256

#: How many times in a row one parameter or buffer (the same tensor object) may be found at
#: another address than graphs read that never replayed after the call that captured them,
#: before the sets that read it are no longer captured.
MAX_MOVES = 2
#: Why a call whose parameters keep moving runs without graphs (a fallback reason).
MOVING = (
    "a parameter or buffer it reads in place moves to new memory between calls (FSDP's "
    "resharding, or a tensor reallocated or replaced every call), so its graphs would never "
    "replay; these calls run without graphs"
)


class ParamSet:
    """The graphs of one set of parameters and buffers: its id (the last item of its entries'
    keys), the addresses, weak references to the tensors, its routes and how many entries."""

    __slots__ = ("id", "ptrs", "key", "refs", "feeds", "routes", "entries", "replayed", "own")

    def __init__(self, id: int, ptrs: list[int | None], refs: list[tuple[int, Any]]) -> None:
        self.id = id
        self.ptrs = ptrs
        self.key = tuple(ptrs)
        self.refs = refs
        #: a backward's: what :attr:`Instances.feeds` says of the forward graphs it reads
        self.feeds: Any = None
        self.routes: dict[Any, Any] = {}
        self.entries = 0
        #: its graphs replayed, for its own tensors, in a call after the one that captured
        #: them (they paid off)
        self.replayed = False
        #: it is current for its own tensors, not for others found at its addresses (FSDP2
        #: allocates one block's parameters where another's were just freed): their replays
        #: say nothing of whether its own tensors' graphs pay off
        self.own = True


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
        self.current: ParamSet | None = None  # None after a "moving" call
        self._owner: tuple[int, int] | None = None  # (position, id) of a tensor of the call's set
        # the sets by the address of their first tensor read in place (:meth:`find`)
        self._by_first: dict[int | None, list[ParamSet]] = {}
        #: a backward's: the forward's saved activations (:class:`~.saved.SavedActivations`).
        #: A backward's set also goes once a forward graph it reads was dropped (its
        #: parameters replaced): where AOT autograd passes a backward its parameters as new
        #: tensors (torch 2.13's ``aot_autograd`` does, on CPU), none of them is watched.
        self.feeds: Any = None
        #: sets no longer used whose graphs wait until nothing holds their outputs
        self.pending: list[ParamSet] = []
        self._ids = 0
        # id(tensor) -> (a weak reference to it, how often it was found moved)
        self._moves: dict[int, tuple[Any, int]] = {}
        self._told = False

    def __len__(self) -> int:
        return len(self.sets)

    def add(self, args: tuple[Any, ...], ptrs: list[int | None]) -> ParamSet:
        """A new set for the tensors of ``args`` at ``ptrs``, made current."""
        made = ParamSet(self._ids, ptrs, [(i, weakref.ref(args[i])) for i in self._watched(args)])
        if self.feeds is not None:
            made.feeds = self.feeds.entries_of(args, self.statics)
        self._ids += 1
        self.sets[made.key] = made
        self._by_first.setdefault(ptrs[self.statics[0]], []).append(made)
        self._make_current(made, args)
        return made

    def find(self, args: tuple[Any, ...], replayed: bool = False) -> ParamSet | None:
        """Make current, and return, the set of the call's own tensors at these addresses, found
        by the address of the first tensor read in place: one dict look-up, the identity of the
        watched tensors, one C++ comparison of the addresses, no key built. This is the common
        switch, between the blocks of a model compiled block by block (one runtime for them all:
        24 switches a training step of 12 blocks). None: no set holds exactly these tensors at
        these addresses; :meth:`switch` looks further (other tensors at a set's addresses,
        tensors that moved or were replaced, a new set). ``replayed``: as for :meth:`switch`."""
        for s in self._by_first.get(args[self.statics[0]].data_ptr(), ()):
            if all(ref() is args[i] for i, ref in s.refs) and _compat.data_ptrs_equal(
                list(args), s.ptrs, self.statics
            ):
                if replayed and self.current is not None and self.current.own:
                    self.current.replayed = True
                self._to_front(s, args)
                s.own = True
                return s
        return None

    def _to_front(self, s: ParamSet, args: tuple[Any, ...]) -> None:
        """Make ``s`` current and the most recently used (last)."""
        self.sets[s.key] = self.sets.pop(s.key)
        self._make_current(s, args)

    def _remove(self, s: ParamSet) -> None:
        del self.sets[s.key]
        first = s.ptrs[self.statics[0]]
        same = self._by_first.get(first, [])
        if s in same:
            same.remove(s)
            if not same:
                del self._by_first[first]

    def unchanged(self, args: tuple[Any, ...]) -> bool:
        """Is the current set the call's: its addresses (one C++ comparison), and its first
        watched tensor the one the call that made it current passed? FSDP2 gathers one block's
        parameters where another's were just freed: the same addresses, another tensor, so a
        switch tells the set those replays are not its own (:attr:`ParamSet.own`)."""
        current, owner = self.current, self._owner
        return current is not None and (owner is None or id(args[owner[0]]) == owner[1]) and (
            _compat.data_ptrs_equal(list(args), current.ptrs, self.statics))

    def _make_current(self, s: ParamSet, args: tuple[Any, ...]) -> None:
        self.current = s
        self._owner = (s.refs[0][0], id(args[s.refs[0][0]])) if s.refs else None

    def forget_entries(self) -> None:
        """Every set's entries were dropped: none has routes or entries now."""
        for s in self.sets.values():
            s.routes.clear()
            s.entries = 0

    def __contains__(self, ptrs: list[int | None]) -> bool:
        return tuple(ptrs) in self.sets

    def switch(
        self,
        args: tuple[Any, ...],
        ptrs: list[int | None],
        drop: Callable[[ParamSet, str], None],
        held: Callable[[ParamSet], bool] | None = None,
        replayed: bool = False,
    ) -> Literal["found", "new", "moving"]:
        """Make the set at ``ptrs`` current: ``"found"`` (its graphs exist), ``"new"`` (made:
        capture its graphs) or ``"moving"`` (none made: a tensor of ``args`` keeps moving, run
        this call without graphs). Sets whose tensors were replaced, moved or freed, and past
        :data:`MAX_PARAM_SETS` the least recently used one, are no longer used; ``drop(set,
        why)`` drops their graphs once ``held(set)`` says nothing holds their outputs.
        ``replayed``: the current set's graphs replayed since it became current, in a call
        other than the one that captured them."""
        if replayed and self.current is not None and self.current.own:
            self.current.replayed = True
        found = self.sets.get(tuple(ptrs))
        if found is not None:
            self._to_front(found, args)
            found.own = all(ref() is args[i] for i, ref in found.refs)
            return "found"
        moved: dict[int, Any] = {}  # a tensor that several sets read moved once
        settled: set[int] = set()  # ... and one whose graphs replayed starts counting again
        gone = [s for s in self.sets.values() if not self._intact(s, moved, settled)]
        self._count_moves(moved, settled)
        if gone and not self._told:
            self._told = True
            log.warning(
                "torchreplay: a parameter or buffer of '%s' is a new tensor or at a new address "
                "since capture (replaced or reallocated, not updated in place); capturing again",
                self.name,
            )
        elif not gone and len(self.sets) >= MAX_PARAM_SETS:
            log.warning(
                "torchreplay: '%s' met %d sets of parameters and buffers (instances of one "
                "module class, or tensors that move); dropping the graphs of the least "
                "recently used one", self.name, len(self.sets),
            )
            gone = [next(iter(self.sets.values()))]
        for s in gone:
            self._remove(s)
        self.pending += gone
        self.release(drop, held)
        if self._moving(args):
            self.current = None
            return "moving"
        if self.sets:
            log.info(
                "torchreplay: '%s' is called with %s (Dynamo compiled the module's class once); "
                "capturing its graphs, %d set(s) so far", self.name,
                "the parameters and buffers of another instance" if self.watched is None else
                "the parameters or saved activations of another forward graph (another "
                "instance or shape)", len(self.sets) + 1,
            )
        self.add(args, ptrs)
        return "new"

    def release(
        self, drop: Callable[[ParamSet, str], None], held: Callable[[ParamSet], bool] | None
    ) -> None:
        """Drop the graphs of the sets no longer used whose outputs nobody holds."""
        kept = []
        for s in self.pending:
            if held is not None and held(s):
                kept.append(s)
            else:
                drop(s, "a parameter or buffer it read was replaced, moved or freed")
        self.pending = kept

    def _watched(self, args: tuple[Any, ...]) -> list[int]:
        watched = self.watched
        return [i for i in self.statics if watched is None or watched(args[i])]

    def _intact(self, s: ParamSet, moved: dict[int, Any], settled: set[int]) -> bool:
        """Are the set's tensors alive and where they were at capture? A live one found
        elsewhere is put in ``moved``, and in ``settled`` too where the set's graphs replayed.
        A backward's set is not, once a forward graph it reads was dropped."""
        intact = s.feeds is None or self.feeds.keeps(s.feeds)
        for i, ref in s.refs:
            t = ref()
            if t is None:
                intact = False
            elif _address(t) != s.ptrs[i]:
                intact = False
                moved[id(t)] = ref
                if s.replayed:
                    settled.add(id(t))
        return intact

    def _count_moves(self, moved: dict[int, Any], settled: set[int] = frozenset()) -> None:
        """Count each tensor of ``moved`` once more, but those in ``settled`` (their graphs
        paid off: a weight swapped in now and then) start again from nothing."""
        moves = self._moves
        for key, ref in moved.items():
            seen = moves.get(key)
            again = seen is not None and seen[0]() is ref()
            moves[key] = (ref, 0 if key in settled else seen[1] + 1 if again else 1)
        if len(moves) > 4 * MAX_PARAM_SETS:
            self._moves = {k: v for k, v in moves.items() if v[0]() is not None}

    def _moving(self, args: tuple[Any, ...]) -> bool:
        """Has a tensor of ``args`` read in place moved :data:`MAX_MOVES` times already?"""
        moves = self._moves
        if not moves:
            return False
        for i in self._watched(args):
            seen = moves.get(id(args[i]))
            if seen is not None and seen[1] >= MAX_MOVES and seen[0]() is args[i]:
                return True
        return False

    def live(self) -> set[int]:
        """The addresses of every watched tensor of every set that is still alive (not of those
        freed: a dropped model's memory goes to the next one, while Dynamo's cache still holds
        the dropped one's graphs)."""
        return {_address(t) for s in self.sets.values() for _, ref in s.refs if (t := ref()) is not None}


def ptrs_of(args: tuple[Any, ...], in_place: list[int]) -> list[int | None]:
    """The addresses of the inputs read in place (``None`` for the others): a set's key."""
    ptrs: list[int | None] = [None] * len(args)
    for i in in_place:
        ptrs[i] = args[i].data_ptr()
    return ptrs


def _address(t: Any) -> int:
    """``t.data_ptr()``, or 0 where its storage was freed (resized to nothing, as FSDP does with
    the unsharded parameters): ``data_ptr()`` raises then."""
    storage = t.untyped_storage()
    return storage.data_ptr() + t.storage_offset() * t.element_size() if storage.nbytes() else 0


def outputs_held(entries: dict[tuple[Any, ...], Any], set_id: int) -> bool:
    """Does anyone hold an output that an entry of set ``set_id`` handed out?"""
    return any(
        e.outputs is not None and e.outputs.in_use() for k, e in entries.items() if k[-1] == set_id
    )


def drop_entries(
    entries: dict[tuple[Any, ...], Any],
    graphs: list[Any],
    set_id: int | None,
    why: str,
    keep: Callable[[Any], None] | None = None,
) -> None:
    """Remove the entries of set ``set_id`` (the last item of their keys; ``None``: every
    entry) from ``entries``:
    the outputs they handed out raise when read, saying ``why``; their CUDA graphs are freed
    and removed from ``graphs``, but for one handed to ``keep`` (:meth:`Pool.keep
    <torchreplay.core.pool.Pool.keep>`: the pool's last graph must outlive the next capture)."""
    freed = set()
    for key in [k for k in entries if set_id is None or k[-1] == set_id]:
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
