"""Memory pools shared by graphs, the replay order that keeps them safe, and memory accounting.

Why order matters: graphs captured into one pool, in order g0, g1, ..., may place the memory of a
later graph's outputs where an earlier graph keeps its intermediates (freed at the end of that
earlier capture, so the allocator hands it out again). Replaying g_i can therefore overwrite the
outputs of every g_j captured after it (j > i), never those captured before it (their outputs
were still held when g_i was captured). A :class:`Pool` keeps the capture order and, before g_i
replays, marks the outputs that g_j (j >= i) handed out as stale, so they raise when read instead
of returning overwritten data. A graph that reports when it hands outputs out (:meth:`Pool.on_live`)
is only looked at while it has some; the others are looked at before every earlier replay. So a
chain of N callables graphed for training costs O(N) per step, not O(N^2).

When the last graph of a pool is dropped, the pool's memory goes back to the device at once
(:meth:`Pool.track`): its graphs are destroyed, the outputs they handed out are marked so that a
read raises instead of reading freed memory, and the allocator's cache is emptied once. torch's
own tool empties the cache at every capture instead; a serving process that re-captures (new
sizes, a reloaded model) would otherwise hold every dropped graph's pool.

Training adds data that lives between two replays: a forward graph's replay leaves its saved
activations for its backward graph. Graphs captured before that forward, or after that backward,
may use the same memory as scratch. A :class:`LiveWindow` records such data; any replay at a
position outside ``(start, end)`` marks it clobbered, and its reader raises instead of reading.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
import weakref
from typing import Any, Callable, Protocol, Sequence

import torch

from torchreplay.distributed.agree import Refused
from torchreplay.distributed.collectives import groups_of
from torchreplay.distributed.watch import on_destroy
from torchreplay.errors import CaptureError

__all__ = ["Pool", "LiveWindow", "expect_capture", "release_with"]

log = logging.getLogger(__name__)


class _Member(Protocol):
    def invalidate_outputs(self) -> None: ...


class LiveWindow:
    """Data that the replay at position ``start`` leaves for the replay at ``end`` to read.

    Attributes:
        start, end: capture positions of the writer and the reader (``start < end``).
        name: the reader's name, for messages.
        clobbered_by: the name of the first graph whose replay may have overwritten the data
            (``None`` while it is intact).
    """

    __slots__ = ("start", "end", "name", "clobbered_by", "__weakref__")

    def __init__(self, start: int, end: int, name: str) -> None:
        self.start = start
        self.end = end
        self.name = name
        self.clobbered_by: str | None = None


class Pool:
    """A CUDA graph memory pool that several graphs can share.

    Pass the same ``Pool`` (or ``g.pool`` of an existing graph) as ``pool=`` to share memory
    between graphs that never run at the same time.

    Args:
        device: the CUDA device of the pool; default: the device of the first graph captured in it.

    Calls on several CUDA streams are ordered: a call on another stream than the pool's last
    call waits for what was queued on that one first (:meth:`on_stream`).
    """

    def __init__(self, device: torch.device | int | str | None = None) -> None:
        self.device: torch.device | None = _as_cuda_device(device) if device is not None else None
        self._handle: tuple[int, int] | None = None
        # Weak: a graph must be freed as soon as its owner drops it. A strong list would make
        # graph <-> pool a reference cycle, and the cyclic GC would then destroy CUDA graphs at
        # arbitrary moments - during another graph's capture, where that is illegal.
        self._members: list[weakref.ReferenceType[_Member]] = []
        # Positions of the members that do not report their outputs (see register): each replay
        # marks those after it stale. Those that do are in _live while they have outputs out.
        self._walked: list[int] = []
        self._live: set[int] = set()
        self._live_max = -1
        #: True once more than one graph was captured into this pool (a plain attribute: it is
        #: read on every replay).
        self.shared = False
        #: The CUDA stream the last call of a member ran on, as ``_compat.current_stream`` gives
        #: it (read on every call).
        self.stream: tuple[int, int, int] | None = None
        self._last_stream: torch.cuda.Stream | None = None
        self.index = self.device.index if self.device is not None else None
        _LIVE.add(self)
        # One live window per writer position: a new replay of the writer clobbers the old one.
        # Weak: a window whose reader was dropped (an autograd graph freed) needs no tracking.
        self._windows: dict[int, weakref.ReferenceType[LiveWindow]] = {}
        # The objects (Graphed, BucketedGraph, ...) whose graphs live in this pool, weakly.
        self._owners: list[weakref.ReferenceType[Any]] = []
        self._finalizers: dict[int, weakref.finalize] = {}  # by id(owner): see release
        # A dropped graph kept until the next capture into this pool (see keep)
        self._keeper: Any = None
        # Ids torch refused to capture into again, whose memory may still hold outputs (renew)
        self._retired: list[tuple[int, int]] = []

    @property
    def handle(self) -> tuple[int, int]:
        """The torch pool id (as returned by ``torch.cuda.graph_pool_handle()``)."""
        if self._handle is None:
            self._handle = torch.cuda.graph_pool_handle()
        return self._handle

    @classmethod
    def from_handle(cls, handle: tuple[int, int], device: torch.device | None = None) -> Pool:
        """Wrap a raw torch pool handle.

        .. warning::
            Only graphs that share the same ``Pool`` object are ordered against each other;
            graphs made by other tools in that raw pool are not.

        torch cannot capture into a pool id again once every graph captured into it is gone;
        then the pool takes a new id at its first capture (:meth:`renew`), sharing nothing.
        """
        pool = cls(device)
        pool._handle = tuple(handle)  # type: ignore[assignment]
        return pool

    def bind_device(self, device: torch.device) -> None:
        """Fix the pool's device at the first capture; refuse a graph on another device."""
        if self.device is None:
            self.device = device
            self.index = device.index if device.index is not None else torch.cuda.current_device()
        elif self.device != device:
            raise CaptureError(
                f"pool is on {self.device} but this graph's inputs are on {device}; "
                "graphs can share a pool only on one device: pass pool=None or a Pool per device"
            )

    def keep(self, graph: Any) -> None:
        """Hold ``graph`` (a torch CUDA graph being dropped) until the next capture into this
        pool has registered. torch's allocator forgets a pool once no graph refers to it, and a
        later capture into the same pool id then fails an internal assertion, which leaves
        torch's RNG state mid-capture (every later random op raises): dropping a module's last
        graphs and capturing it again (its parameters reallocated) must not get there."""
        self._keeper = graph

    @property
    def kept(self) -> Any:
        """The graph :meth:`keep` holds, if any."""
        return self._keeper

    def renew(self) -> None:
        """torch refused to begin a capture into this pool's id (every graph of it is gone, or
        a failed capture left the id marked as capturing): the next capture takes a new id.
        The old id's memory still counts as the pool's (:meth:`segment_ranges`) while graphs
        of it live; the capture order goes on (graphs of two ids never share memory, so
        marking across them is only cautious)."""
        if self._handle is not None:
            self._retired.append(self._handle)
        self._handle = None

    def _forget(self) -> None:
        """Start over with a new pool id (taken at the next capture) and no members."""
        self._handle = None
        self._retired = []
        self._members = []
        self._walked = []
        self._live = set()
        self._live_max = -1
        self.shared = False
        self._windows.clear()

    def register(self, member: _Member, *, reports: bool = False) -> int:
        """Add a graph in capture order; return its position. ``reports``: the member's outputs
        call :meth:`on_live` whenever they hand out tensors over the pool's memory, so a replay
        needs to mark them stale only while they have some out."""
        self._keeper = None  # the captured graph refers to the pool now
        self._members.append(weakref.ref(member))
        self.shared = len(self._members) > 1
        position = len(self._members) - 1
        if not reports:
            self._walked.append(position)
        return position

    def on_live(self, position: int) -> Callable[[], None]:
        """What the outputs of the member at ``position`` call when they hand out new tensors."""

        def live() -> None:
            self._live.add(position)
            if position > self._live_max:
                self._live_max = position

        return live

    def track(
        self,
        owner: Any,
        graphs: Sequence[Any],
        retire: Callable[[], None],
    ) -> None:
        """Release ``owner``'s graphs as soon as ``owner`` is garbage.

        Then ``retire()`` marks the outputs it handed out (so a read raises), each graph in
        ``graphs`` is destroyed at once (giving back its reference on the pool), and if no other
        tracked owner is alive the pool's memory goes back to the device (one
        ``torch.cuda.empty_cache()``) and the next capture gets a fresh pool handle (torch cannot
        capture into a pool id whose graphs were all released).

        Args:
            owner: the object whose lifetime the graphs share.
            graphs: its ``torch.cuda.CUDAGraph`` objects; a list may grow later (lazy capture).
            retire: marks the outputs that are still handed out.
        """
        self._owners.append(weakref.ref(owner))
        self._finalizers = {k: f for k, f in self._finalizers.items() if f.alive}
        self._finalizers[id(owner)] = weakref.finalize(owner, _release, weakref.ref(self), graphs, retire)

    def release(self, owner: Any) -> None:
        """Release ``owner``'s graphs now, as if it were garbage (see :meth:`track`)."""
        fin = self._finalizers.get(id(owner))
        held = fin.peek() if fin is not None else None
        if held is not None and held[0] is owner:
            fin()  # type: ignore[misc]

    def before_replay(self, position: int, reader: LiveWindow | None = None) -> None:
        """Mark stale the outputs of every graph captured after ``position``, and clobber the
        live windows that the replay at ``position`` may overwrite (all but ``reader``)."""
        members = self._members
        walked = self._walked
        if walked and walked[-1] > position:
            for p in walked[bisect.bisect_right(walked, position) :]:
                member = members[p]()
                if member is not None:
                    member.invalidate_outputs()
        if self._live_max > position:  # a reporting member after this one has outputs out
            live = self._live
            later = [p for p in live if p > position]
            live.difference_update(later)
            self._live_max = max(live, default=-1)
            for p in later:
                member = members[p]()
                if member is not None:
                    member.invalidate_outputs()
        if self._windows:
            self._clobber(position, reader)

    def on_stream(self, stream: tuple[int, int, int]) -> bool:
        """A member is called on ``stream`` (as ``_compat.current_stream`` gives it), not the
        one the pool's last call ran on. The GPU runs two streams' work in any order, so this
        call's copy-in and replay could overwrite buffers and pool memory that the last call's
        replay, or what its caller queued after it, still reads. The current stream waits for everything queued on the last one
        so far (one event); calls from then on are ordered by this stream. Each call compares
        the current stream with :attr:`stream` and calls this only when they differ.

        Returns True, changing nothing, when that stream is capturing a CUDA graph: the member
        is called inside another graph's capture (a graphed submodule of a model graphed
        whole), where a replay is not allowed; it runs its callable eagerly, into that capture,
        as eager code would be recorded. Captures run on streams of their own, and every
        capture of ours first makes each pool look again (:func:`expect_capture`)."""
        if not torch.cuda.is_available():  # graphs emulated on the CPU (tests): no streams
            self.stream = stream
            return False
        if _stream_capturing(self.index):
            return True
        self.stream = stream
        current = torch.cuda.current_stream(self.index)
        if self._last_stream is not None:
            current.wait_stream(self._last_stream)
        self._last_stream = current
        return False

    def open_window(self, start: int, end: int, name: str) -> LiveWindow:
        """Record that what the replay at ``start`` just left is needed by the replay at ``end``.

        The caller keeps the returned window with the reader (e.g. on the autograd node) and
        checks ``clobbered_by`` before the reader replays.
        """
        window = LiveWindow(start, end, name)
        self._windows[start] = weakref.ref(window)
        return window

    def awaits(self, start: int) -> bool:
        """Does a live window opened by the replay at ``start`` still await its reader (what
        that replay left is still needed, and nothing has overwritten it)?"""
        ref = self._windows.get(start)
        window = ref() if ref is not None else None
        return window is not None and window.clobbered_by is None

    def close_window(self, window: LiveWindow) -> None:
        """Stop tracking ``window`` (its reader has run)."""
        ref = self._windows.get(window.start)
        if ref is not None and ref() is window:
            del self._windows[window.start]

    def _clobber(self, position: int, reader: LiveWindow | None) -> None:
        doomed = []
        for start, ref in self._windows.items():
            window = ref()
            # Gone, or captured before the writer or after the reader: the writer's scratch
            # may lie where the window's data is.
            if window is None or (
                window is not reader and not window.start < position < window.end
            ):
                doomed.append((start, window))
        if not doomed:  # the common case: every window spans this replay
            return
        member = self._members[position]() if position < len(self._members) else None
        by = getattr(member, "name", None) or f"graph #{position} of the pool"
        for start, window in doomed:
            if window is not None:
                window.clobbered_by = by
            del self._windows[start]

    def reserved_bytes(self) -> int:
        """Bytes of device memory the allocator holds for this pool right now."""
        if (self._handle is None and not self._retired) or not torch.cuda.is_initialized():
            return 0
        return sum(seg["total_size"] for seg in self._segments())

    def segment_ranges(self) -> list[tuple[int, int]]:
        """Return the ``[start, end)`` address ranges of this pool's segments."""
        if self._handle is None and not self._retired:
            return []
        return [(seg["address"], seg["address"] + seg["total_size"]) for seg in self._segments()]

    def _segments(self) -> list[dict[str, Any]]:
        ids = {self._handle, *self._retired}
        return [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) in ids]

    def __repr__(self) -> str:
        retired = f", retired={self._retired}" if self._retired else ""  # (ids torch refused: renew)
        return f"Pool(device={self.device}, handle={self._handle}, graphs={len(self._members)}{retired})"


