"""CUDA streams: which one is current, without making a ``torch.cuda.Stream`` object."""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["current_stream"]


def _no_streams(index: int) -> tuple[int, int, int]:
    return (0, index, 0)


#: ``current_stream(index)``: the current CUDA stream on device ``index`` as ``(stream_id,
#: device_index, device_type)``, what ``torch.cuda.current_stream`` reads before it makes a
#: Stream object (every replay reads it: ``torch._C._cuda_getCurrentStream`` itself, no frame of
#: ours). A build without CUDA has no streams to tell apart: always ``(0, index, 0)``.
current_stream: Callable[[int], tuple[int, int, int]] = getattr(
    torch._C, "_cuda_getCurrentStream", _no_streams
)
