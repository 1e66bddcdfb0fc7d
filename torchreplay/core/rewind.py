"""Undo what building a graph wrote in place into the large tensors of Python state.

Warm-up runs the callable for real, several times. A write it makes into a tensor that the
caller's objects hold (a cache object's ``keys`` passed as an argument, a memory bank kept as a
plain attribute of a module, a global) stays in the caller's tensor after the build, although
eagerly no call was made: the rows a decode step writes at a sample position overwrite the
prompt's rows there, an accumulator has taken the sample in ``num_warmup_iters`` times. Small
tensors (a position, a length) are copied whole before the build and put back
(``core/effects.py``); a module's buffers are ``StateSnapshot``'s. Copying a large tensor whole
would double the memory of a KV cache sized to fill the device, so :class:`Rewind` instead saves,
just before each op that writes into one of them, only what that op is about to overwrite:

- ``index_copy_(dim, index, src)``: the rows at ``index``;
- ``index_put_(indices, values)`` (``t[idx] = v``): the elements at ``indices``;
- any other write: the written tensor as the op was given it, usually a view of a few rows
  (``t[:, pos].copy_(v)``), the whole tensor only where the op writes the whole tensor.

:meth:`Rewind.undo` writes them back, last write first, so the tensors end as they were before
the build, at the cost of a few rows per write.

What it cannot see, as ``core/writes.py``: a write inside a ``torch.compile``d region (the mode
leaves compiled code alone), a raw kernel launched outside an aten op, and a change of a tensor's
shape in place (``resize_``, ``set_``), which no copy undoes. Such a write still advances the
tensor's version counter (compiled code advances it for the inputs it mutates): when a watched
tensor's counter moved by more than the writes the mode saw, :attr:`Rewind.unseen` names it, for
the caller's warning.

Nothing is saved for a CUDA tensor while the stream is capturing: a capture records work, it
runs none. A breakable graph's capture, though, replays each segment for real before the break
after it (the break reads real values): a write seen while capturing is kept pending, and
:meth:`Rewind.before_replay`, called just before that replay, saves what it will overwrite. The
rows of an ``index_copy_``/``index_put_`` are read then, when the segment computed none of the
indices (a position the caller passed); otherwise the tensor is saved as the op was given it,
the whole tensor for an index write.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Sequence

import torch

from torchreplay._compat import LightDispatchMode, copy_back, is_view, written_tensors

__all__ = ["Rewind"]

log = logging.getLogger(__name__)

_aten = torch.ops.aten
# In-place ops that change a tensor's shape or storage, not its values: a copy cannot undo them.
_METADATA = frozenset({
    "resize_", "resize_as_", "set_", "as_strided_", "t_", "transpose_", "unsqueeze_", "squeeze_",
    "swapdims_", "swapaxes_", "detach_", "requires_grad_",
})


def _capturing() -> bool:
    """Is the current CUDA stream capturing? (Asked only where a CUDA tensor is watched.)"""
    return torch.cuda.is_current_stream_capturing()


def _recorded(t: torch.Tensor) -> bool:
    """Does a write into ``t`` made while capturing only record work (a CUDA tensor), not run?"""
    return t.is_cuda


def _name(func: Any) -> str:
    return func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else ""


def _ptr(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage (None: a meta tensor, a tensor without a storage)."""
    if t.device.type == "meta":
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # (sparse, nested)
        return None


def _tensors(*trees: Any) -> list[torch.Tensor]:
    """The tensors in ``trees`` (arguments, an op's output), lists and tuples looked into."""
    found: list[torch.Tensor] = []
    todo = list(trees)
    while todo:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
    return found


