"""Calls grown to more rows than they have: the sample a many-size graph's static buffers are
made from, and a call run eagerly at the size the ranks agreed on.

When ranks whose graphs hold collectives agree that every rank runs a call without graphs (one
rank's call is above the largest captured size), each rank's rows may still differ, and a
collective inside the callable would then be launched with other shapes on each rank: NCCL
hangs. :func:`run_padded` runs the call at the agreed rows instead, padded with the fill value
as a replay pads, so every rank launches the same shapes; the call gets its own rows back.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from torchreplay import _compat
from torchreplay.core.io import write_back

__all__ = ["flat_call", "pad_sample", "run_padded"]


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
    with _compat.normal_tensors():  # its version counter tells what a call wrote
        out = torch.empty(shape, dtype=leaf.dtype, device=leaf.device, memory_format=fmt)
    rows = min(leaf.shape[d], size)
    out.narrow(d, 0, rows).copy_(leaf.narrow(d, 0, rows))
    if rows < size:
        out.narrow(d, rows, size - rows).fill_(fill)
    return out


def flat_call(fn: Callable[..., Any], spec: Any) -> Callable[[list[Any]], list[Any]]:
    """``fn`` as a function of the flat leaves of its ``(args, kwargs)`` (pytree ``spec``) to
    the flat leaves of its output."""

    def call(leaves: list[Any]) -> list[Any]:
        args, kwargs = _compat.tree_unflatten(leaves, spec)
        return _compat.tree_flatten(fn(*args, **kwargs))[0]

    return call


def run_padded(
    call: Callable[[list[Any]], Sequence[Any]],
    leaves: Sequence[Any],
    n: int,
    size: int,
    dims: Sequence[int | None],
    fills: Sequence[Any],
    out_dims: Sequence[Sequence[int] | str],
    sizes: Sequence[bool] = (),
) -> list[Any]:
    """``call`` (without autograd) on ``leaves`` whose varying dimension ``dims[i]`` is padded
    from ``n`` to ``size`` rows with ``fills[i]``; an int leaf marked in ``sizes`` (it is the
    size) is set to ``size``.

    What the call wrote into a padded tensor reaches the caller's tensor (its ``n`` rows), as
    in eager. Returns ``call``'s flat outputs, each cut back to ``n`` along its ``out_dims``
    (``"size"``: an int output that is the call's size, given back as ``n``); a padded argument
    returned is the caller's tensor (a view of one: of the padded copy, its ``n`` rows).
    """
    padded = list(leaves)
    versions: list[tuple[int, int]] = []
    for i, (leaf, d) in enumerate(zip(leaves, dims)):
        if d is not None and isinstance(leaf, torch.Tensor) and leaf.shape[d] != size:
            padded[i] = pad_sample(leaf, d, size, fills[i])
            versions.append((i, padded[i]._version))
        elif i < len(sizes) and sizes[i]:
            padded[i] = size
    with torch.no_grad():
        out = list(call(padded))
    changed = [i for i, v in versions if padded[i]._version != v]
    write_back([leaves[i] for i in changed], [padded[i].narrow(dims[i], 0, n) for i in changed])
    grown = {id(padded[i]): i for i, _ in versions}
    for k, dims_k in enumerate(out_dims[:len(out)]):
        value = out[k]
        if id(value) in grown:  # an argument returned: the caller's tensor, as eagerly
            out[k] = leaves[grown[id(value)]]
        elif dims_k == "size":
            out[k] = n
        elif isinstance(value, torch.Tensor):
            for d in dims_k:
                if value.shape[d] == size:
                    value = value.narrow(d, 0, n)
            out[k] = value
    return out
