"""The output of an eager step read by the next graph where it is, without a copy.

A graph reads its inputs at the addresses they had at capture. A value an eager step makes
(a splitting op's result) is a new tensor every call, so the runtime copied it into a buffer
of the graph's own: about 7 us of host time per split on the H200, a third of what a split
costs. A step that calls a custom op (one with a ``Piece.replay_fn``: ``pieces/direct.py``)
runs instead with its allocations in a private pool of the caching allocator (:class:`~torchreplay._compat.PrivateAllocations`):
it makes the same allocations in the same order every call, from a pool nobody else allocates
from, and gets the same block each time. The next graph is captured reading the step's output
where it was (a :class:`Handoff` instead of a buffer of its own).

The invariant: a graph replays only while a live tensor with the captured layout sits at the
address it reads. Each replay checks the value's address and layout (:meth:`Handoff.at`).
Where the value is elsewhere (a call on another stream, a step that allocated differently),
:meth:`Handoff.refill` takes the graph's block from the pool again and copies the value into
it, as before; where that block is taken, the call runs ungraphed from there, counted. After
:data:`MISSES` such calls the runtime drops its graphs and captures them again with buffers
of their own, as it did before this existed.

Not handed off: values a program returns, values that require grad, views, values a graph
writes in place, and every value of a training forward (its activations outlive the call).
Nor, since copy nodes (``_compat/copy_nodes.py``), small values: a step whose values for the
graphs are each at most :data:`NODE_BYTES` runs on the ordinary allocator at that size, and the
graphs copy them in by their own first nodes (:func:`hands_off`), which costs the host less.

.. warning:: While the step runs, all of its thread's allocations go to the private pool: a
    custom op that captured a CUDA graph of its own inside would put that graph's memory there.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from torchreplay import _compat
from torchreplay.core.io import graph_copyable
from torchreplay.pieces.program import Input, Piece, Program

__all__ = [
    "MISSES", "MOVED", "DEMOTED", "NODE_BYTES", "Expanded", "Handoff", "fill_expanded", "can_hand_off",
    "graph_reads", "handed_slots", "hands_off",
]

#: Calls whose handed-off value could not be put where the graph reads it before the runtime
#: captures its graphs again with buffers of their own (the previous copying way).
MISSES = 3
#: Why a call runs ungraphed from a graph whose handed-off input is elsewhere.
MOVED = (
    "the output of the eager step before it is not where the graph reads it, and that memory "
    "is taken (the step allocated differently than at capture)"
)
#: Why outputs handed out before the runtime captured again raise when read.
DEMOTED = (
    "the outputs of its eager steps kept moving; its graphs were captured again with buffers "
    "of their own"
)

#: An eager step whose values for the next graphs are each at most this many bytes (and the
#: graph can copy by its own first nodes: ``core/io.graph_copyable``) is not handed off at that
#: size: the graph's copy node costs a copy on the GPU (about a microsecond at this size, while
#: the GPU waits for the host anyway) and saves the private pool's three calls and the address
#: check, 1.6-3.5 us of host time per split on the H200 at 32 KiB, 4-5 us at 256 KiB to 4 MiB
#: (``benchmarks/handoff_vs_node.py``, RESULTS.md sessions 72-73). Larger values are handed off:
#: no copy of them on the GPU, no buffer of the graph's own.
NODE_BYTES = 1 << 20

_Tensor = torch.Tensor


def hands_off(values: Sequence[Any]) -> bool:
    """Does an eager step that made ``values`` (its outputs in slots a graph may read where
    they are: :func:`handed_slots`) hand them off, rather than have the graph copy them by its
    own nodes (:data:`NODE_BYTES`)? No tensor among them: nothing to hand off (no private pool)."""
    tensors = [v for v in values if isinstance(v, _Tensor)]
    return bool(tensors) and (any(t.nbytes > NODE_BYTES for t in tensors) or not graph_copyable(tensors))


def handed_slots(program: Program) -> dict[int, frozenset[int]]:
    """Per eager step that calls a custom op (it has a ``replay_fn``): the slots it writes that
    a graphed piece reads and the program does not return (candidates for a handoff)."""
    returned = {o for o in program.outputs if isinstance(o, int)}
    read = {r for p in program.pieces if p.graphed for r in p.reads}
    steps = {}
    for k, piece in enumerate(program.pieces):
        if piece.graphed or piece.replay_fn is None:
            continue
        slots = frozenset(w for w in piece.writes if w in read and w not in returned)
        if slots:
            steps[k] = slots
    return steps


def can_hand_off(value: Any) -> bool:
    """Can a graph read ``value`` (an eager step's output at capture) where it is?"""
    return (
        isinstance(value, _Tensor) and value.is_cuda and not value.requires_grad
        and value.storage_offset() == 0 and not value.is_sparse
    )


class Handoff:
    """Where a graph reads a value an eager step made: its address and layout at capture,
    the pool it came from and the stream it was allocated on."""

    __slots__ = ("ptr", "shape", "stride", "dtype", "alloc", "stream", "refills")

    def __init__(self, value: _Tensor, alloc: _compat.PrivateAllocations) -> None:
        self.ptr = value.data_ptr()
        self.shape = value.shape
        self.stride = value.stride()
        self.dtype = value.dtype
        self.alloc = alloc
        self.stream = torch.cuda.current_stream(value.device)
        self.refills = 0  # calls that found the value elsewhere and copied it back

    def at(self, value: Any) -> bool:
        """Is ``value`` where the graph reads, with the captured layout?"""
        return (
            value.data_ptr() == self.ptr and value.shape == self.shape
            and value.stride() == self.stride and value.dtype == self.dtype
        )

    def refill(self, value: Any) -> _Tensor | None:
        """A new tensor at the graph's address holding ``value`` (copied on the current
        stream); ``None`` when ``value`` has another shape or dtype, or the pool's block there
        is taken."""
        if not isinstance(value, _Tensor) or value.shape != self.shape or value.dtype != self.dtype:
            return None
        # The block belongs to the capture's stream. No record_stream for a call on another:
        # only this runtime's steps and refills take the block again, after this call's work
        # (on this stream, or on another one made to wait for it: core/threads.follow_stream).
        with torch.cuda.stream(self.stream):
            t = self.alloc.empty_strided(self.shape, self.stride, self.dtype)
            if t.data_ptr() < self.ptr:  # a free block from below (the step's scratch was
                gap = self.ptr - t.data_ptr()  # there): take the space before the graph's
                del t
                spacer = self.alloc.empty_strided(torch.Size((gap,)), (1,), torch.uint8)
                t = self.alloc.empty_strided(self.shape, self.stride, self.dtype)
                del spacer
        if t.data_ptr() != self.ptr:
            return None
        with torch.no_grad():
            _compat.copy_back(t, value)  # (an expanded layout: written once per location)
        self.refills += 1
        return t

    def __repr__(self) -> str:
        return f"Handoff({tuple(self.shape)}, {self.dtype}, at {self.ptr:#x})"


class Expanded:
    """A graph's own buffer of an expanded value an eager step made (an attention mask expanded
    over heads: stride 0), which a copy cannot write whole: each replay copies the value's
    elements once, through the buffer's dimensions narrowed to one element."""

    __slots__ = ("buf", "shape", "dtype", "dims", "held")

    def __init__(self, buf: _Tensor) -> None:
        self.buf = buf
        self.shape, self.dtype = buf.shape, buf.dtype
        self.dims = _compat.expanded_dims(buf)
        self.held = _compat.unexpanded(buf)

    def fill(self, value: Any) -> bool:
        """Copy ``value`` in; False (nothing copied) if it has another shape or dtype, or is
        not expanded where the buffer is (:func:`fill_expanded`)."""
        if value.shape != self.shape or value.dtype != self.dtype:
            return False
        return fill_expanded(self.held, self.dims, value)


def fill_expanded(held: _Tensor, dims: Sequence[int], value: _Tensor) -> bool:
    """Copy ``value`` into a buffer expanded along ``dims`` (``held``: the buffer narrowed to one
    element there), each location once; False (nothing copied) if ``value`` is not expanded
    there too: its elements along them may differ, where the graph reads one."""
    if any(value.stride(d) != 0 for d in dims):
        return False
    _compat.foreach_copy_untracked([held], [_compat.unexpanded(value, dims)])
    return True


def graph_reads(
    piece: Piece,
    vals: list[Any],
    inputs: Sequence[Input],
    from_eager: set[int],
    handed: set[int],
    alloc: _compat.PrivateAllocations | None,
) -> tuple[list[tuple[int, Any]], set[int]]:
    """How a piece about to be captured gets the values eager steps made, and what it writes.

    Returns ``copies``: per position in ``piece.reads``, a :class:`Handoff` (read where it is),
    a buffer of the graph's own with the value's strides (``vals`` is given the buffer: the
    capture reads it; :class:`Expanded` holds one with expanded dimensions) or a number the
    graph holds as captured; and the positions it writes in place.
    """
    # What the piece writes in place: each warm-up, and the replay after capture, start from
    # the values it got (a KV-cache counter advanced once per run would run past the end of
    # its cache); a value an eager step made is written in the graph's own buffer, copied back
    # after each replay.
    written = set(piece.written) | {
        pos for pos, r in enumerate(piece.reads) if r < len(inputs) and inputs[r].written
    }
    copies: list[tuple[int, Any]] = []
    for pos, r in enumerate(piece.reads):
        if alloc is not None and r in handed and pos not in written and can_hand_off(vals[pos]):
            copies.append((pos, Handoff(vals[pos], alloc)))
        elif r in from_eager and isinstance(vals[pos], _Tensor):
            with _compat.normal_tensors():  # replays copy into it, in either mode
                vals[pos] = buf = _compat.clone_strided(vals[pos])  # (Inductor's strides)
            copies.append((pos, Expanded(buf) if _compat.expanded_dims(buf) else buf))
        elif r in from_eager and isinstance(vals[pos], (int, float, bool)):
            copies.append((pos, vals[pos]))
    return copies, written
