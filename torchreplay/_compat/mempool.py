"""A private pool of the caching allocator for the eager steps between graphs.

Why: an eager step between two graphs (a splitting op) returns a new tensor, and the next
graph reads its input at the address it had at capture, so the runtime used to copy the step's
output into a buffer of its own every call (about 7 us of host time on the H200). Run in a
pool of its own, a step makes the same allocations in the same order every call, and the
caching allocator hands it the same block each time: the next graph can read the step's output
where it is. :class:`PrivateAllocations` routes one thread's allocations to such a pool while
a function runs; the runtime checks at every replay that the output is where the graph reads
(``pieces/handoff.py``).

Private torch API: ``torch._C._cuda_beginAllocateCurrentThreadToPool``, ``_cuda_endAllocateToPool``
and ``_cuda_releasePool``, the three calls of the public ``torch.cuda.use_mem_pool`` without its
two Python frames and its ``current_device`` call (about 1.3 us for the three on the H200 host,
against about 7 us for the copy they save). A torch without them (or without
``torch.cuda.MemPool``): :func:`private_allocations` returns ``None`` and the runtime copies as
before.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["PrivateAllocations", "private_allocations"]

_begin = getattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool", None)
_end = getattr(torch._C, "_cuda_endAllocateToPool", None)
_release = getattr(torch._C, "_cuda_releasePool", None)


class PrivateAllocations:
    """A ``torch.cuda.MemPool`` on one device that functions can allocate from.

    Args:
        index: the CUDA device's index.

    .. warning:: Only the calling thread's allocations go to the pool, and all of them, a CUDA
        graph captured inside the function included: route only functions that capture nothing
        (an eager step that calls a custom op).
    """

    def __init__(self, index: int) -> None:
        self.index = index
        self.pool = torch.cuda.MemPool()
        self.id = self.pool.id

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Return ``fn`` with the calling thread's allocations routed to the pool."""
        index, pid = self.index, self.id
        begin, end, release = _begin, _end, _release

        def in_pool(*args: Any) -> Any:
            begin(index, pid)  # type: ignore[misc]
            try:
                return fn(*args)
            finally:
                end(index, pid)  # type: ignore[misc]
                release(index, pid)  # type: ignore[misc]

        in_pool.__name__ = in_pool.__qualname__ = "in_pool_" + getattr(fn, "__name__", "fn")
        return in_pool

    def empty_strided(
        self, size: torch.Size, stride: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """A new tensor in the pool, on the current stream."""
        device = torch.device("cuda", self.index)
        return self.wrap(lambda: torch.empty_strided(size, stride, dtype=dtype, device=device))()

    def __repr__(self) -> str:
        return f"PrivateAllocations(cuda:{self.index}, pool={self.id})"


def private_allocations(index: int) -> PrivateAllocations | None:
    """A private pool on device ``index``; ``None`` where this torch cannot route to one."""
    if None in (_begin, _end, _release) or not hasattr(torch.cuda, "MemPool"):
        return None
    try:
        return PrivateAllocations(index)
    except (RuntimeError, TypeError):  # a build or allocator backend without private pools
        return None
