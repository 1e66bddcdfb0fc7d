"""Python state a captured call changes, which its replays cannot change.

A replay runs no Python. What the callable does in Python at each call happens while the graph
is captured, and never again:

- an attribute set to a new tensor: HF's ``DynamicCache`` (``self.keys = torch.cat([self.keys,
  k])``), a recurrent state kept on an object (``state.h = cell(x, state.h)``);
- a number or another value changed: ``self.step += 1``, a cache position kept as an int;
- a list or dict grown: ``outputs.append(y)``.

Eagerly the next call reads the new state. A replay reads what the capture read: a decode step
over a ``DynamicCache`` replays against the cache of the capture and returns wrong logits,
silently, and its warm-ups have advanced the caller's cache by several steps besides.

So :func:`~torchreplay.core.capture.capture` compares the Python state the call can reach just
before and just after the captured call (the call the graph replays). What it reaches: the
arguments and what they hold, the objects its function closes over or is bound to, the globals
its code names (a script's ``model``, a ``global`` counter), and the modules it runs (their own
attributes; their parameters, buffers, submodules and hooks are watched elsewhere:
``core/placed.py``, ``core/modes.py``). Optimizers and gradient scalers are left to
``graph_step``, which keeps their Python state itself (the learning rate, the scaler's stage).

- **A value changed** (a number, a list's length, an object replaced): :class:`CaptureError`
  naming each path and the fix. A replay would not repeat it.
- **A tensor replaced by another after the call read it** (a cache, a recurrent state): the same
  error. Every replay would read the tensor of the capture.
- **A tensor replaced by one the call did not read before** (``self.last_hidden = h``; a
  spectral-norm weight recomputed from its parameters at each call): replays are eager-equal.
  The attribute keeps the capture's tensor, which each replay rewrites with that call's values.
  One warning says so: a reference kept from an earlier call sees its values change.

Which tensors a call reads is seen by a dispatch mode over the captured call, for the tensors
the last warm-up replaced (none in most models: then no mode runs). Before the error is raised,
what the warm-ups and the capture changed is put back (the caller's cache is as it was).

**In-place writes to small tensors the state holds** (transformers' ``StaticCache`` advances
its position counter with ``cumulative_length.add_``) are replayed, as eager does them; but the
warm-ups and the capture advanced them too, so every replay wrote four positions past the
caller's. Tensors of up to 1 MiB are copied before the warm-ups and put back after each capture.
Larger ones (a cache object's keys, a memory bank kept as a plain attribute) are not copied
whole: :class:`~torchreplay.core.rewind.Rewind` saves what each write of a call the build makes
for real (:meth:`PyState.build_call`: warm-ups, the ``sizes=`` probe, a breakable graph's sample
call) is about to overwrite, the rows of an ``index_copy_``, and writes it back with the small
ones: a sample position over the caller's prompt left the warm-ups' rows there. A module's
buffers are ``StateSnapshot``'s.

**Eager parts.** A breakable graph's breaks run at every replay, so what they change in Python
is real; :meth:`PyState.eager_part` is entered around each break in the captured run. The
places the last warm-up changed are read again at the start, before and after each break and
at the end: a change seen only across breaks is theirs. Two are refused even so, since the
segments' Python ran once: a tensor a break sets that a segment reads (the segment keeps the
capture's), and one a break grows at every call (a ``DynamicCache`` updated at the attention,
whose length the model's Python read for the positions before the break). A change at a place
the warm-ups did not change counts as the segments'.

**A tensor off the graph's device that the call reads on the host** (a CPU tensor kept as a
plain attribute, read by ``.item()``, ``int(...)`` or as a 0-dim operand of a CUDA op) is read
once, at capture: a replay keeps that value, where eagerly each call reads it again. A replay
that finds it written in place since, or replaced, raises :class:`ReplayInputError`
(:class:`StateReads`); a copy of it to the device (pinned memory) is read at every replay and
is no such read. ``.tolist()`` and ``.numpy()`` read with no op: a torch function mode sees them
at the first capture, where the state holds such a tensor.

The warm-ups run before the comparison, so a first call's initialisation (a cache created at
the first call) is not a change. How far the walk goes: ``core/pystate.py``. Not seen: state
reached only through another function's globals or an object's methods, and reads inside a
``torch.compile``d region (its ops are not dispatched to the mode: a tensor only it reads
counts as not read). Replays compare identities and, for host reads, version counters only.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from torchreplay._compat import copy_back, version_of
from torchreplay.core.args import roots_of
from torchreplay.core.frozen import FrozenValues, FrozenWatch
from torchreplay.core.pystate import (
    Change, Node, diff, is_small, large_tensors, live_value, path_of, plain_tensors, put_back,
    roots_of_call, same_value, small_tensors, state_tensors, value_at, walk_state,
)
from torchreplay.core.reads import ReadWatch, StateReads, on_device
from torchreplay.core.rewind import Rewind
from torchreplay.errors import CaptureError

__all__ = ["PyState", "NoEffects", "NO_EFFECTS"]

log = logging.getLogger(__name__)


class PyState:
    """The Python state one capture can change, compared around the captured call.

    Args:
        name: the graph's name, for messages.
        fn, args, kwargs: the call being captured (the static arguments).
        modules: returns the modules the call runs (a plain function's are found while it
            warms up, so this is asked at each walk).
        reads: find which tensors held in the state the first capture reads (:meth:`reads`).
    """

    def __init__(
        self,
        name: str,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        modules: Callable[[], Iterable[torch.nn.Module]] = lambda: (),
        reads: bool = False,
    ) -> None:
        self.name = name
        self._roots = list(roots_of_call(fn, args, kwargs))
        self._modules = modules
        self._start: dict[str, Node] | None = None
        self._before: dict[str, Node] | None = None
        self._candidates: set[tuple[str, Any]] = set()  # where the last warm-up replaced tensors
        self._changing: set[tuple[str, Any]] = set()  # every place the last warm-up changed
        self._growing: set[tuple[str, Any]] = set()  # ... to a tensor of another shape
        self._watch: ReadWatch | None = None
        self._frozen: FrozenWatch | None = None  # the first capture's reads of plain values
        # Eager parts (a breakable graph's breaks) in the captured call: the places of
        # _changing, their values at its start and before and after each part, by part.
        self._places: list[tuple[tuple[str, Any], Node]] = []
        self._first: list[Any] = []
        self._parts: list[tuple[str, list[Any], list[Any]]] = []
        self._set_by_parts: dict[tuple[str, Any], set[int]] = {}
        # The tensors the state holds, watched for reads at the first capture: what
        # :meth:`reads` checks at each call (None: not known yet).
        self._state: list[tuple[Node, Any, torch.Tensor]] | None = None if reads else []
        self._reads: StateReads | None = None
        self._warned = False
        self._saved: list[tuple[torch.Tensor, int | None, torch.Tensor]] = []
        self._rewind: Rewind | None = None  # what the build writes into the large ones
        self._versions: dict[int, int | None] = {}  # the held tensors' version counters at start
        # Tensors the state holds off the graph's device (a CPU counter), around the captured
        # call: (path, tensor, version, a copy if small); their writes inside eager parts.
        self._host: list[tuple[str, torch.Tensor, int, torch.Tensor | None]] = []
        self._host_in_parts: dict[int, int] = {}

    def take(self) -> dict[str, Node]:
        """Walk the state; return its mutable nodes by path."""
        return walk_state(self._roots, roots_of(list(self._modules())), self.name)

    # -- around warm-up and capture (core/capture.py) ----------------------------------------

    def start(self) -> None:
        """Before the first warm-up: what :meth:`undo` puts back, and the small tensors the
        state holds, whose in-place writes :meth:`put_back_tensors` undoes."""
        if self._start is None:
            self._start = self.take()
            self._keep(self._start)

    def held_tensors(self) -> list[tuple[str, torch.Tensor, int | None]]:
        """The tensors the state held at :meth:`start` that a build puts back (a cache
        object's keys, its position counter), by path, each with its version counter then."""
        if self._start is None:
            return []
        held = {id(t) for t in plain_tensors(self._start)}
        found: dict[int, tuple[str, torch.Tensor, int | None]] = {}
        for node, key, t in state_tensors(self._start):
            if id(t) in held and id(t) not in found:
                found[id(t)] = (path_of(node, key), t, self._versions.get(id(t)))
        return list(found.values())

    def put_back_tensors(self) -> None:
        """After a capture: undo what the warm-ups and the capture wrote in place into the
        tensors the state holds (a cache's position counter advanced by each call: replays
        advance it from where the caller left it, as eager calls would; the rows a warm-up
        wrote into a cache at the sample's position)."""
        if self._rewind is not None:
            self._rewind.undo()
            self._rewind.warn_unseen()
        with torch.no_grad():
            for t, version, saved in self._saved:
                if version is None or t._version != version:  # (None: an inference tensor)
                    # (inference_mode(False) would turn autograd back on: only entered for an
                    # inference tensor, which only the mode may write)
                    with torch.inference_mode() if t.is_inference() else contextlib.nullcontext():
                        copy_back(t, saved)

    @contextlib.contextmanager
    def warmup(self, last: bool) -> Iterator[None]:
        """Around a warm-up call; the last one tells which tensors each call replaces."""
        before = self.take() if last else None
        with self.build_call():
            yield
        if before is not None:
            changes = diff(before, self.take())
            self._candidates |= {c.where for c in changes if c.tensor}
            self._changing |= {c.where for c in changes}
            self._growing |= {c.where for c in changes if c.tensor and c.before.shape != c.after.shape}

    def build_call(self) -> contextlib.AbstractContextManager[Any]:
        """Around a call the build makes for real (a warm-up, the probe of ``sizes=``, a
        breakable graph's sample call): what it writes into the state's large tensors is
        recorded, and put back with the small ones (:meth:`put_back_tensors`)."""
        return self._rewind if self._rewind is not None else contextlib.nullcontext()

    def before_replay(self) -> None:
        """Just before a breakable graph's capture replays a segment for real: save what its
        writes into the state's large tensors overwrite (core/rewind.py), for
        :meth:`put_back_tensors`."""
        if self._rewind is None:
            return
        watch = self._watch
        if watch is not None:  # (its copies of what a replay overwrites are no reads)
            watch.paused += 1
        try:
            self._rewind.before_replay()
        finally:
            if watch is not None:
                watch.paused -= 1

    def before_capture(self) -> None:
        """Before a capture begins (the stream not capturing yet): after the build (a lazy
        size, no warm-ups) the small tensors are copied here, as :meth:`start` does at the
        build. A breakable graph's capture runs its segments and breaks for real, so what it
        writes in place is put back after it."""
        if self._start is None:
            self._keep(self.take())

    def _keep(self, nodes: dict[str, Node]) -> None:
        """Copy the small tensors of the state; watch the large ones' writes (core/rewind.py)."""
        tensors = plain_tensors(nodes)
        self._versions = {id(t): version_of(t) for t in tensors}
        self._saved = small_tensors(tensors)
        large = large_tensors(tensors)
        self._rewind = Rewind(large) if large else None

    @contextlib.contextmanager
    def captured(self, device: torch.device | None = None) -> Iterator[None]:
        """Around the captured call: watch reads of the tensors a call replaces, and the
        writes into tensors the state holds off ``device`` (the graph's), which no replay
        repeats."""
        self._before = before = self.take()
        self._host = _off_device(before, device) if device is not None else []
        self._host_in_parts = {}
        watched = [
            t for w in self._candidates if isinstance(t := value_at(before, w), torch.Tensor)
        ]
        first = self._state is None
        if first:  # the first capture: which of the state's tensors it reads
            self._state = list(state_tensors(before))
            watched += [t for _, _, t in self._state]
        self._watch = ReadWatch(watched, device) if watched else None
        self._frozen = FrozenWatch() if first else None
        # (.tolist() and .numpy() of a tensor off the device read it without an op)
        host = self._watch.host_calls() if first and self._watch and self._host else None
        self._places = [(w, before[w[0]]) for w in sorted(self._changing, key=repr) if w[0] in before]
        self._first = self._live()
        self._parts, self._set_by_parts = [], {}
        # (the rewind outside the read watch: its copies of what an op overwrites are no reads)
        with (
            self.build_call(),
            self._watch if self._watch is not None else contextlib.nullcontext(),
            host if host is not None else contextlib.nullcontext(),
            self._frozen if self._frozen is not None else contextlib.nullcontext(),
        ):
            yield

    @contextlib.contextmanager
    def eager_part(self, name: str) -> Iterator[None]:
        """Around a call inside the captured call that every replay runs again, eagerly (a
        break of a breakable graph): what it changes in Python it changes at every call, so it
        is no error; what it reads is not the graph's. A tensor it puts in place of another is
        watched: a graph segment that reads it (or the one it replaced) reads the capture's."""
        if self._before is None:  # not inside the captured call
            yield
            return
        at_entry = self._live()
        host = [version_of(t) or 0 for _, t, _, _ in self._host]
        watch, frozen = self._watch, self._frozen
        if watch is not None:
            watch.paused += 1
        if frozen is not None:
            frozen.paused += 1
        try:
            yield
        finally:
            if watch is not None:
                watch.paused -= 1
            if frozen is not None:
                frozen.paused -= 1
            for (_, t, _, _), v in zip(self._host, host):  # (a break's writes are real)
                self._host_in_parts[id(t)] = self._host_in_parts.get(id(t), 0) + (version_of(t) or 0) - v
            at_exit = self._live()
            self._parts.append((name, at_entry, at_exit))
            for (where, _), a, b in zip(self._places, at_entry, at_exit):
                if isinstance(b, torch.Tensor) and b is not a:
                    ids = self._set_by_parts.setdefault(where, set())
                    ids |= {id(a), id(b)} if isinstance(a, torch.Tensor) else {id(b)}
                    if watch is not None:
                        watch.add(b)

    def _live(self) -> list[Any]:
        return [live_value(node, where[1]) for where, node in self._places]

    def verdict(self) -> CaptureError | None:
        """After the capture ended: the error for what a replay cannot repeat, or None (one
        warning, once per graph, for tensors replaced but not read)."""
        before, self._before = self._before, None
        assert before is not None, "verdict() before captured()"
        changes = diff(before, self.take())
        read = self._watch.read if self._watch is not None else set()
        host_read = self._watch.host_read if self._watch is not None else set()
        self._watch = None
        parts = bool(self._parts)
        if parts:
            changes, err = self._eager_parts(changes, read)
            if err is not None:
                return err
        # A tensor replaced that no earlier warm-up showed (no warm-up ran): assume it is read.
        unread = [
            c for c in changes
            if c.tensor and c.where in self._candidates and id(c.before) not in read
        ]
        wrong = [c for c in changes if all(c is not u for u in unread)]
        unread = [c for c in unread if not _reparametrized(before, c)]
        if wrong:
            return _error(self.name, wrong, parts)
        # (off the device, read on the host and not written by the call: the capture's value)
        kept = {id(t): v for _, t, v, _ in self._host if version_of(t) == v}
        by_breaks = [  # (written by a break at every call, read on the host by a segment)
            path for path, t, _, _ in self._host if self._host_in_parts.get(id(t)) and id(t) in host_read
        ]
        if by_breaks:
            return _segment_host_read_error(self.name, by_breaks)
        written, small = self._host_written(parts)
        if written:
            return _host_error(self.name, written, parts, scratch=small and not parts)
        found, self._frozen = self._frozen, None
        if found is not None and self._reads is None:  # what each replay reads where it was
            changed = {c.where for c in changes}
            places = [(n, k, t) for n, k, t in self._state or () if id(t) in read and (n.path, k) not in changed]
            frozen = {i: v for i, v in kept.items() if i in host_read}
            values = FrozenValues(found.found, {id(n.obj): (n.obj, n.path) for n in before.values() if n.kind == "attrs"})
            self._reads = StateReads(places, frozen, values) if places or values else None
            self._state = []
        if unread and not self._warned:
            self._warned = True
            log.warning("%s", _unread_warning(self.name, unread))
        return None

    def _host_written(self, parts: bool) -> tuple[list[str], bool]:
        """The paths of tensors off the graph's device that the captured call wrote outside
        its eager parts, to other values (a scratch buffer rewritten with the values it held
        is eager-equal: not counted, where no eager part wrote it too); and whether each is
        small (compared by value)."""
        host, self._host = self._host, []
        found, small = [], True
        for path, t, version, copy in host:
            outside = (version_of(t) or 0) - version - self._host_in_parts.get(id(t), 0)
            if outside <= 0:
                continue
            if copy is not None and not parts and torch.equal(t, copy):
                continue
            found.append(f"{path} (a {t.dtype} tensor{tuple(t.shape)} on {t.device})")
            small = small and copy is not None
        return found, small

    def _eager_parts(
        self, changes: list[Change], read: set[int]
    ) -> tuple[list[Change], CaptureError | None]:
        """Set apart the changes only eager parts made (a place that changed across a part and
        never between two); return the others, and the error for a tensor a part replaced that
        a graph segment reads, or that grows at every call (a segment's Python that read its
        length ran once, at capture: unseen, so refused). A place the last warm-up did not
        change counts as the graph's."""
        parts, self._parts = self._parts, []
        end = self._live()
        marks = [self._first] + [m for _, a, b in parts for m in (a, b)] + [end]
        index = {where: j for j, (where, _) in enumerate(self._places)}
        graph_changes, read_after = [], []
        for c in changes:
            j = index.get(c.where)
            if j is None or any(
                not same_value(marks[i][j], marks[i + 1][j]) for i in range(0, len(marks), 2)
            ):
                graph_changes.append(c)  # (between two parts: in a graph segment)
            elif c.where in self._growing or self._set_by_parts.get(c.where, set()) & read:
                part = next(n for n, a, b in parts if not same_value(a[j], b[j]))
                read_after.append((part, c))
        self._set_by_parts = {}
        if read_after:
            return graph_changes, _segment_read_error(self.name, read_after)
        return graph_changes, None

    def reads(self) -> StateReads | None:
        """After the build: the tensors in Python state the graph reads (None: none)."""
        if self._reads is not None:
            self._reads.arm()
        return self._reads

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """Around a whole build (every capture up front): :meth:`start` first, :meth:`undo` on
        any error, :meth:`settle` after."""
        self.start()
        try:
            yield
        except BaseException:
            self.undo()
            raise
        self.settle()

    def settle(self) -> None:
        """Every capture up front succeeded: drop what :meth:`undo` would put back (it holds
        the state's old objects). Later captures (a lazy size) still compare."""
        self._start = None
        self._saved = []
        self._rewind = None

    def undo(self) -> None:
        """Put back what the warm-ups and the capture changed (after a failure)."""
        if self._start is None:
            return
        for node in self._start.values():
            put_back(node)
        self.put_back_tensors()


class NoEffects:
    """What capture() runs when no Python state is compared (the compile backend's pieces:
    Dynamo replays their Python side effects itself)."""

    def start(self) -> None:
        pass

    def warmup(self, last: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def before_capture(self) -> None:
        pass

    def captured(self, device: torch.device | None = None) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def verdict(self) -> None:
        return None

    def undo(self) -> None:
        pass

    def put_back_tensors(self) -> None:
        pass

    def held_tensors(self) -> list[tuple[str, torch.Tensor, int | None]]:
        return []


NO_EFFECTS = NoEffects()


# -- which weights torch recomputes ------------------------------------------------------------


def _reparametrized(nodes: dict[str, Node], change: Change) -> bool:
    """A weight torch's own hooks compute from its parameters at every call (spectral norm,
    weight norm, pruning: ``weight`` from ``weight_orig``, ``weight_g``/``weight_v``): only
    tensors, read where they are made, not worth a warning."""
    node = nodes.get(change.where[0])
    if node is None or not isinstance(node.obj, torch.nn.Module):
        return False
    params = node.obj._parameters
    name = change.where[1]
    return f"{name}_orig" in params or (f"{name}_g" in params and f"{name}_v" in params)


# -- reads ----------------------------------------------------------------------------------------


# -- messages -------------------------------------------------------------------------------------


def _error(name: str, changes: list[Change], parts: bool = False) -> CaptureError:
    shown = "; ".join(c.describe() for c in changes[:4])
    more = f" (and {len(changes) - 4} more)" if len(changes) > 4 else ""
    where = " in a graph segment" if parts else ""
    breaks = ", or name the code that changes it in breaks= (a break runs at every call)" if parts else ""
    return CaptureError(
        f"'{name}' changes Python state{where} at every call, which a replay cannot repeat (a "
        f"replay runs no Python): {shown}{more}. Eagerly the next call sees the new value; the graph "
        "would read the capture's at every replay. What the warm-ups and the capture changed was "
        "put back. Fix: keep such state in a tensor updated in place (a buffer: "
        "`self.step.add_(1)`, `cache.index_copy_(...)`; for HF models a StaticCache instead of a "
        f"DynamicCache), or pass it in and return the new value, or move the change out of the "
        f"graphed call{breaks}"
    )


def _off_device(
    nodes: dict[str, Node], device: torch.device
) -> list[tuple[str, torch.Tensor, int, torch.Tensor | None]]:
    """The tensors the state holds on another device than the graph's (a step counter kept
    on the CPU; a module's buffer or parameter on a second GPU, whose kernels run on that
    device's own stream, outside the capture), each once, with its version counter and, if
    small, a copy."""
    found: dict[int, tuple[str, torch.Tensor, int, torch.Tensor | None]] = {}
    held = [(path_of(node, key), t) for node, key, t in state_tensors(nodes)] + [
        (f"{node.path}.{name}", t)  # (a module's own: not in the walk, StateSnapshot's)
        for node in nodes.values() if node.kind == "attrs" and isinstance(node.obj, torch.nn.Module)
        for own in (node.obj._buffers, node.obj._parameters) for name, t in own.items() if t is not None
    ]
    for path, t in held:
        if id(t) in found or t.layout != torch.strided or t.device.type == "meta" or on_device(t, device):
            continue
        version = version_of(t)
        if version is None:
            continue
        with torch.no_grad():
            found[id(t)] = (path, t, version, t.detach().clone() if is_small(t) else None)
    return list(found.values())


def _host_error(name: str, written: list[str], parts: bool, scratch: bool) -> CaptureError:
    shown = "; ".join(written[:4]) + (f" (and {len(written) - 4} more)" if len(written) > 4 else "")
    where = " in a graph segment" if parts else ""
    return CaptureError(
        f"'{name}' writes a tensor that is not on the graph's device{where}, in place, at every "
        f"call: {shown}. A replay runs only the graph's device work, so it would not write it "
        "again, where eagerly each call does (a step counter kept on the CPU would stop). What "
        "the warm-ups and the capture changed was put back. Fix: keep the tensor on the "
        "graph's device (a buffer, `register_buffer`, moves with the module), or move the write "
        "out of the graphed call" + (", or name the code that writes it in breaks= (a break runs "
        "at every call)" if parts else "") + ("; a scratch tensor each call fills with the same "
        "values is fine once it holds them: call the model once eagerly before building the "
        "graph" if scratch else "")
    )


def _segment_host_read_error(name: str, paths: list[str]) -> CaptureError:
    return CaptureError(
        f"a break of '{name}' writes {', '.join(paths[:4])} in place at every call, off the "
        "graph's device, and a graph segment reads it on the host (a value taken from it, or a "
        "0-dim CPU operand of a device op): the segments ran their Python once, at capture, so "
        "every replay would keep the capture's value. What the warm-ups and the capture changed "
        "was put back. Fix: keep it on the graph's device (`register_buffer`), or read it "
        "inside a break too"
    )


def _segment_read_error(name: str, found: list[tuple[str, Change]]) -> CaptureError:
    shown = "; ".join(f"{c.describe()} (by {part})" for part, c in found[:4])
    return CaptureError(
        f"a break of '{name}' sets a new tensor at every call that a graph segment reads, or "
        f"one that grows (a cache made longer): {shown}. The break runs again at each replay, "
        "but the segments ran their Python once, at capture: they read the capture's tensor, "
        "and what they derived from its length (a position, a mask) is the capture's. What the "
        "warm-ups and the capture changed was put back. Fix: keep it in a tensor allocated "
        "once and written in place (`self.x.copy_(new)`, a preallocated cache written with "
        "`index_copy_`; for HF models a StaticCache), or return it from the break"
    )


def _unread_warning(name: str, changes: list[Change]) -> str:
    paths = ", ".join(c.path for c in changes[:4]) + (" ..." if len(changes) > 4 else "")
    return (
        f"torchreplay: '{name}' sets {paths} to a new tensor at every call, without reading the "
        "old one first. A replay runs no Python: the attribute keeps the capture's tensor, which "
        "each replay rewrites with that call's values (eager-equal values; but a reference kept "
        "from an earlier call now changes too). Clone what you keep, or return it instead"
    )
