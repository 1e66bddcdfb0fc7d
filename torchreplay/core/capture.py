"""Warm-up on a side stream, capture into ``torch.cuda.CUDAGraph``, and undo on failure.

The invariants this module keeps (DESIGN.md):

- Warm-up and capture run on one persistent side stream on the inputs' device, joined to the
  caller's stream before and after, so per-stream library handles (cuBLAS, cuDNN) are created
  during warm-up and never first inside capture.
- A capture that fails is undone: the stream is no longer capturing, the partial graph and what
  it allocated are released, device and stream are restored, module state and RNG are put back,
  and the error names the op and the user's line.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import sys
import time
import traceback
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from torchreplay import _compat
from torchreplay._compat import copy_nodes
from torchreplay.config import GraphConfig
from torchreplay.core import constants, generators
from torchreplay.core.args import fn_name
from torchreplay.core.effects import NO_EFFECTS, NoEffects, PyState
from torchreplay.core.failures import (
    capture_error, empty_message, launches_nothing, refused_pool, warmup_error,
)
from torchreplay.core.generators import HostDraws
from torchreplay.core.pool import Pool, expect_capture
from torchreplay.core.snapshot import StateSnapshot
from torchreplay.core.writes import WriteWatch
from torchreplay.distributed.collectives import Collective, CollectiveLog
from torchreplay.errors import CaptureError

__all__ = [
    "Captured",
    "from_the_start",
    "Segments",
    "capture_stream",
    "capture",
    "side_stream",
    "on_side_stream",
    "warn_mode_changed",
    "progress",
]

log = logging.getLogger(__name__)



# One side stream per device for every warm-up and capture in the process. A resource cache, not
# state: torch gives each stream that runs a cuBLAS call its own workspace (32 MiB and more on
# Hopper) and never frees it, so a stream per graph would cost that much memory per graph.
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """Return the persistent side stream that warm-up and capture use on ``device``."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(index)
    return stream


@contextlib.contextmanager
def capture_stream(device: torch.device | int | str | None = None) -> Iterator[torch.cuda.Stream]:
    """Run the block on the stream torchreplay warms up and captures on (joined to the
    caller's stream before and after); yields that stream.

    Build a ``DistributedDataParallel`` model inside it before :func:`torchreplay.graph_step`
    captures it: DDP keeps each parameter's gradient accumulator from its construction, and
    an accumulator made on the default stream makes every captured backward fail (torch's
    CUDA-graph notes ask for DDP to be built on the capture's side stream)::

        with tr.capture_stream():
            model = DistributedDataParallel(model, device_ids=[rank])

    Args:
        device: the CUDA device (default: the current one).
    """
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"capture_stream needs a CUDA device, got {dev}")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    stream = side_stream(dev)
    with on_side_stream(stream, dev):
        yield stream


def warn_mode_changed(name: str, captured_training: bool | tuple[bool, ...]) -> None:
    """Log (once per graph: the caller keeps the flag) that a module's train/eval mode changed
    since capture, so calls run eagerly. A tuple: the modes of the modules a function runs."""
    def word(training: bool) -> str:
        return "training" if training else "eval"

    if isinstance(captured_training, tuple):
        then = "the modules it runs in " + "/".join(map(word, captured_training))
        log.warning(
            "torchreplay: '%s' was captured with %s mode, and a module's mode changed since; "
            "running eagerly (counted in stats.fallbacks). Graph it again in this mode.", name, then,
        )
        return
    log.warning(
        "torchreplay: '%s' was captured in %s mode but the module is now in %s mode; running "
        "eagerly (counted in stats.fallbacks). Graph it again in this mode.",
        name,
        word(captured_training),
        word(not captured_training),
    )


