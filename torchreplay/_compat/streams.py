"""CUDA streams: which one is current, without making a ``torch.cuda.Stream`` object."""

from __future__ import annotations

import torch

__all__ = ["current_stream_id"]

_current_stream = getattr(torch._C, "_cuda_getCurrentStream", None)


def current_stream_id(index: int) -> int:
    """The id of the current CUDA stream on device ``index``: what ``torch.cuda.current_stream(
    index).stream_id`` says, without making the Stream object (every replay reads it).
    ``torch._C._cuda_getCurrentStream`` returns ``(stream_id, device_index, device_type)``; a
    build without CUDA has no streams to tell apart: 0."""
    if _current_stream is None:
        return 0
    return _current_stream(index)[0]  # type: ignore[no-any-return]
