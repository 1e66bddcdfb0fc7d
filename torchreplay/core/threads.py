"""Calls of one graph from several threads (a server's worker threads).

A graph's static input buffers, pool and outputs are shared by every call, so two calls at once
would mix: one thread's input copied in while another's replay has not run yet gives that
replay the wrong input, silently. Each graph therefore takes one call at a time
(:attr:`Callers.lock`, re-entrant). That is not enough for outputs handed out over the pool
(``outputs="checked"``): a thread may read its output after another thread's call has queued the
replay that overwrites it. So the first time a second thread calls a graph, its outputs become
clones, the caller's own memory, and what it handed out so far is marked stale. Autograd's
engine thread does not count: it runs while the thread that called ``backward()`` waits (a
backward graph, or a forward run again by activation checkpointing).

The lock orders the calls on the host, not on the GPU: two calls on different CUDA streams
could run there one over the other. So a call on another stream than its pool's last call first
makes its stream wait for that one (:func:`follow_stream`, :meth:`~torchreplay.core.pool.Pool.on_stream`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from _thread import get_ident
from typing import Any, Callable, Iterable

import torch

from torchreplay import _compat
from torchreplay.core.modes import REPLICA

__all__ = ["Callers", "follow_stream", "get_ident", "outputs_to_clones", "one_at_a_time"]

log = logging.getLogger(__name__)

_current_stream = _compat.current_stream

#: ``Callers.thread`` once more than one thread has called.
SHARED = -1


class Callers:
    """Who calls one graph: a lock its calls hold, and the thread that called it (or
    :data:`SHARED`). A call compares ``get_ident()`` with :attr:`thread` and, where they
    differ, asks :meth:`another`."""

    __slots__ = ("lock", "thread")

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.thread: int | None = None

    def another(self, ident: int, shared: Callable[[], None]) -> None:
        """A call from thread ``ident``, not :attr:`thread`: the first time a second thread
        calls, outside a backward, ``shared()`` (which makes the outputs clones)."""
        if self.thread is None:
            self.thread = ident
        elif self.thread != SHARED and not _compat.in_backward():
            self.thread = SHARED
            shared()


def follow_stream(pool: Any) -> bool:
    """Order this call after the pool's last call if that ran on another CUDA stream
    (:meth:`~torchreplay.core.pool.Pool.on_stream`). True: the stream is capturing another
    graph, which this call must not replay into; the caller runs its callable eagerly."""
    if pool is not None:
        stream = _current_stream(pool.index)
        if stream != pool.stream:
            return pool.on_stream(stream)
    return False


def outputs_to_clones(graph: Any, outputs: Iterable[Any]) -> None:
    """``graph`` (with a ``config`` and a ``name``) is called from a second thread: its
    ``outputs`` (:class:`~torchreplay.core.outputs.Outputs`, or None) and those it makes later
    hand out clones."""
    if graph.config.outputs == "checked":
        graph.config = dataclasses.replace(graph.config, outputs="clone")
    for o in outputs:
        if o is not None:
            o.make_clones()
    log.warning(
        "torchreplay: '%s' is called from several threads: one call at a time, and its outputs "
        "are clones from now on (a thread could read an output after another thread's replay "
        "overwrote it)", graph.name,
    )


def one_at_a_time(
    graph: Any,
    run: Callable[[Any, Any], Any],
    args: Any,
    kwargs: Any,
    eager: Callable[[Any, Any], Any] | None = None,
) -> Any:
    """``run(args, kwargs)`` under ``graph``'s lock (its ``_callers``) and on its device, with
    its ``_outputs`` switched to clones at a second thread's first call; ``eager(args, kwargs)``
    instead inside another graph's capture (:func:`follow_stream`). For the training graphs;
    ``tr.graph``'s replay path has the same lines inline, a Python frame less."""
    callers = graph._callers
    elsewhere = graph._check_device and torch.cuda.current_device() != graph._device_index
    if elsewhere and _compat.replica_calling(graph) is not None:  # nn.DataParallel's, on another
        return graph._fallback(args, kwargs, REPLICA)  # GPU: it never touches the graph's memory
    with callers.lock:
        if get_ident() != callers.thread:
            callers.another(get_ident(), lambda: outputs_to_clones(graph, [graph._outputs]))
        if follow_stream(graph.pool) and eager is not None:
            return eager(args, kwargs)
        if elsewhere:
            with torch.cuda.device(graph._device_index):
                return run(args, kwargs)
        return run(args, kwargs)
