"""Ranks agree on what they replay, before they replay it, or all raise.

A graph that holds NCCL collectives must be replayed by every rank of its group at the same time:
a rank that replays another size, runs the call eagerly, or does not call at all leaves the others
blocked inside NCCL, with no error until a watchdog kills the job. Before each replay every rank
posts three numbers (its call's size, the fingerprint of what it captured, graph or eager) and
reads everybody's:

- with ``sync_sizes``, the largest size posted is the size every rank replays (padding its own
  rows up to it), so ranks with different local batches launch the same graph;
- any other difference (fingerprints, eager on one rank and a graph on another, another size
  without ``sync_sizes``) raises :class:`~torchreplay.ReplayInputError` on every rank, naming
  each rank's choice, before anything is launched;
- a rank that does not come within ``timeout`` seconds (it skipped the call, stopped, or is stuck
  before it) makes the waiting ranks raise, naming the graph, the call and the missing ranks.

The exchange runs on the host, outside the graph, and needs no GPU synchronisation. Ranks on one
host share a small memory-mapped file (a few us per call); across hosts it goes through the
process group's store (a network round trip). The file is made and mapped at capture, when every
rank is there anyway, through the same store, then unlinked (nothing is left in ``/dev/shm``).
"""

from __future__ import annotations

import contextlib
import datetime
import mmap
import os
import platform
import secrets
import socket
import tempfile
import time
from typing import Any, Callable, Iterator, Sequence

import torch.distributed as dist

try:
    import fcntl
except ImportError:  # no flock (Windows): the rare give-up race of the module docstring stays
    fcntl = None  # type: ignore[assignment]

from torchreplay import _compat
from torchreplay.distributed.watch import watch
from torchreplay.errors import ReplayInputError

__all__ = ["Agreement", "Refused", "open_exchange", "Exchange", "GRAPH", "EAGER", "ABSENT"]

#: What a rank is about to run, posted with its fingerprint.
GRAPH, EAGER = 0, 1
#: Posted by a rank that gave up waiting, so that a rank coming late raises instead of replaying.
ABSENT = -1

_FIELDS = 8  # int64 per slot: seq, size, fingerprint, choice, checksum, post time, padding
_MASK = (1 << 63) - 1
_now_ns = time.monotonic_ns  # the system-wide monotonic clock: comparable across processes
#: CPUs whose stores and loads stay in program order for another core (total store order)
_TSO = ("x86_64", "amd64", "i386", "i686", "x86")


def _checksum(seq: int, a: int, b: int, c: int) -> int:
    """A 63-bit mix of a post (odd multipliers: any one value changed changes it)."""
    return (
        seq * 0x9E3779B97F4A7C15 + a * 0xC2B2AE3D27D4EB4F + b * 0x165667B19E3779F9
        + c * 0x27D4EB2F165667C5
    ) & _MASK


class Exchange:
    """Every rank posts ``values`` (three ints) for call ``seq`` and gets everybody's back."""

    size: int = 1  #: ranks in the group
    me: int = 0  #: this rank's position in the group
    kind: str = "local"

    def __call__(self, seq: int, values: Sequence[int], timeout: float) -> list[tuple[int, ...]]:
        return [tuple(values)]

    def missing(self, seq: int) -> list[int]:
        """Positions of the ranks that have not posted call ``seq``."""
        return []

    def last(self, rank: int) -> tuple[int, ...] | None:
        """What the rank at position ``rank`` posted last, ``(seq, size, fingerprint, choice)``,
        without waiting; ``None`` where that cannot be read without waiting (the store)."""
        return None

    def close(self) -> None:
        pass


