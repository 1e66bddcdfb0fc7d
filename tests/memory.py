"""Device memory as the GPU tests measure it."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

import torch

from torchreplay import _compat


def reserved() -> int:
    """Reserved bytes after freeing the cache and torch's cuBLAS workspaces.

    torch keeps a cuBLAS workspace per stream that used a matmul; our captures clear them (so a
    graph owns the workspace it recorded, see ``_compat.clear_cublas_workspaces``) and the next
    eager matmul makes one again. That cache is not memory of any graph, so it is left out: a
    baseline taken with workspaces left by earlier tests (torch's own graph tests leave several)
    would otherwise drop when the next capture clears them.
    """
    gc.collect()
    torch.cuda.synchronize()
    _compat.clear_cublas_workspaces()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """Python's cyclic collector off inside the block, after one collection: what a ``del``
    there frees, reference counting freed (no reference cycle left it to a later collection)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
