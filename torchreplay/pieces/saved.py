"""Saved activations: the outputs of a training forward's graphs that its backward reads in place.

A forward runtime (``guard_outputs``) leaves each replay's saved activations in its pool, where
the backward graph of that call reads them. While autograd holds them (until that backward has
run and let them go; a ``retain_graph=True`` backward keeps them for the next), a forward replay
that may overwrite them must not run: the call replays a copy of its graph instead (the same
shape, captured at the first such call, later in the pool: ``model(a) + model(b)``, a
contrastive loss, a discriminator on real then fake data all replay graphs), or with no room for
one (``max_graphs``) runs ungraphed, into fresh memory. A replay may overwrite what its own entry
and every entry captured after it in the pool handed out (:class:`~torchreplay.core.pool.Pool`).

Each entry is tracked on its own. With several module instances (regional compilation: one
compiled block class, one forward runtime, graphs per set of parameters), the forwards of blocks
1..N all replay before the backwards N..1: block k's activations await their backward while
block k+1's forward replays, which is safe because block k+1's graph was captured after block
k's (its replay cannot reach memory that block k's outputs held at its capture). Use counts
say when activations are let go; on a torch without them, a backward replay consumes the forward
entries it read, found by the addresses of its arguments.

The outputs the caller gets are watched the same way: an eager autograd node after the graph may
have saved one (a custom op's autograd after a graph break), and an entry captured later, at a
new shape (a mixture of experts: each layer's experts get their own token counts), lies where an
earlier entry's replay may write. Held by the caller alone (a Python reference), an output does
not block: it is marked stale as usual.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch

from torchreplay import _compat
from torchreplay.pieces.entries import Entry

__all__ = ["BLOCKED", "SavedActivations", "guarded", "saved_refs", "user_outputs"]

_Tensor = torch.Tensor

#: Why a forward runs without its graph while earlier calls' activations await their backward.
BLOCKED = (
    "the saved activations or outputs of earlier calls of this shape are still held (by their "
    "backward, or an eager op's that saved them, which has not run yet), and no other copy of "
    "this shape's graph can be captured (max_graphs graphs are, or sizes= share their input "
    "buffers): this call runs without its graph, into fresh memory (a larger max_graphs lets "
    "such calls replay)"
)


class SavedActivations:
    """Which forward entries' saved activations await their backward, and where they lie."""

    def __init__(self) -> None:
        #: entries whose last replay's activations await their backward, in replay order
        self.pending: list[Entry] = []
        self._at: dict[int, Entry] = {}  # a saved activation's storage address -> its entry
        # Every saved tensor's storage address and its entry: activations and the parameters
        # and buffers a forward passes through (they stay put; not every buffer is marked so)
        self._put: dict[int, Entry] = {}
        self._kept: set[int] = set()  # ids of the entries sealed and not dropped since
        #: bumped whenever entries come or go (a backward's cached forward entries are redone)
        self.generation = 0

    def sealed(self, entry: Entry, saved: Sequence[_Tensor], guarded: Sequence[_Tensor]) -> None:
        """``entry`` was captured; ``saved``: what its forward saves for its backward (they
        stay put); ``guarded``: those of them its replays overwrite (its activations: a
        backward that reads one consumed this entry's)."""
        for t in saved:
            self._put[t.untyped_storage().data_ptr()] = entry
        for t in guarded:
            self._at[t.untyped_storage().data_ptr()] = entry
        self._kept.add(id(entry))
        self.generation += 1

    def keep_only(self, entries: Sequence[Entry]) -> None:
        """Forget the entries not in ``entries`` (dropped with their graphs)."""
        live = {id(e) for e in entries}
        self._at = {p: e for p, e in self._at.items() if id(e) in live}
        self._put = {p: e for p, e in self._put.items() if id(e) in live}
        self.pending = [e for e in self.pending if id(e) in live]
        self._kept = live
        self.generation += 1

    def entries_of(self, args: Sequence[Any], idxs: Sequence[int]) -> list[weakref.ref[Entry]]:
        """The forward entries that saved, or passed through, the tensors ``args[i]`` for ``i``
        in ``idxs`` (weakly: a backward's set reads them, and must not keep a dropped one)."""
        found: list[weakref.ref[Entry]] = []
        for i in idxs:
            e = self._put.get(args[i].untyped_storage().data_ptr())
            if e is not None and all(r() is not e for r in found):
                found.append(weakref.ref(e))
        return found

    def keeps(self, entries: Sequence[weakref.ref[Entry]]) -> bool:
        """Are all of these forward entries still kept (none dropped with its graphs)? Not
        read from the addresses: a later entry of the same parameters takes theirs."""
        kept = self._kept
        return all((e := r()) is not None and id(e) in kept for r in entries)

    def holds(self, t: _Tensor) -> bool:
        """Is ``t`` (over) what a forward graph saved: an activation in its pool, or a
        parameter or buffer it passed through? Either stays put for the backward."""
        return t.untyped_storage().data_ptr() in self._put

    def replayed(self, entry: Entry, tainted: bool) -> None:
        """``entry`` replayed; ``tainted``: part of the call ran ungraphed (its activations
        are not all in the pool, and its backward will not replay)."""
        if entry in self.pending:
            self.pending.remove(entry)
        if not tainted:
            self.pending.append(entry)

    def blocks(self, entry: Entry) -> bool:
        """Would replaying ``entry`` overwrite activations that still await their backward?
        Entries whose activations are no longer held (their backward ran and autograd let them
        go, or their outputs were dropped) leave :attr:`pending` as they are met."""
        position = entry.position
        released: list[Entry] | None = None  # (made only when one is found: every call runs this)
        blocked = False
        for e in self.pending:
            if e.position >= position:
                if e.outputs is not None and e.outputs.held():
                    blocked = True
                    break
                if released is None:
                    released = []
                released.append(e)
        if released:
            gone = {id(e) for e in released}
            self.pending = [e for e in self.pending if id(e) not in gone]
        return blocked

    def read(self, reader: Entry, args: Sequence[Any]) -> None:
        """A backward graph (``reader``, of another runtime) replayed over ``args``. With use
        counts nothing changes here: the forward entries it read stay pending until autograd
        lets their activations go (:meth:`blocks`), which ``retain_graph=True`` delays until
        a second backward. Without them, the entries it read are taken as consumed now."""
        if _compat.HAS_USE_COUNTS:
            return
        feeds = reader.feeds
        if feeds is None or feeds[0] != self.generation:
            found: list[Entry] = []
            for a in args:
                if isinstance(a, _Tensor):
                    e = self._at.get(a.untyped_storage().data_ptr())
                    if e is not None and e not in found:
                        found.append(e)
            feeds = reader.feeds = (self.generation, found)
        for e in feeds[1]:
            if e in self.pending:
                self.pending.remove(e)



