"""The arithmetic of many-size graphs, without CUDA: which size a call goes to, which argument
dimensions vary and with what they are padded, which output dimensions are sliced back, and what a
call whose size has no graph does.

:mod:`torchreplay.buckets` runs these plans on the GPU; everything here works on any tensors, so
the CPU tests check it exactly.

Vocabulary: a call's *size* ``n`` is the length of its varying dimensions (all varying dimensions
share it); the graph that serves it was captured at the *target* size ``s``, the smallest captured
size ``>= n``; rows ``n .. s-1`` are *padding* and hold a fill value.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any, Callable, Collection, Literal, Mapping, Sequence, Union

import torch

from torchreplay import _compat
from torchreplay.config import BucketConfig
from torchreplay.errors import ReplayInputError, UnsupportedError
from torchreplay.io import _format_path, _param_names, _same_constant

__all__ = [
    "default_sizes",
    "target_size",
    "format_sizes",
    "DimSpec",
    "InputPlan",
    "plan_inputs",
    "OutputLeaf",
    "OutputPlan",
    "plan_outputs",
    "narrow_leading",
    "Decision",
    "decide",
]

#: ``dim=``: one int for every tensor argument, or a dict keyed by parameter name (or positional
#: index) whose values are an int, ``None`` (static: does not vary) or a nested spec matching the
#: argument's containers.
DimSpec = Union[int, None, Mapping[Union[str, int], Any]]
#: ``fill_value=``: one number for every varying argument, or a dict keyed like ``dim``.
FillSpec = Union[int, float, bool, Mapping[Union[str, int], Any]]

_Tensor = torch.Tensor


def default_sizes(max_size: int = 512) -> list[int]:
    """Return the usual sizes to capture: ``1, 2, 4``, then multiples of 8 up to ``max_size``.

    ``max_size`` itself is included when it is not a multiple of 8, so every size up to it has a
    graph. ``default_sizes(512)`` has 67 sizes. These are the sizes vLLM captures for decoding:
    small batches are common and each doubling up to 8 matters; above 8, padding a call by at
    most 7 rows wastes little.

    Args:
        max_size: the largest size; calls above it are handled by ``fallback``.

    Returns:
        the sizes, ascending.
    """
    if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
        raise ValueError(f"max_size must be an int >= 1, got {max_size!r}")
    sizes = [s for s in (1, 2, 4) if s <= max_size] + list(range(8, max_size + 1, 8))
    if sizes[-1] != max_size:
        sizes.append(max_size)
    return sizes


def target_size(sizes: Sequence[int], n: int) -> int | None:
    """Return the smallest of the ascending ``sizes`` that is ``>= n``; ``None`` when none is, or
    when ``n < 1``."""
    if n < 1:
        return None
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def format_sizes(sizes: Collection[int], limit: int = 8) -> str:
    """``'1, 2, 4, 8'``; long lists keep both ends: ``'1, 2, 4, 8, ..., 504, 512 (67 sizes)'``."""
    ordered = sorted(sizes)
    if len(ordered) <= limit:
        return ", ".join(map(str, ordered))
    head, tail = ordered[: limit - 2], ordered[-2:]
    return f"{', '.join(map(str, head))}, ..., {', '.join(map(str, tail))} ({len(ordered)} sizes)"


def narrow_leading(t: torch.Tensor, dims: Sequence[int], n: int) -> torch.Tensor:
    """Return the view of ``t`` that keeps the first ``n`` entries along each of ``dims``."""
    for d in dims:
        if t.shape[d] != n:
            t = t.narrow(d, 0, n)
    return t


# -- inputs -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class InputPlan:
    """Per flattened argument leaf (in the order of :class:`~torchreplay.io.Inputs`): its name in
    messages, its varying dimension and its fill value.

    Attributes:
        paths: ``"args[0] 'x'"``, ``"kwargs['mask']"``, ...
        dims: the varying dimension (>= 0) of each leaf; ``None`` for static tensors and constants.
        fills: the padding value of each varying leaf; ``None`` elsewhere.
        lead: the index of the first varying leaf, whose dimension gives a call's size.
        size: the size of the sample call.
    """

    paths: tuple[str, ...]
    dims: tuple[int | None, ...]
    fills: tuple[int | float | bool | None, ...]
    lead: int
    size: int

    @property
    def varying(self) -> list[int]:
        """Indices of the varying leaves."""
        return [i for i, d in enumerate(self.dims) if d is not None]

    def where(self, i: int | None = None) -> str:
        """``"args[0] 'x' along dim 0"``: where a call's size is read (leaf ``i``, default the lead)."""
        i = self.lead if i is None else i
        return f"{self.paths[i]} along dim {self.dims[i]}"

    def shape_at(self, shape: Sequence[int], i: int, n: int) -> torch.Size:
        """``shape`` of leaf ``i`` with its varying dimension set to ``n``."""
        d = self.dims[i]
        assert d is not None
        out = list(shape)
        out[d] = n
        return torch.Size(out)