class Rewind(LightDispatchMode):
    """Inside it, record what each op is about to overwrite in ``tensors``' memory.

    Args:
        tensors: the tensors to watch (their whole storages).

    Attributes:
        saved_bytes: what the records hold, in bytes.
    """

    def __init__(self, tensors: Sequence[torch.Tensor] = (), names: Sequence[str] = ()) -> None:
        super().__init__()
        # by storage: a view of one (a row, a slice) has its storage, at the same address
        self._storages: set[int] = set()
        self._log: list[tuple[torch.Tensor, Callable[[], Any]]] = []  # (written, write back)
        self._regions: set[tuple[Any, ...]] = set()  # those saved whole (_save)
        self._paused = False  # undo() inside the mode: its writes are no build's
        # Writes seen while capturing, saved by before_replay(): (op or None, written tensor,
        # the op's arguments up to its indices). _made: the storages the ops captured since the
        # last replay wrote or allocated.
        self._pending: list[tuple[Any, torch.Tensor, tuple[Any, ...]]] = []
        self._made: set[int] = set()
        self._device = False  # does it watch a tensor whose writes a capture only records?
        # The check that every write was seen: each watched tensor's version counter when the
        # mode was entered (or the tensor watched), against the writes seen to its storage.
        self._versions: list[tuple[torch.Tensor, str, int]] = []
        self._seen: dict[int, int] = {}
        self.saved_bytes = 0
        #: the names of watched tensors written where the mode could not see (a compiled
        #: region, a raw kernel): undo() cannot put those writes back
        self.unseen: list[str] = []
        self._warned = False
        self.watch(tensors, names)

    def watch(self, tensors: Sequence[torch.Tensor], names: Sequence[str] = ()) -> None:
        """Watch ``tensors`` too (``names``: for :attr:`unseen`; default their shapes)."""
        for i, t in enumerate(tensors):
            if t.device.type == "meta":
                continue
            self._storages.add(t.untyped_storage().data_ptr())
            self._device = self._device or _recorded(t)
            if not t.is_inference():  # (an inference tensor has no version counter)
                name = names[i] if i < len(names) else f"a tensor{tuple(t.shape)}"
                self._versions.append((t, name, t._version))

    def __enter__(self) -> Rewind:
        self._versions = [(t, name, t._version) for t, name, _ in self._versions]
        self._seen = {}
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            for t, name, version in self._versions:
                if t._version - version > self._seen.get(t.untyped_storage().data_ptr(), 0):
                    if name not in self.unseen:
                        self.unseen.append(name)

    @property
    def watching(self) -> bool:
        """Does it watch any tensor?"""
        return bool(self._storages)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # compiled regions run their compiled code (core/writes.py says why)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if not self._storages:
            return func(*args, **kwargs)
        capturing = self._device and _capturing()  # (once per op: no is_available())
        written = written_tensors(func, args, kwargs)
        for t in written:
            ptr = t.untyped_storage().data_ptr() if t.device.type != "meta" else None
            if ptr not in self._storages:
                continue
            self._seen[ptr] = self._seen.get(ptr, 0) + 1  # (each bumps its version once)
            if self._paused:
                continue
            if capturing and _recorded(t):
                self._defer(func, t, args)
            else:
                undo = self._save(func, t, args, kwargs)
                if undo is not None:
                    self._log.append((t, undo))
        out = func(*args, **kwargs)
        if capturing:
            made = self._made
            for t in written:
                made.add(_ptr(t))
            # new memory only: a view's storage is its base's
            if type(out) is torch.Tensor:
                if not is_view(out):
                    made.add(_ptr(out))
            elif isinstance(out, (tuple, list)):
                made.update(_ptr(o) for o in _tensors(out) if not is_view(o))
        return out

    def _defer(self, func: Any, t: torch.Tensor, args: tuple[Any, ...]) -> None:
        """A write seen while capturing: keep what :meth:`_save` will need (not the values
        written: a reference would keep their memory from the rest of the capture). The rows
        of an index write only where the captured ops made or wrote none of its indices (their
        values are known only after the replay, when the rows are overwritten)."""
        name = _name(func)
        if name in _METADATA:
            return  # (as _save: no copy undoes it)
        if name == "index_copy_" and len(args) > 2 and args[0] is t:
            kept = args[:3]
        elif name in ("index_put_", "_index_put_impl_") and len(args) > 1 and args[0] is t:
            kept = args[:2]
        else:
            kept = ()
        if any(_ptr(i) in self._made for i in _tensors(kept[1:])):
            kept = ()
        self._pending.append((func if kept else None, t, kept))

    def before_replay(self) -> None:
        """Just before a captured segment is replayed for real (a breakable graph's capture):
        save what the writes captured since the last call will overwrite."""
        pending, self._pending = self._pending, []
        self._made = set()
        self._paused = True  # (its own ops, as undo()'s, are no build's writes)
        try:
            with torch.no_grad():
                for func, t, args in pending:
                    undo = self._save(func, t, args, {})
                    if undo is not None:
                        self._log.append((t, undo))
        finally:
            self._paused = False

    def _save(
        self, func: Any, t: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Callable[[], Any] | None:
        """Copy what ``func`` is about to overwrite in ``t``; return what writes it back
        (``func`` None: ``t`` as given, whatever the op)."""
        name = _name(func)
        if name in _METADATA:
            return None
        # (inside __torch_dispatch__ this mode is off: these ops are not seen by it)
        # The indices are copied too: a position counter used as the index is often advanced
        # in place right after the write.
        if name == "index_copy_" and args and args[0] is t:
            dim, index = args[1], args[2].clone()
            rows = t.index_select(dim, index)
            self.saved_bytes += rows.nbytes
            return lambda: t.index_copy_(dim, index, rows)
        if name in ("index_put_", "_index_put_impl_") and args and args[0] is t:
            indices = [i.clone() if isinstance(i, torch.Tensor) else i for i in args[1]]
            values = _aten.index.Tensor(t, indices)
            self.saved_bytes += values.nbytes
            return lambda: _aten.index_put_.default(t, indices, values)
        # Any other write: the tensor as the op writes it. Once per region: what a tensor ends
        # as after undo() is what the earliest record of each element held, so a later record
        # of the very same region (the next warm-up zeroing a whole cache again) adds nothing.
        region = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if region in self._regions:
            return None
        self._regions.add(region)
        before = t.clone()
        self.saved_bytes += before.nbytes
        return lambda: copy_back(t, before)

    def warn_unseen(self) -> None:
        """Log, once, the tensors :meth:`undo` could not put back (:attr:`unseen`)."""
        if self.unseen and not self._warned:
            self._warned = True
            log.warning(
                "torchreplay: the calls that built the graph wrote %s where torchreplay could "
                "not record it (inside a torch.compile'd function, or a kernel launched outside "
                "a torch op), so it is left as they left it. torch.compile the whole module "
                "instead (a compiled module's buffers are copied whole), or build the graph "
                "before the tensor holds what you need", ", ".join(self.unseen),
            )

    def undo(self) -> None:
        """Write back what was saved, last write first; forget it."""
        log, self._log = self._log, []
        self._pending, self._made = [], set()  # (captured, never replayed during the build)
        self._regions.clear()
        self.saved_bytes = 0
        self._paused = True
        try:
            with torch.no_grad():
                for t, put_back in reversed(log):
                    # (an inference tensor only under inference_mode, which may write it; turning
                    # inference_mode off would turn autograd back on, so it is never left)
                    with torch.inference_mode() if t.is_inference() else contextlib.nullcontext():
                        put_back()
        finally:
            self._paused = False