@dataclass
class Captured:
    """The result of one successful capture."""

    graph: torch.cuda.CUDAGraph | None  # (None: nothing recorded, with ``allow_empty``)
    out: Any
    seconds: float
    #: Positions in ``watch`` of the tensors the captured call wrote (empty when nothing was watched).
    written: tuple[int, ...] = ()
    #: With ``segmented``: every segment's graph in order, ``None`` for a segment that recorded
    #: no CUDA work (two breaks in a row); otherwise ``[graph]``.
    graphs: tuple[torch.cuda.CUDAGraph | None, ...] = ()
    #: The ``torch.distributed`` collectives the captured call issued, in order (recorded only
    #: when a process group is initialised).
    collectives: tuple[Collective, ...] = ()
    #: The log that recorded them (it keeps each group object by name).
    collective_log: CollectiveLog | None = None
    #: The explicit CUDA generators (not a default one) registered with the graphs: the call
    #: draws from them (core/generators.py).
    generators: tuple[torch.Generator, ...] = ()
    #: With ``copy_in``: the graph's copy into each static input, each off (_compat/copy_nodes.py).
    copies: tuple[copy_nodes.CopyNode, ...] = ()
    #: Buffers the graph writes at every replay, to be kept as long as it (copy nodes not found).
    spares: tuple[torch.Tensor, ...] = ()


class Segments:
    """The graphs of one captured call, in order: one, or several when the capture is stopped
    and resumed (:meth:`cut`, :meth:`resume`) around work that runs eagerly (breakable graphs).

    Every graph allocates from the same pool; each is ended before the next begins, so what
    runs between two of them runs eagerly, on the capture stream, for real.
    """

    def __init__(
        self, pool: Pool, mode: str, generators: Sequence[torch.Generator] = (), copies: int = 0,
        python_rng: bool = True,
    ) -> None:
        self._pool = pool
        self._mode = mode
        #: the explicit generators registered with each graph before its capture begins
        self.generators = generators
        # copy nodes the open segment begins with (the first: ``copies``; a later one: what
        # :meth:`resume` says): its template is kept, to find them in
        self._copies = copies
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.empty: list[bool] = []
        #: the graph whose capture began and has not ended (``None`` between segments)
        self.open: torch.cuda.CUDAGraph | None = None
        #: the host's generators the segments drew from (not what runs between them; with
        #: ``python_rng`` False, torch's CPU generator alone: core/generators.py)
        self.host = HostDraws(python_rng)

    def resume(self, retry: bool = True, copies: int | None = None) -> None:
        """Begin capturing the next segment; ``copies``: the copy nodes the caller records
        first in it (_compat/copy_nodes.py ``record``), none of the call's work."""
        if copies is not None:
            self._copies = copies
        graph = copy_nodes.graph(keep=self._copies > 0)
        for gen in self.generators:  # (each replay draws from where it stands, and moves it on)
            _compat.register_generator(graph, gen)
        expect_capture()  # a graph called inside this capture runs eagerly (core/pool.py)
        # The capture's cuBLAS workspace must live in the graph's pool (see _compat).
        _compat.clear_cublas_workspaces()
        self.host.start()
        try:
            graph.capture_begin(pool=self._pool.handle, capture_error_mode=self._mode)
        except BaseException as exc:
            # torch marked its RNG as capturing and its device allocator as routing into the
            # pool before it failed: every later random op in the process would raise.
            self.host.stop()
            _compat.abandon_pool(torch.cuda.current_device(), self._pool.handle)
            _compat.end_rng_capture(self.generators)
            if not (retry and refused_pool(exc)):
                raise
            log.info("torchreplay: torch cannot capture into pool %s again (%s); the pool "
                     "takes a new id", self._pool.handle, str(exc).splitlines()[0])
            self._pool.renew()
        else:
            self.open = graph
            return
        self.resume(retry=False)  # (outside the handler: the failed graph and error are gone)

    def cut(self) -> torch.cuda.CUDAGraph | None:
        """End the segment being captured; return its graph, or ``None`` when it recorded no
        CUDA work. An empty graph is kept (and destroyed with the others) until the whole
        capture is over: releasing it now could give back the pool's last reference."""
        graph = self.open
        assert graph is not None, "cut() with no segment open"
        # torch warns at every capture_end that recorded no node (TORCH_WARN, not once).
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            graph.capture_end()
        self.open = None
        self.host.stop()
        _compat.clear_cublas_workspaces()
        empty = any("graph is empty" in str(w.message).lower() for w in caught)
        if self._copies:  # (its copy nodes alone are none of the call's work)
            empty = copy_nodes.node_count(graph) <= self._copies
            if not empty:
                graph.instantiate()  # (a kept template is not instantiated by capture_end)
            self._copies = 0
        self.graphs.append(graph)
        self.empty.append(empty)
        return None if empty else graph

    def release(self) -> None:
        """Destroy every ended graph (an undone capture, or the empty segments of a good one)."""
        for graph in self.graphs:
            with contextlib.suppress(Exception):
                graph.reset()