def _as_cuda_device(device: torch.device | int | str) -> torch.device:
    d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def _stream_capturing(index: int) -> bool:
    """Is the current stream of CUDA device ``index`` capturing a graph?"""
    if torch.cuda.current_device() == index:
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(index):
        return torch.cuda.is_current_stream_capturing()


#: Every pool alive, for :func:`expect_capture`.
_LIVE: weakref.WeakSet[Pool] = weakref.WeakSet()


def expect_capture() -> None:
    """A capture of ours begins: every live pool's next call compares its stream again
    (:meth:`Pool.on_stream`). A graph called inside the capture, on the capturing stream, would
    otherwise skip the check when a warm-up had called it on that stream already."""
    for pool in list(_LIVE):
        pool.stream = None


def _release(pool_ref: weakref.ReferenceType[Pool], graphs: Sequence[Any], retire: Callable[[], None]) -> None:
    """Finalizer of a pool's owner (see :meth:`Pool.track`). Runs while the owner is being
    destroyed, before its graphs would be; never raises.

    The cache is emptied twice: now, and at the end of the next cyclic collection
    (:func:`_after_collection`). An owner in a reference cycle is freed by the collector,
    which runs every finalizer of the collection before it frees any of the garbage: the
    pool's blocks are still allocated now (the owner's tensors go after), and the pool object
    itself, garbage too, is already out of reach of ``pool_ref``."""
    global _empty_after_collection
    with contextlib.suppress(Exception):
        retire()
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    with contextlib.suppress(Exception):
        if torch.cuda.is_current_stream_capturing():
            return  # destroying a graph or emptying the cache is illegal now: let them die later
    for g in list(graphs):
        with contextlib.suppress(Exception):
            g.reset()  # destroys the graph now and gives back its reference on the pool
    pool = pool_ref()
    if pool is not None:  # (None: the pool is garbage with its owner: no owner is left)
        pool._owners = [r for r in pool._owners if r() is not None]
        if pool._owners:
            return  # other graphs still use the pool's memory
        keeper, pool._keeper = pool._keeper, None
        with contextlib.suppress(Exception):
            if keeper is not None:
                keeper.reset()  # a dropped graph kept for a next capture there: none will come
        pool._forget()
    log.debug("torchreplay: the last graph of a pool was dropped; giving its memory back")
    _empty_after_collection = True
    with contextlib.suppress(Exception):
        torch.cuda.empty_cache()