def _top(path: Sequence[Any]) -> tuple[bool, int | str, tuple[Any, ...]]:
    """Split a key path of ``(args, kwargs)`` into (is keyword, index or name, path inside)."""
    is_kw = getattr(path[0], "idx", 0) == 1
    key = path[1].key if is_kw else path[1].idx
    return is_kw, key, tuple(path[2:])


def _argument_specs(
    spec: Mapping[Any, Any],
    option: str,
    nargs: int,
    kw_names: Collection[str],
    names: Sequence[str],
) -> dict[tuple[bool, int | str], Any]:
    """Map a dict spec's keys (parameter names or positions) to the arguments of the sample call."""
    out: dict[tuple[bool, int | str], Any] = {}
    given: dict[tuple[bool, int | str], Any] = {}
    for key, value in spec.items():
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise ReplayInputError(
                f"{option}: key {key!r} must be a parameter name or a positional index"
            )
        if isinstance(key, int):
            if not 0 <= key < nargs:
                raise ReplayInputError(
                    f"{option} names positional argument {key}, but the sample call has "
                    f"{nargs} positional arguments; use an index below {nargs} or a parameter name"
                )
            target: tuple[bool, int | str] = (False, key)
        elif key in kw_names:
            target = (True, key)
        elif key in names[:nargs]:
            target = (False, names.index(key))
        else:
            known = [*names[:nargs], *kw_names]
            hint = (
                f"; '{key}' is a parameter of the function but the sample call does not pass it"
                if key in names
                else ""
            )
            raise ReplayInputError(
                f"{option} names '{key}', which is not an argument of the sample call "
                f"(arguments: {', '.join(repr(k) for k in known) or 'none'}){hint}; "
                "name the arguments as the call passes them"
            )
        if target in given:
            raise ReplayInputError(
                f"{option} gives positional argument {target[1]} twice, as {given[target]!r} "
                f"and as {key!r}; keep one"
            )
        given[target] = key
        out[target] = value
    return out


def _walk(node: Any, keys: Sequence[Any], where: str, option: str, is_value: Callable[[Any], bool]) -> Any:
    """Follow ``keys`` (a pytree key path inside one argument) down a nested spec.

    A value (or None) applies to everything below it; a dict spec leaves out what is static.
    """
    for depth, k in enumerate(keys):
        if node is None or is_value(node):
            return node  # one value for everything below
        if hasattr(k, "idx"):
            ok = isinstance(node, (list, tuple)) and k.idx < len(node)
            nxt = node[k.idx] if ok else None
        elif hasattr(k, "key"):
            # A dict spec may leave entries out, like the top level: they are static.
            ok = isinstance(node, Mapping)
            nxt = node.get(k.key) if ok else None
        elif hasattr(k, "name"):
            if isinstance(node, Mapping):
                ok, nxt = True, node.get(k.name)
            else:
                ok, nxt = hasattr(node, k.name), getattr(node, k.name, None)
        else:  # pragma: no cover - a key kind torch may add
            ok, nxt = False, None
        if not ok:
            at = _compat.keystr(list(keys[: depth + 1]))
            raise ReplayInputError(
                f"{option} for {where}: the spec {node!r} has no entry for {at}; give the "
                "argument's containers the same structure in the spec, or one value for all of it"
            )
        node = nxt
    if node is not None and not is_value(node):
        raise ReplayInputError(
            f"{option} for {where}: expected a value, got {node!r}, which goes deeper than the "
            "argument; give one value for this tensor"
        )
    return node