@contextlib.contextmanager
def on_side_stream(stream: torch.cuda.Stream, device: torch.device) -> Iterator[None]:
    """Run the block on ``stream``, joined to the caller's stream before and after."""
    with torch.cuda.device(device):
        caller = torch.cuda.current_stream(device)
        stream.wait_stream(caller)
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            caller.wait_stream(stream)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the block.

    A collection during capture may destroy a dead CUDA graph or run a ``__del__`` that
    synchronizes, both illegal while a stream captures: the capture would be invalidated by code
    that has nothing to do with the callable.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def capture(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    device: torch.device,
    stream: torch.cuda.Stream,
    pool: Pool,
    config: GraphConfig,
    grad: bool = False,
    warmup: bool = True,
    sync: bool = True,
    snapshot: StateSnapshot | None = None,
    watch: Sequence[torch.Tensor] = (),
    reset: Callable[[], None] | None = None,
    segmented: Callable[[Segments], contextlib.AbstractContextManager[Any]] | None = None,
    diagnose_fn: Callable[..., Any] | None = None,
    collectives: bool = True,
    effects: PyState | None = None,
    free_warmup: bool = False,
    owner: Any = None,
    find_generators: bool = True,
    copy_in: Sequence[torch.Tensor] = (),
    allow_empty: bool = False,
    allow_launchless: bool = False,
    host_draws: bool = True,
) -> Captured:
    """Warm ``fn`` up on ``stream`` and capture one call of it into a new graph in ``pool``.

    Args:
        fn, args, kwargs: the call to capture; tensors in ``args``/``kwargs`` are the graph's
            static inputs.
        device: the CUDA device of the inputs.
        stream: the persistent side stream used for warm-up and capture.
        pool: the memory pool the graph allocates from.
        config: warm-up count, capture error mode, diagnosis.
        grad: run with autograd enabled (training) instead of under ``torch.no_grad()``.
        warmup: run ``config.num_warmup_iters`` eager calls first (False when an earlier
            capture of the same callable already did, e.g. smaller sizes of a bucketed graph).
        sync: wait for the warm-up's GPU work before capturing, so that an asynchronous error
            (a device-side assert) is raised as a warm-up error. False where the same code ran
            and was synchronized before (a later size of a piecewise runtime, which syncs once
            after its sizes): the host captures while the GPU runs the warm-up.
        snapshot: restored after a failure (the caller restores it after success); warm-up and
            capture run inside its :meth:`~torchreplay.core.snapshot.StateSnapshot.running` (what
            they write into large buffers, a plain function's modules).
        watch: tensors (the static inputs) whose in-place writes by the captured call are
            recorded in ``Captured.written`` (:class:`~torchreplay.core.writes.WriteWatch`).
        reset: called before each warm-up call and before the capture: puts back what the
            last one wrote in place, so that every run sees the call's state (a counter the
            callable increments and indexes with would otherwise run past its end).
        segmented: a context manager factory entered around the captured call with its
            :class:`Segments`; code inside may cut the capture and resume it (breakable
            graphs). ``Captured.graphs`` then holds every segment.
        effects: the Python state the call can reach, compared around the captured call
            (core/effects.py): a change a replay cannot repeat raises, after it was put back.
        diagnose_fn: what the check runs to name the op that broke a failed capture (default
            ``fn``; a breakable graph passes ``fn`` with its breaks unseen).
        free_warmup: after the warm-up, give torch's cached free memory back to the device
            (``torch.cuda.empty_cache()``), so that the pool can take what the warm-up's
            activations held: a pool cannot take memory from torch's cache. Torch's own
            ``torch.cuda.graph`` does this before every capture; training's builds (a few
            large captures, forward and backward) ask for it, a ``sizes=`` build (hundreds of
            small ones) does not.
        owner: what stays the same across the captures of one graph's sizes (default ``fn``;
            a closure made per size is not): where its warm-up made a host constant on the
            device, every capture makes them with kernels (core/constants.py).
        find_generators: watch the first two warm-ups for the generators the call draws from
            (core/generators.py). False for the compile backend's pieces: they pay no watch
            (hundreds of captures), and a piece that draws from an explicit generator fails
            to capture and runs eagerly, as before generators were registered.
        copy_in: static inputs (dense) the graph (with ``segmented``, the first segment's)
            begins by copying into, by nodes returned off in ``Captured.copies``: a call points
            them at its tensors instead of copying them itself (_compat/copy_nodes.py). No
            nodes where the first segment recorded none of the call's work (a break first), nor
            where the driver does not show them after the capture (never seen): each call then
            copies with a launch (there, ``Captured.spares`` must live as long as the graph).
        collectives: record the ``torch.distributed`` collectives of the captured call
            (``Captured.collectives``; only when a process group exists: a dispatch mode sees
            every op of the capture, so callers that do not use them pass False).
        allow_empty: a capture that recorded no CUDA work is a graph that replays nothing
            (``Captured.graph`` None), not a :class:`CaptureError`: a backward that hands the
            incoming gradients on as they are (``y = x + noise``) launches no kernel, eagerly
            too.
        allow_launchless: the same, only where the call returned tensors, all on ``device``:
            ones it did not compute (its arguments, ``nn.Flatten``, ``nn.Identity``; its
            parameters; views of them: core/failures.py ``launches_nothing``), eagerly too it
            launches nothing. An empty capture for another reason (the work ran on the CPU)
            still raises.
        host_draws: warn (once per ``owner``) when the captured call drew random numbers on the
            host (core/generators.py: ``HostDraws``); False for a trial capture that is dropped.

    Returns:
        the graph, the output of the captured call (living in the pool), and the seconds taken.

    Raises:
        CaptureError: warm-up or capture failed; everything was undone first.
    """
    pool.bind_device(device)
    start = time.perf_counter()
    grad_ctx = torch.enable_grad if grad else torch.no_grad
    # (training passes its own StateKeeper, which finds what it needs by itself)
    running = snapshot.running() if isinstance(snapshot, StateSnapshot) else contextlib.nullcontext()
    python = effects if effects is not None else NO_EFFECTS
    key = fn if owner is None else owner
    # The generators it draws from (core/generators.py): found by its first two warm-ups, or
    # remembered from an earlier build of the same callable (a capture without a warm-up).
    draws = getattr(snapshot, "draws", None)  # (put back with the snapshot's RNG)
    known = generators.remembered(key)
    watching = find_generators and warmup and config.num_warmup_iters > 0 and (draws is not None or known is None)
    if watching and draws is None:
        draws = generators.Draws(device)
    elif draws is not None and known and not watching:
        draws.keep(known)  # (put back with the snapshot: a breakable capture runs for real)
    with on_side_stream(stream, device), grad_ctx(), running:
        if warmup:
            python.start()
            for i in range(config.num_warmup_iters):
                try:
                    if reset is not None:
                        reset()
                    if i:  # (the first starts from it: nothing ran before, or put it back)
                        from_the_start(snapshot, python)
                    last = i == config.num_warmup_iters - 1
                    with (
                        python.warmup(last=last),
                        constants.watching(key, on=last),
                        draws.watch() if watching and i < 2 else contextlib.nullcontext(),  # type: ignore[union-attr]
                    ):
                        fn(*args, **kwargs)
                except Exception as exc:
                    _undo(None, device, pool, snapshot, exc, python)
                    raise warmup_error(fn, i, exc) from exc
            if config.num_warmup_iters:
                from_the_start(snapshot, python)  # (a breakable capture runs its calls for real)
            if watching:
                err = draws.verdict(fn_name(fn))  # type: ignore[union-attr]
                if err is not None:  # (a seed set inside the call: no graph can replay it)
                    _undo(None, device, pool, snapshot, err, python)
                    raise err
                known = tuple(draws.generators)  # type: ignore[union-attr]
                generators.remember(key, draws.generators)  # type: ignore[union-attr]
            if sync:
                stream.synchronize()  # surface asynchronous warm-up errors before capture begins
            if free_warmup:
                torch.cuda.empty_cache()

        # (Python's and NumPy's generators, 120 us a capture: not for a breakable graph's
        # segments, hundreds a build, nor for the compile backend's pieces, whose Python Dynamo
        # traced away)
        python_rng = segmented is None and find_generators
        segments = Segments(pool, config.capture_error_mode, known or (), len(copy_in), python_rng=python_rng)
        spares = [torch.empty_like(t) for t in copy_in]  # (outside the pool: allocated before)
        watcher = WriteWatch(watch) if watch else contextlib.nullcontext()
        recorder = CollectiveLog() if collectives and _compat.dist_ready() else None
        out = None
        try:
            with _gc_paused():
                if reset is not None:
                    reset()
                python.before_capture()
                segments.resume()
                try:
                    if copy_in:  # the graph's first nodes, before anything reads the inputs
                        copy_nodes.record(copy_in, spares, stream)
                    with (
                        watcher,
                        recorder if recorder is not None else contextlib.nullcontext(),
                        python.captured(device),  # (before a breakable graph's breaks are put in)
                        segmented(segments) if segmented else contextlib.nullcontext(),
                        # (host constants made by kernels, where the warm-up made one)
                        constants.DeviceConstants() if constants.remembered(key) else contextlib.nullcontext(),
                    ):
                        out = fn(*args, **kwargs)
                finally:
                    # Always end the capture, even when fn raised: a stream left capturing
                    # breaks every later CUDA call in the process.
                    if segments.open is not None:
                        segments.cut()
        except BaseException as exc:
            out = None
            _undo(segments, device, pool, snapshot, exc, python)
            if isinstance(exc, CaptureError) or not isinstance(exc, Exception):
                raise
            try:  # (no local holds the error: its traceback holds this frame, whose locals
                # hold the call's tensors and autograd graph until a gc pass, not a refcount)
                raise capture_error(fn, args, kwargs, exc, config, snapshot, diagnose_fn) from exc
            finally:
                python.undo()  # the diagnosis ran the call once more
        # Only the graph can tell an empty capture: an optimizer step alone has no tensor
        # argument and returns None, yet records real work on the device.
        if all(segments.empty) and not (
            allow_empty or allow_launchless and launches_nothing(out, device)
        ):
            err = CaptureError(empty_message(fn, args, kwargs, out, device, breaks=segmented is not None))
            out = None
            _undo(segments, device, pool, snapshot, err, python)
            raise err
        err = python.verdict()  # Python state a replay could not change as eager does
        if err is not None:
            out = None
            _undo(segments, device, pool, snapshot, err, python)
            try:
                raise err
            finally:
                del err  # as above: no frame-error cycle
        # (an empty capture, allowed, was not instantiated: nothing replays, nothing to bind)
        first_graph = None if segments.empty[0] else segments.graphs[0]
        copies, spares = bind_copies(first_graph, copy_in, spares, f"'{fn_name(fn)}'")
        python.put_back_tensors()
    seconds = time.perf_counter() - start
    log.debug("captured %s on %s in %.4f s", fn_name(fn), device, seconds)
    if host_draws and segments.host.moved:
        _warn_host_draws(key, segments.host.moved)
    written = tuple(watcher.written) if isinstance(watcher, WriteWatch) else ()
    graphs = tuple(None if e else g for g, e in zip(segments.graphs, segments.empty))
    if segments.graphs and all(segments.empty):
        # (allowed) No graph joins the pool, which may have no other: held, the empty graph
        # keeps the pool's id usable for the next capture (see Pool.keep)
        pool.keep(segments.graphs[-1])
    for g, e in zip(segments.graphs, segments.empty):
        if e and g is not pool.kept:
            g.reset()
    first = next((g for g in graphs if g is not None), None)  # (None: allow_empty)
    if recorder is not None and recorder.collectives:
        log.debug("captured %s holds %d collective(s)", fn_name(fn), len(recorder.collectives))
    return Captured(
        first, out, seconds, written, graphs,
        tuple(recorder.collectives) if recorder is not None else (),
        recorder,
        tuple(known or ()),
        tuple(copies),
        tuple(spares),
    )