class SharedExchange(Exchange):
    """Ranks of one host: one slot pair per rank in a shared mapping; a rank writes its values,
    then the call number (the reader's signal). x86 keeps stores (and loads) in order, so a
    reader that sees the number sees the values. Elsewhere (ARM hosts such as Grace) a
    checksum of the number and values is written before the number, and a reader takes a slot
    only when it matches what it read: a half-seen post reads as not there yet, never as stale
    values (``checked``; about 0.5 us more per rank and call). Two slots per rank (by the
    parity of the call), so a rank that is one call ahead never overwrites what a slower rank
    is still reading; it cannot get two ahead, since that needs the slow rank's next post."""

    kind = "shared memory"

    def __init__(
        self, mm: mmap.mmap, size: int, me: int, checked: bool | None = None, lock_fd: int = -1
    ) -> None:
        self._mm = mm
        self._mv = memoryview(mm).cast("q")
        self.size = size
        self.me = me
        self.checked = platform.machine().lower() not in _TSO if checked is None else checked
        self._fd = lock_fd
        self._timeout = -1.0
        self._late_ns = 0  # a call decided this long after its earliest post takes the lock

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The lock every decision near a deadline is taken under (see ``__call__``)."""
        if self._fd < 0 or fcntl is None:
            yield
            return
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _posted(self, r: int, seq: int) -> bool:
        mv = self._mv
        p = self._slot(r, seq)
        return mv[p] == seq and (
            not self.checked or mv[p + 4] == _checksum(seq, mv[p + 1], mv[p + 2], mv[p + 3])
        )

    def _slot(self, rank: int, seq: int) -> int:
        return (rank * 2 + (seq & 1)) * _FIELDS

    def __call__(self, seq: int, values: Sequence[int], timeout: float) -> list[tuple[int, ...]]:
        """Post, then read every rank's post. A rank that waited ``timeout`` gives up (writes
        ``-seq``) under the lock, after looking once more; a rank that finds every post there
        close to someone's deadline (they were posted ``timeout - margin`` ago) looks for a
        give-up under the same lock before it goes ahead. So either every rank goes ahead or
        every rank that reaches the end of the exchange raises; far from any deadline (every
        ordinary call) no lock is taken: a post seen there was seen by everyone long before
        any of them could give up."""
        mv = self._mv
        checked = self.checked
        o = self._slot(self.me, seq)
        mv[o + 1], mv[o + 2], mv[o + 3] = values[0], values[1], values[2]
        earliest = mv[o + 5] = _now_ns()
        if checked:
            mv[o + 4] = _checksum(seq, values[0], values[1], values[2])
        mv[o] = seq  # last: the others read the values once they see it
        out: list[tuple[int, ...]] = []
        deadline = 0.0
        spins = 0
        par = seq & 1
        for r in range(self.size):
            p = (r * 2 + par) * _FIELDS
            if not checked and mv[p] == seq:  # the common case, first time round
                out.append((mv[p + 1], mv[p + 2], mv[p + 3]))
                t = mv[p + 5]
                if t < earliest:
                    earliest = t
                continue
            while True:
                if mv[p] == seq:
                    got = (mv[p + 1], mv[p + 2], mv[p + 3])
                    if not checked or mv[p + 4] == _checksum(seq, *got):
                        out.append(got)
                        t = mv[p + 5]
                        if t < earliest:
                            earliest = t
                        break
                elif mv[p] == -seq:  # that rank gave up waiting for this call
                    out.append((0, 0, ABSENT))
                    break
                spins += 1
                if spins & 255 == 0:
                    now = time.monotonic()
                    if not deadline:
                        deadline = now + timeout
                        start = now
                    elif now > deadline:
                        with self._locked():
                            if not all(self._posted(q, seq) for q in range(self.size)):
                                mv[o] = -seq  # a rank that comes later raises, not replays
                                raise TimeoutError
                        deadline = float("inf")  # all came in the end: read them
                    elif now - start > 1e-3:
                        time.sleep(0.0001 if now - start > 0.05 else 0)
        if timeout != self._timeout:
            self._timeout = timeout
            self._late_ns = int((timeout - min(1.0, timeout / 10)) * 1e9)
        if _now_ns() - earliest > self._late_ns:
            with self._locked():  # someone may be giving up right now: decide under the lock
                for r in range(self.size):
                    if mv[self._slot(r, seq)] == -seq:
                        out[r] = (0, 0, ABSENT)
        return out

    def missing(self, seq: int) -> list[int]:
        mv = self._mv
        return [r for r in range(self.size) if r != self.me and mv[self._slot(r, seq)] != seq]

    def last(self, rank: int) -> tuple[int, ...] | None:
        mv = self._mv
        a, b = self._slot(rank, 0), self._slot(rank, 1)
        p = a if abs(mv[a]) >= abs(mv[b]) else b
        return (mv[p], mv[p + 1], mv[p + 2], mv[p + 3])

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._mv.release()
            self._mm.close()
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1


class StoreExchange(Exchange):
    """Ranks on several hosts: one store key per rank and call, deleted two calls later."""

    kind = "store"

    def __init__(self, store: Any, prefix: str, size: int, me: int) -> None:
        self._store = store
        self._prefix = prefix
        self.size = size
        self.me = me

    def _key(self, seq: int, rank: int) -> str:
        return f"{self._prefix}/{seq}/{rank}"

    def __call__(self, seq: int, values: Sequence[int], timeout: float) -> list[tuple[int, ...]]:
        store = self._store
        store.set(self._key(seq, self.me), ",".join(str(int(v)) for v in values))
        keys = [self._key(seq, r) for r in range(self.size)]
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout))
        except Exception as exc:  # DistStoreError (a RuntimeError) on timeout
            raise TimeoutError from exc
        if seq >= 2:  # every rank posted seq - 1, so all have read seq - 2
            with contextlib.suppress(Exception):
                store.delete_key(self._key(seq - 2, self.me))
        return [tuple(int(v) for v in store.get(k).decode().split(",")) for k in keys]

    def missing(self, seq: int) -> list[int]:
        try:
            return [r for r in range(self.size) if not self._store.check([self._key(seq, r)])]
        except Exception:
            return []


def destroyed_message(name: str) -> str:
    return (
        f"'{name}': its process group was destroyed (torch.distributed.destroy_process_group), "
        "so its graphs, which held the group's collectives, were released; build the graph again "
        "after init_process_group"
    )


class Refused:
    """Stands in for the agreement of a graph that had none (``check=False``) once its process
    group is destroyed and its graphs released: every call raises, naming why."""

    sync_sizes = False
    broken = True

    def __init__(self, name: str) -> None:
        self.message = destroyed_message(name)

    def __call__(self, *args: Any) -> int:
        raise ReplayInputError(self.message)

    def __repr__(self) -> str:
        return f"Refused({self.message!r})"


def open_exchange(group: Any, timeout: float) -> Exchange:
    """Set up the exchange of ``group``; every rank of it must call this at the same point (at
    capture). Ranks on one host (by host name and a token they can all read back) share a
    mapped file, otherwise they use the default process group's store."""
    ranks = _compat.group_ranks(group)
    size = len(ranks)
    if size <= 1:
        return Exchange()
    me = dist.get_rank(group)
    store = _compat.default_store()
    name = str(getattr(group, "group_name", "world"))
    # The n-th agreement of this group on each rank meets the n-th of the others: a per-rank
    # counter in the store (ranks build their graphs in the same order, as NCCL needs anyway).
    index = store.add(f"torchreplay/agree/{name}/opened/{me}", 1)
    prefix = f"torchreplay/agree/{name}/{index}"
    wait = datetime.timedelta(seconds=timeout)
    every = range(size)
    store.set(f"{prefix}/host/{me}", socket.gethostname())
    store.wait([f"{prefix}/host/{r}" for r in every], wait)
    hosts = {store.get(f"{prefix}/host/{r}").decode() for r in every}
    mapped = _map_shared(store, prefix, size, me, wait) if len(hosts) == 1 else None
    store.set(f"{prefix}/ok/{me}", "1" if mapped is not None else "0")
    store.wait([f"{prefix}/ok/{r}" for r in every], wait)
    if mapped is not None and all(store.get(f"{prefix}/ok/{r}") == b"1" for r in every):
        return SharedExchange(mapped[0], size, me, lock_fd=mapped[1])
    if mapped is not None:
        mapped[0].close()
        os.close(mapped[1])
    return StoreExchange(store, f"{prefix}/calls", size, me)