def saved_refs(entry: Entry, outputs: frozenset[int]) -> list[int]:
    """The indices into ``entry``'s pool outputs of the program ``outputs`` a forward saves for
    its backward: activations, and tensors passed through its graph that are not inputs read
    in place (those are the call's own: the runtime keeps them apart)."""
    return [ref for k, (kind, ref) in enumerate(entry.sources) if kind == "pool" and k in outputs]


def user_outputs(entry: Entry, outputs: frozenset[int]) -> frozenset[int]:
    """The indices into ``entry``'s pool outputs of the program outputs that are not saved
    activations (``outputs``): what the caller gets. An eager autograd node after the graph
    may save one for its backward (transformers' grouped-mm op after a graph break in HF
    Mixtral); a replay that may overwrite it must not run before that backward, like one that
    may overwrite a saved activation."""
    return frozenset(ref for k, (kind, ref) in enumerate(entry.sources) if kind == "pool" and k not in outputs)


def guarded(
    entry: Entry, pool_outs: Sequence[_Tensor], refs: Sequence[int], in_pool: Callable[[_Tensor], bool]
) -> frozenset[int]:
    """Which saved outputs (``refs``, :func:`saved_refs`) a replay overwrites: those in the
    pool or in a static input buffer (``entry.inputs`` before the replay loop fills it). Not a
    parameter or buffer the forward saves: it is the caller's own tensor, read in place and
    never written by a replay, and its use count (other references to it come and go) says
    nothing about the graph's memory."""
    if not refs:
        return frozenset()
    buffers = {b.untyped_storage().data_ptr() for b in entry.inputs if isinstance(b, _Tensor)}
    return frozenset(
        r for r in refs
        if in_pool(pool_outs[r]) or pool_outs[r].untyped_storage().data_ptr() in buffers
    )