def bind_copies(
    graph: torch.cuda.CUDAGraph | None, statics: Sequence[torch.Tensor], spares: Sequence[torch.Tensor], what: str
) -> tuple[list[copy_nodes.CopyNode], list[torch.Tensor]]:
    """The copy nodes :func:`copy_nodes.record` put first into ``graph`` (ended and
    instantiated; ``None``: it recorded no work), each off, and the spares to keep as long as
    the graph: none where the nodes were found (one is pointed into its buffer before it is
    turned on). Where they were not (never seen), one warning naming ``what``: each replay
    copies the buffers into the spares (harmless, kept alive) and each call copies with a
    launch."""
    if graph is None or not statics:
        return [], []
    found = copy_nodes.bind(graph, statics, spares)
    if found is None:
        log.warning("torchreplay: %s: the graph's own copies were not found after its capture; "
                    "each call copies with a launch", what)
        return [], list(spares)
    return found, []


_WARNED_HOST_DRAWS: weakref.WeakSet[Any] = weakref.WeakSet()


def _warn_host_draws(key: Any, moved: Sequence[str]) -> None:
    """Once per callable (``key``: what stays the same across its captures): its captures drew
    from the host's generators (core/generators.py)."""
    try:
        if key in _WARNED_HOST_DRAWS:
            return
        _WARNED_HOST_DRAWS.add(key)
    except TypeError:  # (not weakly referable: warned at each capture)
        pass
    log.warning(generators.host_draws_warning(fn_name(key), moved))


