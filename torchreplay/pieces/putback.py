"""What a first call's captures write in place is put back after them.

Warm-ups and captures run the pieces several times, and the padding check (:mod:`.padding`)
twice more. What they write in place into the values a graph reads where they are is put back:
buffers, and values read in place (a backward compiled with donated buffers may reuse the memory
of the saved activations it reads last; the compile backend turns them off, a graph given to the
runtime otherwise may not), with their version counters (a pending backward may have saved them);
and the RNG they drew from.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch

from torchreplay import _compat
from torchreplay.core.pystate import large_tensors
from torchreplay.core.snapshot import copies

__all__ = ["COMPILE_FIX", "PutBack", "put_back", "reset_copies", "to_put_back"]


#: How to build without the copies, for the error of one that does not fit
COMPILE_FIX = (
    "Pass restore_state=False (tr.compile(..., restore_state=False), or options="
    "{'restore_state': False}) to leave in the buffers over 1 MiB what the first call's "
    "warm-ups and captures write: right for a KV cache written at the call's positions (each "
    "run writes what the call writes), wrong for a counter or a sum the call adds to"
)


def to_put_back(t: Any, written: bool, restore_state: bool) -> bool:
    """Is module state ``t`` copied before the first call's captures, to be put back after
    them? What the graphs write (``written``, the fake run's finding), unless large with
    ``restore_state=False``; and every buffer up to 1 MiB (a BatchNorm's statistics:
    ``native_batch_norm`` writes them where its schema does not say, and no fake run sees it).
    A large buffer only read (a quantized model's packed weights, a lookup table) is not
    copied: its memory is not needed twice."""
    large = bool(large_tensors([t]))
    return written and (restore_state or not large) or not (large or isinstance(t, torch.nn.Parameter))


class PutBack:
    """What :func:`put_back` yields. Called: write the copies back (the state found). While
    nothing wrote a tensor since (:meth:`wrote`), its copy is what a piece's reset starts from
    (:meth:`copy_of`): a written KV cache is then held twice, not three times."""

    def __init__(self, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._saved = saved
        self._versions = _compat.versions_of([t for t, _ in saved])
        self._copies = {id(t): c for t, c in saved}
        self._dirty: set[int] = set()

    def __call__(self) -> None:
        _compat.restore_unversioned(self._saved, self._versions)
        self._dirty.clear()

    def copy_of(self, t: Any) -> torch.Tensor | None:
        """The copy of ``t`` made at the start, while ``t`` still equals it; else None."""
        return None if id(t) in self._dirty else self._copies.get(id(t))

    def wrote(self, values: Sequence[Any]) -> None:
        """``values`` were written (a piece ran): their copies are no longer their state."""
        self._dirty.update(id(v) for v in values)


@contextlib.contextmanager
def put_back(tensors: Sequence[tuple[str, torch.Tensor]], device: torch.device) -> Iterator[PutBack]:
    """Copy ``tensors`` (name, tensor) now; on exit write them back and set the CPU's and
    ``device``'s RNG back. Yields the write-back (:class:`PutBack`), for a run inside that
    must start from the state found. Copies that do not fit in the device's memory raise a
    ``CaptureError`` naming the largest tensors, before anything ran."""
    restore = PutBack(copies(list(tensors), device, fix=COMPILE_FIX))
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield restore
    finally:
        restore()
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)


def reset_copies(runtime: Any, written: Sequence[tuple[int, Any]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of the values a piece writes (``written``: each one's slot and value), to put
    them back before each of its warm-ups (``runtime``: its
    :class:`~torchreplay.pieces.runtime.PiecewiseRuntime`). Not copied: a value that is no
    tensor and, with ``restore_state=False``, a module buffer over 1 MiB (it keeps what each
    warm-up writes); nor one the first call's put-back holds a copy of that nothing wrote since
    (``runtime._putback``: its copy is used). Copies that do not fit raise, as
    :func:`put_back`'s."""
    inputs, restore = runtime._inputs, runtime.config.restore_state
    held: PutBack | None = runtime._putback
    named, reused = [], []
    for slot, v in written:
        static = slot < len(inputs) and inputs[slot].kind == "static"
        if not isinstance(v, torch.Tensor) or static and not restore and large_tensors([v]):
            continue
        if held is not None and (copy := held.copy_of(v)) is not None:
            reused.append((v, copy))
            continue
        named.append((inputs[slot].name if slot < len(inputs) else f"value {slot} of '{runtime.name}'", v))
    return reused + copies(named, runtime.device, fix=COMPILE_FIX)
