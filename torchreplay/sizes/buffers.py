"""The static input buffers of a many-size graph: the sample padded to the largest size."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["pad_sample"]


def pad_sample(leaf: torch.Tensor, d: int, size: int, fill: Any) -> torch.Tensor:
    """The sample argument grown (or cut) to ``size`` along ``d``, the new rows set to ``fill``."""
    shape = list(leaf.shape)
    shape[d] = size
    channels_last = (
        leaf.dim() == 4
        and not leaf.is_contiguous()
        and leaf.is_contiguous(memory_format=torch.channels_last)
    )
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.empty(shape, dtype=leaf.dtype, device=leaf.device, memory_format=fmt)
    rows = min(leaf.shape[d], size)
    out.narrow(d, 0, rows).copy_(leaf.narrow(d, 0, rows))
    if rows < size:
        out.narrow(d, rows, size - rows).fill_(fill)
    return out