def _undo(
    segments: Segments | None,
    device: torch.device,
    pool: Pool,
    snapshot: StateSnapshot | None,
    exc: BaseException,
    python: PyState | NoEffects | None = None,
) -> None:
    """Release what a failed warm-up or capture holds, so the process stays usable."""
    # The traceback's frames hold the user's locals, tensors in the graph's pool among them.
    for e in (exc, exc.__cause__, exc.__context__):
        if e is not None:
            traceback.clear_frames(e.__traceback__)
    if segments is not None:
        # Finished segments (fn raised a Python error, or recorded nothing): reset() destroys
        # each partial graph and gives back its reference on the pool.
        segments.release()
        if segments.open is not None:
            # CUDA invalidated the capture and capture_end raised before it stopped routing
            # allocations into the pool or could give the pool back; do both here.
            _compat.abandon_pool(device.index, pool.handle)
            _compat.end_rng_capture(segments.generators)
            segments.open = None
        _compat.clear_cublas_workspaces()  # a workspace made in the pool would keep it alive
    with contextlib.suppress(Exception):
        torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    if snapshot is not None:
        snapshot.restore()
    if python is not None:
        python.undo()


def from_the_start(snapshot: Any, python: PyState | NoEffects) -> None:
    """Before a warm-up after the first, before the capture, and after the probe of ``sizes=``
    (a breakable graph's sample call puts back its own): put back what the build's
    calls so far wrote into the module's buffers and the tensors of Python state (not the RNG:
    warm-ups draw on), so that each starts from the caller's state, as the caller's first call
    would. A position each call advances (``self.pos.add_(n)``, a cache's length) ran on across
    the warm-ups, and a cache with room for two calls was written past its end by the third."""
    if isinstance(snapshot, StateSnapshot):
        snapshot.restore(rng=False)
    python.put_back_tensors()


@contextlib.contextmanager
def progress(description: str, total: int) -> Iterator[Callable[[], None]]:
    """Yield ``advance()`` of a progress bar on stderr, shown only when stderr is a terminal."""
    isatty = getattr(sys.stderr, "isatty", None)
    bar = None
    if total > 1 and isatty is not None and isatty():
        try:
            from rich.console import Console
            from rich.progress import Progress
        except ImportError:  # rich is a dependency, but a missing bar must not stop a capture
            Progress = None  # type: ignore[assignment,misc]
        if Progress is not None:
            bar = Progress(console=Console(stderr=True), transient=True)
    if bar is None:
        yield lambda: None
        return
    with bar:
        task = bar.add_task(description, total=total)
        yield lambda: bar.advance(task)