def _is_dim(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_fill(v: Any) -> bool:
    return isinstance(v, (int, float, bool))


def plan_inputs(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    dim: DimSpec = 0,
    fill_value: FillSpec = 0,
) -> InputPlan:
    """Resolve ``dim`` and ``fill_value`` against the sample call's arguments.

    Args:
        fn: the callable (its signature names positional arguments).
        args, kwargs: the sample call.
        dim: one int for every tensor argument; or a dict keyed by parameter name (or positional
            index) with an int, ``None`` (static) or a nested spec per argument. Arguments a dict
            does not name are static.
        fill_value: the padding value, one for every varying argument or a dict keyed like ``dim``
            (arguments it does not name are padded with 0).

    Returns:
        the plan, per flattened leaf.

    Raises:
        ReplayInputError: a spec names an unknown argument, a dim is out of range or lands on a
            non-tensor, no argument varies, or the sample's varying dimensions disagree.
    """
    names = _param_names(fn)
    flat, _ = _compat.tree_flatten_with_path((tuple(args), dict(kwargs)))
    paths = tuple(_format_path(p, names) for p, _ in flat)

    if isinstance(dim, Mapping):
        dim_specs = _argument_specs(dim, "dim", len(args), list(kwargs), names)
    elif dim is None or _is_dim(dim):
        dim_specs = None
    else:
        raise ReplayInputError(
            f"dim must be an int, None, or a dict keyed by argument name (e.g. "
            f"{{'input_ids': 0, 'cache': None}}), got {dim!r}"
        )
    if isinstance(fill_value, Mapping):
        fill_specs = _argument_specs(fill_value, "fill_value", len(args), list(kwargs), names)
    elif _is_fill(fill_value):
        fill_specs = None
    else:
        raise ReplayInputError(
            f"fill_value must be a number, or a dict keyed by argument name, got {fill_value!r}"
        )

    dims: list[int | None] = []
    fills: list[int | float | bool | None] = []
    for (path, leaf), where in zip(flat, paths):
        is_kw, key, inner = _top(path)
        if dim_specs is None:
            d = dim if isinstance(leaf, _Tensor) else None
        else:
            d = _walk(dim_specs.get((is_kw, key)), inner, where, "dim", _is_dim)
            if d is not None and not isinstance(leaf, _Tensor):
                if inner or not isinstance(dim_specs.get((is_kw, key)), int):
                    d = None  # a container's non-tensor leaves never vary
                else:
                    raise ReplayInputError(
                        f"dim gives {where} the varying dim {d}, but it is "
                        f"{type(leaf).__name__} {leaf!r}, not a tensor: only tensors vary; "
                        "leave it out of dim (non-tensors are captured as constants)"
                    )
        if d is not None:
            d = _normalize_dim(d, leaf, where)
        dims.append(d)
        if d is None:
            fills.append(None)
            continue
        if fill_specs is None:
            f = fill_value
        else:
            f = _walk(fill_specs.get((is_kw, key), 0), inner, where, "fill_value", _is_fill)
            f = 0 if f is None else f
        fills.append(_check_fill(f, leaf, where))

    varying = [i for i, d in enumerate(dims) if d is not None]
    if not varying:
        raise ReplayInputError(
            f"dim={dim!r} makes no tensor argument vary, but sizes= pads and slices a varying "
            "dimension: give the varying dim of at least one tensor argument (e.g. dim=0), or "
            "graph without sizes="
        )
    if fill_specs is not None:
        for (is_kw, key) in fill_specs:
            if not any(_top(flat[i][0])[:2] == (is_kw, key) for i in varying):
                arg = f"kwargs['{key}']" if is_kw else f"args[{key}]"
                raise ReplayInputError(
                    f"fill_value names {arg}, which does not vary (its dim is None); padding "
                    "fills only varying arguments: give it a dim or leave it out of fill_value"
                )
    lead = varying[0]
    size = flat[lead][1].shape[dims[lead]]
    for i in varying[1:]:
        other = flat[i][1].shape[dims[i]]  # type: ignore[index]
        if other != size:
            raise ReplayInputError(
                disagreement_message(paths[lead], dims[lead], size, paths[i], dims[i], other)
                + " (in the sample call)"
            )
    return InputPlan(paths, tuple(dims), tuple(fills), lead, size)


def disagreement_message(
    path_a: str, dim_a: int | None, size_a: int, path_b: str, dim_b: int | None, size_b: int
) -> str:
    """The error text for two varying dimensions of one call that have different sizes."""
    return (
        f"{path_a} has size {size_a} along dim {dim_a} but {path_b} has size {size_b} along "
        f"dim {dim_b}; all varying dimensions share one size per call: pass them with the same "
        "size, or mark the one that does not vary None in dim"
    )


def _normalize_dim(d: int, leaf: torch.Tensor, where: str) -> int:
    nd = leaf.dim()
    if nd == 0:
        raise ReplayInputError(
            f"dim {d} for {where}: it is a 0-dim tensor, which has no dimension to vary; give dim "
            "as a dict and mark it None (e.g. dim={'x': 0, 'scale': None})"
        )
    if not -nd <= d < nd:
        raise ReplayInputError(
            f"dim {d} is out of range for {where} (shape {tuple(leaf.shape)}, {nd} dims); give "
            f"a dim in [{-nd}, {nd - 1}]"
        )
    return d % nd


def _check_fill(f: Any, leaf: torch.Tensor, where: str) -> int | float | bool:
    if leaf.dtype.is_floating_point or leaf.dtype.is_complex:
        return f
    if leaf.dtype == torch.bool:
        if f not in (0, 1):
            raise ReplayInputError(
                f"fill_value {f!r} for {where} (bool): give True, False, 0 or 1"
            )
        return bool(f)
    if isinstance(f, float) and not f.is_integer():
        raise ReplayInputError(
            f"fill_value {f!r} for {where} ({str(leaf.dtype).removeprefix('torch.')}) is not a "
            "whole number; give an int (a valid index or id, e.g. 0 or a padding token)"
        )
    return int(f)


# -- outputs ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OutputLeaf:
    """How one output leaf is handed back at a size.

    ``kind``:
        ``"owned"``: a tensor the call computes; each graph copies it into the shared output
        buffer (``shape`` at the largest size), and calls get its leading slice.
        ``"external"``: a tensor of the module's state or a static argument's buffer (a KV cache
        updated in place); returned as it is, sliced along ``dims``.
        ``"constant"``: a non-tensor value, returned as it is.
        ``"size"``: a Python int equal to the size; returned as the call's size.
    """

    kind: Literal["owned", "external", "constant", "size"]
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
            if plan.kind in ("owned", "external"):
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
) -> OutputPlan:
    """Learn how outputs are sliced from the callable's outputs at two sizes.

    A tensor dimension is sliced when it equals the size at both sizes; every other dimension
    must be the same at both.

    Args:
        big_out: the output at size ``big`` (the largest size).
        small_out, small: the output at another size ``small < big``; ``small=None`` when only
            one size exists and it is 1 (nothing is ever sliced then).
        is_external: True for a tensor whose memory is the module's state or a static argument.

    Raises:
        UnsupportedError: the outputs at the two sizes differ in structure, in a non-tensor value
            (other than the size itself), or in a dimension that does not equal the size.
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
            if small is not None and not _same_constant(a, b):
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


# -- what a call of each size does ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Decision:
    """What a call of size ``n`` does.

    ``action``: ``"replay"`` the graph of ``size``; ``"capture"`` it first (lazy); run ``"eager"``
    (``message`` is the warning); or ``"error"`` (``message`` is the error).
    ``reason``: for eager and error: ``"above"`` the largest size, ``"zero"`` rows, or the
    ``"cap"`` on graphs held.
    """

    action: Literal["replay", "capture", "eager", "error"]
    size: int | None = None
    reason: str = ""
    message: str = ""


def decide(
    options: BucketConfig,
    n: int,
    captured: Collection[int],
    *,
    name: str = "fn",
    where: str = "dim 0",
) -> Decision:
    """Decide what a call of size ``n`` does, given the sizes already captured.

    Args:
        options: sizes, capture mode, fallback policy and graph cap.
        n: the call's size.
        captured: the sizes that have a graph now.
        name, where: the callable and the argument that gives the size, for messages.
    """
    s = target_size(options.sizes, n)
    largest = options.sizes[-1]
    eager = options.fallback == "eager"
    if s is None:
        if n < 1:
            if eager:
                return Decision(
                    "eager",
                    None,
                    "zero",
                    f"torchreplay: '{name}' got size 0 ({where}); an empty call has no graph, "
                    "running it eagerly (counted in stats.fallbacks)",
                )
            return Decision(
                "error",
                None,
                "zero",
                f"'{name}' got size 0 ({where}); an empty call has no graph: skip empty calls, "
                "or pass fallback='eager'",
            )
        if eager:
            return Decision(
                "eager",
                None,
                "above",
                f"torchreplay: '{name}' got size {n} ({where}), above the largest captured "
                f"size {largest} (sizes: {format_sizes(options.sizes)}); running it eagerly "
                f"(counted in stats.fallbacks; warned once per size). Add {n} to sizes to "
                "graph it",
            )
        return Decision(
            "error",
            None,
            "above",
            f"'{name}' got size {n} ({where}) but the largest captured size is {largest}; "
            f"add {n} to sizes or pass fallback='eager'",
        )
    if s in captured:
        return Decision("replay", s)
    cap = options.max_graphs
    if options.capture == "lazy" and (cap is None or len(captured) < cap):
        return Decision("capture", s)
    held = f"max_graphs={cap} graphs are held (sizes {format_sizes(captured)})"
    if eager:
        return Decision(
            "eager",
            s,
            "cap",
            f"torchreplay: '{name}' got size {n} ({where}), which needs a graph of size {s}, "
            f"but {held}; running it eagerly (counted in stats.fallbacks; warned once per "
            "size). Raise max_graphs to graph it",
        )
    return Decision(
        "error",
        s,
        "cap",
        f"'{name}' got size {n} ({where}), which needs a graph of size {s}, but {held}; "
        "raise max_graphs or pass fallback='eager'",
    )