def _map_shared(
    store: Any, prefix: str, size: int, me: int, wait: datetime.timedelta
) -> tuple[mmap.mmap, int] | None:
    """Rank 0 makes the file and writes a token into it; every rank maps it and reads the token
    back (a host name shared by two machines fails here); rank 0 unlinks it once all mapped.
    Each rank keeps its descriptor open: it is the lock of the decision to give up."""
    nbytes = size * 2 * _FIELDS * 8 + 64
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = ""
    fd = -1
    mm = None
    try:
        if me == 0:
            token = secrets.token_hex(16)
            fd, path = tempfile.mkstemp(prefix="torchreplay-agree-", dir=folder)
            os.ftruncate(fd, nbytes)
            os.pwrite(fd, token.encode(), nbytes - 64)
            mm = mmap.mmap(fd, nbytes)
            store.set(f"{prefix}/shm", f"{path}|{token}")
        else:
            path, token = store.get(f"{prefix}/shm").decode().split("|")
            fd = os.open(path, os.O_RDWR)
            mm = mmap.mmap(fd, nbytes)
            if mm[nbytes - 64 : nbytes - 32].decode(errors="replace") != token:
                mm.close()
                mm = None
    except OSError:
        mm = None
    finally:
        if mm is None and fd >= 0:
            os.close(fd)
        if me != 0 or path:
            store.set(f"{prefix}/mapped/{me}", "1")
        if me == 0 and path:
            store.wait([f"{prefix}/mapped/{r}" for r in range(size)], wait)
            with contextlib.suppress(OSError):
                os.unlink(path)
    return (mm, fd) if mm is not None else None


