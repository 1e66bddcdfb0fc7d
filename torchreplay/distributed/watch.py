"""A replay that never ends is ended with an error that names the graph each rank was running.

A collective inside a graph waits for its peers on the GPU. The ranks agree before each replay
(:mod:`.agree`), so a replay hangs only when something after the agreement goes wrong: a rank
that died or hit a GPU fault, or a collective of the user's own launched between replays on some
ranks only. NCCL's watchdog does not see collectives replayed from a graph (they were enqueued
at capture), so such a hang would block every rank forever, silently.

One daemon thread per process watches every agreement of graphs that hold collectives, at no
cost to the call: about once a second it records a marker (a CUDA event) on the graph's stream
after the latest agreed call, and checks the last one. A marker still pending ``timeout``
seconds after it was recorded means the GPU work up to that call has not finished: the thread
writes which graph, which call and what every rank last posted (ranks of one host: read from
the shared exchange), then ends the process (``RankConfig(on_hang="exit")``, the default, as
NCCL's own watchdog ends a process whose collective timed out) or only logs it (``"warn"``).

The same thread keeps teardown from hanging (:func:`on_destroy`): NCCL's destroy of a
communicator waits until every CUDA graph that captured one of its collectives is destroyed, so
``destroy_process_group()`` called while such graphs are alive would wait forever. When the
thread sees the main thread inside it, it releases those graphs.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable, Sequence

import torch.distributed as dist

__all__ = ["HANG_EXIT", "on_destroy", "watch"]

log = logging.getLogger(__name__)

#: The exit code of a process the watcher ended.
HANG_EXIT = 3


class _State:
    __slots__ = ("seq", "at", "marker", "reported", "again")

    def __init__(self) -> None:
        self.seq = 0  # the call the pending marker follows
        self.at = 0.0  # when it was recorded (time.monotonic)
        self.marker: Any = None
        self.reported = False
        self.again = False  # one more marker for this call (its work may be enqueued after)


class _Watcher:
    def __init__(self) -> None:
        self.watched: weakref.WeakKeyDictionary[Any, _State] = weakref.WeakKeyDictionary()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.period = 1.0
        #: (groups, owner, release) of graphs that hold collectives: see on_destroy
        self.releases: list[tuple[tuple[Any, ...], weakref.ReferenceType[Any], Callable[[Any], None]]] = []

    def on_destroy(self, groups: Sequence[Any], owner: Any, release: Callable[[Any], None]) -> None:
        with self.lock:
            self.releases = [e for e in self.releases if e[1]() is not None]
            self.releases.append((tuple(groups), weakref.ref(owner), release))
            self._start()

    def add(self, agreement: Any) -> None:
        with self.lock:
            self.watched[agreement] = _State()
            self.period = max(0.02, min(1.0, self.period, agreement.timeout / 4))
            self._start()

    def _start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(
                target=self._run, name="torchreplay-hang-watch", daemon=True
            )
            self.thread.start()

    def _run(self) -> None:
        while not sys.is_finalizing():
            time.sleep(self.period)
            with self.lock:
                items = list(self.watched.items())
                releases = list(self.releases)
            destroyed = _destroying() if items or releases else None
            if destroyed is not None:
                self._release(destroyed, releases)
            for agreement, state in items:
                try:
                    self._look(agreement, state)
                except Exception as exc:  # a CUDA error is the main thread's to raise
                    log.debug("torchreplay: hang watch of '%s' skipped: %s", agreement.name, exc)

    def _release(self, destroyed: Any, releases: list[Any]) -> None:
        """Release the graphs that hold a collective of the group being destroyed."""
        for entry in releases:
            groups, ref, release = entry
            owner = ref()
            if owner is not None and (destroyed is _ALL or any(g is destroyed for g in groups)):
                with self.lock:
                    self.releases = [e for e in self.releases if e is not entry]
                try:
                    release(owner)
                except Exception as exc:  # the destroy goes on; it may wait for this graph
                    log.warning("torchreplay: releasing a graph at destroy_process_group: %s", exc)

    def _look(self, agreement: Any, state: _State) -> None:
        now = time.monotonic()
        if state.marker is not None:
            if state.marker.query():
                state.marker = None
            elif not state.reported and now - state.at > agreement.timeout:
                state.reported = True
                _hung(agreement, state.seq, now - state.at)
                return
        seq = agreement.calls
        if state.marker is None and (seq != state.seq or state.again) and not agreement.broken:
            # A marker recorded between the agreement and the replay's launch would miss it:
            # each call gets a second marker, a period after its first.
            state.again = seq != state.seq
            state.marker = agreement.marker()
            state.seq, state.at, state.reported = seq, now, False


_ALL = object()


def _destroying() -> Any:
    """The process group the main thread is destroying (``_ALL``: the default group, and with it
    every group), or ``None``. NCCL's destroy waits, with the GIL released, until every CUDA graph
    that captured one of the group's collectives is destroyed; torch gives no hook before it, so
    the watcher looks at where the main thread is."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "destroy_process_group" and code.co_filename.endswith("distributed_c10d.py"):
            group = frame.f_locals.get("group")
            return _ALL if group is None or group is dist.group.WORLD else group
        frame = frame.f_back
    return None


_WATCHER = _Watcher()


def on_destroy(groups: Sequence[Any], owner: Any, release: Callable[[Any], None]) -> None:
    """Call ``release(owner)`` when the main thread destroys one of ``groups`` (or the default
    group) while ``owner`` is alive: NCCL's destroy waits, with the GIL released, until every CUDA
    graph that captured one of the group's collectives is destroyed, and torch gives no hook
    before it, so the watcher thread looks at where the main thread is, about once a second."""
    _WATCHER.on_destroy(groups, owner, release)


def watch(agreement: Any) -> None:
    """Watch ``agreement`` (it needs ``name``, ``timeout``, ``on_hang``, ``calls``, ``broken``,
    ``marker()``: record and return an object with ``query()``, and ``hang_report(seq, s)``)
    until it is garbage."""
    _WATCHER.add(agreement)


def _hung(agreement: Any, seq: int, seconds: float) -> None:
    message = agreement.hang_report(seq, seconds)
    if agreement.on_hang == "warn":
        log.error("torchreplay: %s", message)
        return
    try:
        sys.stderr.write(f"torchreplay: {message}; ending this process (exit code {HANG_EXIT})\n")
        sys.stderr.flush()
        for handler in logging.getLogger().handlers:
            handler.flush()
    finally:
        os._exit(HANG_EXIT)
