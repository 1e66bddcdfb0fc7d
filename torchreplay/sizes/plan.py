"""The arithmetic of many-size graphs, without CUDA: which size a call goes to, which argument
dimensions vary and with what they are padded, which output dimensions are sliced back, and what a
call whose size has no graph does.

:mod:`torchreplay.sizes.bucketed` runs these plans on the GPU; everything here works on any
tensors, so the CPU tests check it exactly. How outputs are sliced back is in
:mod:`torchreplay.sizes.outputs`.

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
from torchreplay.core.args import CallArgs
from torchreplay.errors import ReplayInputError

__all__ = [
    "default_sizes",
    "target_size",
    "format_sizes",
    "DimSpec",
    "InputPlan",
    "plan_inputs",
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
    """Per flattened argument leaf (in the order of :class:`~torchreplay.core.args.CallArgs`): its name in
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
    call: CallArgs,
    dim: DimSpec = 0,
    fill_value: FillSpec = 0,
) -> InputPlan:
    """Resolve ``dim`` and ``fill_value`` against the sample call's arguments.

    Args:
        call: the sample call, flattened (its parameter names name positional arguments).
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
    names = call.names
    nargs, kw_names = call.nargs, list(call.kw_keys)
    flat = list(zip(call.keypaths, call.leaves))
    paths = tuple(call.paths)

    if isinstance(dim, Mapping):
        dim_specs = _argument_specs(dim, "dim", nargs, kw_names, names)
    elif dim is None or _is_dim(dim):
        dim_specs = None
    else:
        raise ReplayInputError(
            f"dim must be an int, None, or a dict keyed by argument name (e.g. "
            f"{{'input_ids': 0, 'cache': None}}), got {dim!r}"
        )
    if isinstance(fill_value, Mapping):
        fill_specs = _argument_specs(fill_value, "fill_value", nargs, kw_names, names)
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