class Agreement:
    """One graph's per-call exchange (see the module docstring).

    Args:
        group: the process group whose ranks agree.
        name: the graph's name, for messages.
        fingerprint: what this rank captured (:func:`~torchreplay.distributed.collectives.fingerprint`).
        sync_sizes: the agreed size is the largest posted; otherwise sizes must be equal.
        timeout: seconds to wait for the other ranks; with ``marker``, also the longest the
            GPU work up to a call may stay unfinished.
        describe: turns a rank's posted ``(size, choice)`` into words for the error.
        marker: records a marker after the work enqueued so far and returns it (an object with
            ``query()``: a CUDA event on the graph's stream); given, a replay that never ends is
            reported by :mod:`.watch` (graphs that hold collectives).
        on_hang: ``"exit"`` (end the process after the report) or ``"warn"``.
    """

    def __init__(
        self,
        group: Any,
        name: str,
        fingerprint: int,
        *,
        sync_sizes: bool,
        timeout: float,
        describe: Callable[[int, int], str] | None = None,
        marker: Callable[[], Any] | None = None,
        on_hang: str = "exit",
    ) -> None:
        self.group = group
        self.name = name
        self.fingerprint = fingerprint
        self.sync_sizes = sync_sizes
        self.timeout = timeout
        self.ranks = _compat.group_ranks(group)
        self._describe = describe or (lambda n, c: "eager" if c == EAGER else "its graph")
        self._exchange = open_exchange(group, timeout)
        self.kind = self._exchange.kind
        self.calls = 0
        self._broken = ""
        self.on_hang = on_hang
        self.marker = marker
        if marker is not None:
            watch(self)

    @property
    def broken(self) -> bool:
        return bool(self._broken)

    def __call__(self, size: int, choice: int = GRAPH) -> int:
        """Post this rank's call and return the size every rank runs: the largest posted with
        ``sync_sizes``, else ``size`` (equal on every rank, or this raises).

        Raises:
            ReplayInputError: on every rank, when the ranks' fingerprints or choices differ
                (or sizes, without ``sync_sizes``), or after ``timeout`` seconds without
                the other ranks; the agreement is then broken and every later call raises.
        """
        if self._broken:
            raise ReplayInputError(self._broken)
        self.calls += 1
        seq = self.calls
        try:
            posted = self._exchange(seq, (size, self.fingerprint, choice), self.timeout)
        except TimeoutError:
            missing = [self.ranks[r] for r in self._exchange.missing(seq)] or "?"
            self._broken = (
                f"'{self.name}': rank {self.ranks[self._exchange.me]} waited {self.timeout:g} s "
                f"at call {seq} for rank(s) {missing}, which did not come to this call (it "
                "skipped a call, stopped, or is stuck before it); nothing was launched, so no "
                "collective hangs. Every rank must call the graph the same number of times; "
                "the graph refuses further calls"
            )
            raise ReplayInputError(self._broken) from None
        if any(c == ABSENT for _, _, c in posted):
            gone = [self.ranks[r] for r, p in enumerate(posted) if p[2] == ABSENT]
            self._broken = (
                f"'{self.name}': rank(s) {gone} gave up waiting for the others at call {seq} "
                "(a rank skipped a call or came too late); this rank does not replay either, "
                "so no collective hangs; the graph refuses further calls"
            )
            raise ReplayInputError(self._broken)
        target = max(p[0] for p in posted) if self.sync_sizes else size
        first = posted[0]
        same = all(
            p[1] == first[1] and p[2] == first[2] and (self.sync_sizes or p[0] == first[0])
            for p in posted
        )
        if not same:
            raise ReplayInputError(self._disagreement(seq, posted))
        return target

    def group_destroyed(self) -> None:
        """The process group was destroyed and the graph's CUDA graphs released (see
        :func:`.watch.on_destroy`): every later call raises."""
        if not self._broken:
            self._broken = destroyed_message(self.name)

    def _disagreement(self, seq: int, posted: list[tuple[int, ...]]) -> str:
        lines = []
        for r, (n, fp, choice) in enumerate(posted):
            lines.append(
                f"rank {self.ranks[r]}: {self._describe(n, choice)} (fingerprint {fp:016x})"
            )
        fps = {p[1] for p in posted}
        why = (
            "They captured different graphs (other sizes, or other collectives in another "
            "order): build the graph the same way on every rank"
            if len(fps) > 1
            else "Every rank must run the same graph at the same call, or all run eagerly: "
            "keep the modules in the same mode (train/eval) and, without sync_sizes, call "
            "with sizes that pad to the same graph"
        )
        return (
            f"ranks disagree on what to run at call {seq} of '{self.name}', so nothing was "
            f"launched (it would hang in NCCL): {'; '.join(lines)}. {why}"
        )

    def hang_report(self, seq: int, seconds: float) -> str:
        """Words for a call whose GPU work has not finished after ``seconds`` (see :mod:`.watch`)."""
        me = self.ranks[self._exchange.me]
        posted = []
        for r, rank in enumerate(self.ranks):
            last = self._exchange.last(r)
            if last is not None:
                n, choice = last[1], last[3]
                what = "gave up waiting" if choice == ABSENT else self._describe(n, choice)
                posted.append(f"rank {rank}: call {abs(last[0])}, {what}")
        seen = (
            f"What each rank posted last: {'; '.join(posted)}" if posted
            else "(the other ranks' posts are in the store; read their logs)"
        )
        return (
            f"rank {me}: the GPU work up to call {seq} of '{self.name}' has not finished after "
            f"{seconds:.0f} s. Every rank agreed to run that call, so a collective inside it "
            "waits for a rank that will not come: a rank that died or hit a GPU error, or a "
            "collective launched between replays on some ranks only (NCCL's watchdog does not "
            f"see collectives replayed from a graph). {seen}"
        )

    def close(self) -> None:
        self._exchange.close()

    def __repr__(self) -> str:
        return (
            f"Agreement('{self.name}', ranks={self.ranks}, via {self.kind}, "
            f"sync_sizes={self.sync_sizes}, calls={self.calls}"
            + (f", hang watch: {self.timeout:g} s, on_hang={self.on_hang})" if self.marker else ")")
        )
