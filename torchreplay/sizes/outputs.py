"""How the outputs of a many-size graph are handed back: learned from eager calls at two sizes,
which output dimensions equal the size (sliced back to a call's rows), which outputs are new
tensors (copied into the shared output buffers) and which are module state or constants.

Pure arithmetic on tensors' shapes, so the CPU tests check it exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal, Sequence

import torch

from torchreplay import _compat
from torchreplay.core.io import same_constant
from torchreplay.errors import UnsupportedError

__all__ = ["OutputLeaf", "OutputPlan", "plan_outputs"]

_Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class OutputLeaf:
    """How one output leaf is handed back at a size.

    ``kind``:
        ``"owned"``: a tensor the call computes; each graph copies it into the shared output
        buffer (``shape`` at the largest size), and calls get its leading slice.
        ``"external"``: a tensor of the module's state or a view of an argument's buffer (a KV
        cache updated in place, ``x[:, -1:]``); returned as it is, sliced along ``dims`` (a view
        of an argument: as that view of the caller's tensor, by :class:`Outputs`).
        ``"constant"``: a non-tensor value, returned as it is.
        ``"size"``: a Python int equal to the size; returned as the call's size.
        ``"argument"``: an argument itself (``return h, mask``; ``value``: its leaf index);
        under ``checked`` returned as the caller's tensor, as eagerly.
    """

    kind: Literal["owned", "external", "constant", "size", "argument"]
    path: str
    dims: tuple[int, ...] = ()
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    value: Any = None

    def shape_at(self, n: int) -> tuple[int, ...]:
        """The leaf's shape in a call of size ``n``."""
        out = list(self.shape)
        for d in self.dims:
            out[d] = n
        return tuple(out)


@dataclasses.dataclass(frozen=True)
class OutputPlan:
    """The output structure and how each leaf is handed back (see :class:`OutputLeaf`)."""

    spec: Any
    leaves: tuple[OutputLeaf, ...]
    size: int  # the size the shapes are given at

    @property
    def owned(self) -> list[int]:
        return [i for i, leaf in enumerate(self.leaves) if leaf.kind == "owned"]

    @property
    def external(self) -> list[int]:
        return [i for i, leaf in enumerate(self.leaves) if leaf.kind == "external"]

    def mismatch(self, out: Any, n: int) -> str | None:
        """Return why ``out`` (the callable's output at size ``n``) does not fit the plan, or None."""
        leaves, spec = _compat.tree_flatten(out)
        if spec != self.spec:
            return f"the output structure {spec} differs from {self.spec} at size {self.size}"
        for leaf, plan in zip(leaves, self.leaves):
            if plan.kind in ("owned", "external", "argument"):
                if not isinstance(leaf, _Tensor):
                    return f"{plan.path} is {type(leaf).__name__}, not a tensor as at size {self.size}"
                if tuple(leaf.shape) != plan.shape_at(n) or leaf.dtype != plan.dtype:
                    return (
                        f"{plan.path} has shape {tuple(leaf.shape)} {leaf.dtype} at size {n}; "
                        f"expected {plan.shape_at(n)} {plan.dtype} from its shape at size {self.size}"
                    )
        return None


def plan_outputs(
    big_out: Any,
    big: int,
    small_out: Any,
    small: int | None,
    is_external: Callable[[torch.Tensor], bool],
    big_args: Sequence[Any] = (),
    small_args: Sequence[Any] = (),
    arg_paths: Sequence[str] = (),
) -> OutputPlan:
    """Learn how outputs are sliced from the callable's outputs at two sizes.

    A tensor dimension is sliced when it equals the size at both sizes; every other dimension
    must be the same at both.

    Args:
        big_out: the output at size ``big`` (the largest size).
        small_out, small: the output at another size ``small < big``; ``small=None`` when only
            one size exists and it is 1 (nothing is ever sliced then).
        is_external: True for a tensor whose memory is the module's state or a static argument.
        big_args, small_args: the argument leaves of the two calls: an output that is the same
            argument in both is of kind ``"argument"``; ``arg_paths``: their names.

    Raises:
        UnsupportedError: the outputs at the two sizes differ in structure, in a non-tensor value
            (other than the size itself), or in a dimension that does not equal the size; or an
            output is a view of an argument at a place that moves with the size (its last rows).
    """
    flat, spec = _compat.tree_flatten_with_path(big_out)
    paths = ["output" + _compat.keystr(p) for p, _ in flat]
    big_leaves = [leaf for _, leaf in flat]
    if small is not None:
        small_leaves, small_spec = _compat.tree_flatten(small_out)
        if small_spec != spec:
            raise UnsupportedError(
                f"the output structure differs between size {big} ({spec}) and size {small} "
                f"({small_spec}); a graph with sizes= needs the same structure at every size"
            )
    else:
        small_leaves = big_leaves
    leaves: list[OutputLeaf] = []
    for path, a, b in zip(paths, big_leaves, small_leaves):
        if isinstance(a, _Tensor):
            if not isinstance(b, _Tensor) or a.dim() != b.dim() or a.dtype != b.dtype:
                raise UnsupportedError(
                    f"{path} is {_describe(a)} at size {big} but {_describe(b)} at size {small}; "
                    "a graph with sizes= needs the same kind of output at every size"
                )
            dims: tuple[int, ...] = ()
            if small is not None:
                dims = tuple(
                    d for d in range(a.dim()) if a.shape[d] == big and b.shape[d] == small
                )
                other = [d for d in range(a.dim()) if d not in dims and a.shape[d] != b.shape[d]]
                if other:
                    raise UnsupportedError(
                        f"{path} has shape {tuple(a.shape)} at size {big} but {tuple(b.shape)} at "
                        f"size {small}: dim {other[0]} changes with the size without being equal "
                        "to it, so it cannot be sliced back; return outputs whose size-dependent "
                        "dimensions equal the size (e.g. [B, ...], not flattened to [B * T])"
                    )
            j = next((j for j, x in enumerate(big_args) if x is a), None)
            if j is not None and (small_args[j] if small is not None else a) is b:
                leaves.append(OutputLeaf("argument", path, dims, tuple(a.shape), a.dtype, value=j))
                continue
            if small is not None:
                _refuse_moving_view(path, a, b, big, small, big_args, small_args, arg_paths)
            external = is_external(a)
            if small is not None and is_external(b) != external:
                raise UnsupportedError(
                    f"{path} is module state at one size and a new tensor at the other; return "
                    "the same kind of tensor at every size"
                )
            leaves.append(
                OutputLeaf(
                    "external" if external else "owned",
                    path,
                    dims,
                    tuple(a.shape),
                    a.dtype,
                )
            )
        elif small is not None and type(a) is int and a == big and type(b) is int and b == small:
            leaves.append(OutputLeaf("size", path))
        else:
            if small is not None and not same_constant(a, b):
                raise UnsupportedError(
                    f"{path} is {a!r} at size {big} but {b!r} at size {small}; a non-tensor output "
                    "is captured as a constant and must not depend on the size: return a tensor"
                )
            leaves.append(OutputLeaf("constant", path, value=a))
    return OutputPlan(spec, tuple(leaves), big)


def _describe(x: Any) -> str:
    if isinstance(x, _Tensor):
        return f"a {x.dim()}-dim {str(x.dtype).removeprefix('torch.')} tensor"
    return type(x).__name__


def _refuse_moving_view(
    path: str, a: _Tensor, b: _Tensor, big: int, small: int,
    big_args: Sequence[Any], small_args: Sequence[Any], arg_paths: Sequence[str],
) -> None:
    """Raise for an output that views an argument where the view starts at a place that moves
    with the size (``x[-1:]``, the last row): a padded call would hand back padding rows. Other
    outputs that read such rows are computed, so nothing here can see them (README: padding is
    correct only when rows are independent)."""
    ptr = a.untyped_storage().data_ptr()
    for j, (x, y) in enumerate(zip(big_args, small_args)):
        if not (isinstance(x, _Tensor) and isinstance(y, _Tensor)) or x.untyped_storage().data_ptr() != ptr:
            continue
        at_big, at_small = a.storage_offset() - x.storage_offset(), b.storage_offset() - y.storage_offset()
        if at_big != at_small:
            name = arg_paths[j] if j < len(arg_paths) else f"argument {j}"
            raise UnsupportedError(
                f"{path} is a view of {name} that starts at element {at_big} at size {big} but "
                f"{at_small} at size {small}: it moves with the size (the last rows, x[-1:]), so a "
                "call padded to a larger size would return padding rows. Return rows whose place "
                "does not depend on the size (x[:, -1:] is fine along a varying dim 0), or pick "
                "the rows with the real count passed as a tensor"
            )