#: Set when a pool's last owner went: the end of the next cyclic collection empties the cache
#: once more (see :func:`_release`).
_empty_after_collection = False


def _after_collection(phase: str, info: dict[str, int]) -> None:
    """``gc.callbacks`` hook: after a collection that may have freed a dropped pool's blocks,
    give them back. A flag test per collection otherwise; never while a stream captures (the
    collection ran inside another tool's capture: the next one will do)."""
    global _empty_after_collection
    if phase != "stop" or not _empty_after_collection:
        return
    if not torch.cuda.is_initialized():  # a forked child (a data loader's worker): not its CUDA
        _empty_after_collection = False
        return
    with contextlib.suppress(Exception):
        if torch.cuda.is_current_stream_capturing():
            return
        _empty_after_collection = False
        torch.cuda.empty_cache()


gc.callbacks.append(_after_collection)


def release_with(owner: Any, collectives: Sequence[Any], ranks: Any = None) -> None:
    """Release ``owner``'s graphs (from its ``pool``) when a process group of its captured
    ``collectives`` is destroyed: NCCL's destroy waits until every graph that holds one of its
    collectives is gone (see :func:`~torchreplay.distributed.watch.on_destroy`). ``ranks``, the
    owner's :class:`~torchreplay.distributed.Agreement` if any, then refuses every later call."""
    groups = groups_of(collectives)
    if not groups:
        return
    ranks_ref = weakref.ref(ranks) if ranks is not None else None

    def release(o: Any) -> None:
        agreement = ranks_ref() if ranks_ref is not None else None
        if agreement is not None:
            agreement.group_destroyed()
        elif hasattr(o, "_ranks"):  # no agreement (check=False): its calls raise from now on
            o._ranks = Refused(getattr(o, "name", type(o).__name__))
        pool = getattr(o, "pool", None)
        if pool is not None:
            pool.release(o)

    on_destroy(groups, owner, release)
