"""Which sizes of a Dynamo graph ``sizes=`` pads (the compile backend's ``build_program``): the
padded symbol, the inputs padded along with it, the leading rows of fixed-size buffers, and
whether every output keeps a padded size or a fixed one."""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
import torch.fx as fx

from torchreplay import _compat
from torchreplay.compile.split import node_value
from torchreplay.config import CompileConfig

__all__ = ["padded_symbol", "alongside", "dim_of", "follows", "leading_rows", "paddable"]


def padded_symbol(placeholders: list[fx.Node], example_inputs: Sequence[Any], cfg: CompileConfig) -> Any:
    """The symbol of dimension ``cfg.dim`` of the first tensor input where that dimension is
    dynamic (not the first tensor input: a function's closure tensors, its weights, come
    before its arguments when it reads them first), or None.

    A graph with no such tensor may still take the size itself: Dynamo's graph after a graph
    break gets ``x.shape[0]`` of the caller's ``x`` as an int input (``s0``) when it reads it
    (``self.rows[: x.shape[0]] * 2``). Such an int is the padded size where Dynamo says it is
    dimension ``cfg.dim`` of a tensor (its source: ``L['x'].size()[0]``)."""
    for p, ex in zip(placeholders, example_inputs):
        if isinstance(ex, torch.Tensor) and not _compat.is_static_input(ex):
            value = node_value(p)
            if isinstance(value, torch.Tensor) and value.dim() > cfg.dim:
                expr = _compat.symbol_of(value.shape[cfg.dim])
                if expr is not None and getattr(expr, "is_Symbol", False):
                    return expr
    suffix = f".size()[{cfg.dim}]"
    for p, ex in zip(placeholders, example_inputs):
        expr = _compat.symbol_of(node_value(p))
        source = _compat.dynamo_source_name(p) or ""
        if isinstance(ex, (int, torch.SymInt)) and getattr(expr, "is_Symbol", False) and source.endswith(suffix):
            return expr
    return None


def alongside(placeholders: list[fx.Node], example_inputs: Sequence[Any], symbol: Any, dim: int) -> frozenset[Any]:
    """The sizes of other tensor inputs padded with the padded one: dimension ``dim`` of a
    tensor input that has a symbol of its own there and, at this call, as many rows (HF BERT's
    ``attention_mask`` along its ``input_ids``: Dynamo, tracing again after a new batch size,
    gave them two symbols). Eagerly both have the call's rows; padding one alone, every
    captured size read the other (a mask indexed by the padded rows) out of bounds, and a
    device-side assert ended the process. A call where their rows differ runs ungraphed
    (``PiecewiseRuntime``'s row check)."""
    if symbol is None:
        return frozenset()
    sizes = [(_compat.symbol_of(node_value(p).shape[dim]), ex.shape[dim])
             for p, ex in zip(placeholders, example_inputs)
             if isinstance(ex, torch.Tensor) and not _compat.is_static_input(ex) and ex.dim() > dim
             and isinstance(node_value(p), torch.Tensor)]
    lead = next((n for expr, n in sizes if expr == symbol), None)
    return frozenset(expr for expr, n in sizes
                     if getattr(expr, "is_Symbol", False) and expr != symbol and n == lead)


def dim_of(value: Any, symbol: Any, rows: frozenset[Any] = frozenset()) -> int | None:
    """The dimension of ``value`` that has the padded size: the size ``symbol`` itself, or the
    padded size's leading rows of a fixed-size tensor (:func:`leading_rows`)."""
    if symbol is None or not isinstance(value, torch.Tensor):
        return None
    for d, s in enumerate(value.shape):
        if follows(_compat.symbol_of(s), symbol, rows):
            return d
    return None


def follows(expr: Any, symbol: Any, rows: frozenset[Any]) -> bool:
    """Is a size ``symbol``, or ``symbol`` clamped by a fixed size (``Min(8, s0)``: the leading
    rows ``buf[:n]`` of an 8-row buffer), or one of ``rows``? Each is, at a padded call, at least
    the call's own rows or the whole of a dimension eager would cut the same way: slicing it to
    the call's rows (clamped) gives eager's value."""
    if expr is None:
        return False
    if expr == symbol or expr in rows:
        return True
    args = getattr(expr, "args", ())
    return (
        type(expr).__name__ == "Min" and symbol in args
        and all(a == symbol or getattr(a, "is_Integer", False) for a in args)
    )


def leading_rows(gm: fx.GraphModule, symbol: Any) -> frozenset[Any]:
    """The unbacked symbols that are the padded size's leading rows of a fixed-size tensor: the
    size of a slice ``buf[:n]`` (start 0, step 1, ``n`` the padded size) where torch traces it
    size-obliviously (torch 2.11 with ``backed_size_oblivious`` gives the slice's size a symbol
    of its own, ``u0``, not ``Min(8, s0)``). Without this, such an output would be handed out at
    the padded size: a slice of the padded rows where eager has the call's rows."""
    if symbol is None:
        return frozenset()
    found = set()
    for n in gm.graph.nodes:
        value = node_value(n)
        if n.op != "call_function" or n.target is not operator.getitem or not isinstance(value, torch.Tensor):
            continue
        index = n.args[1] if len(n.args) > 1 else None
        d = 0
        for item in index if isinstance(index, tuple) else (index,):
            if item is None:  # a new dimension of size 1
                d += 1
            elif isinstance(item, slice):
                stop = node_value(item.stop) if isinstance(item.stop, fx.Node) else None
                if (item.start in (None, 0) and item.step in (None, 1) and d < value.dim()
                        and _compat.symbol_of(stop) == symbol):
                    expr = _compat.symbol_of(value.shape[d])
                    if getattr(expr, "is_Symbol", False) and expr != symbol:
                        found.add(expr)
                d += 1
            elif not isinstance(item, int):  # Ellipsis, a tensor index: dims unknown here
                break
    return frozenset(found)


def paddable(value: Any, symbol: Any, rows: frozenset[Any] = frozenset()) -> bool:
    """Every dimension of ``value`` has the padded size (:func:`follows`) or is free of it."""
    if not isinstance(value, torch.Tensor):
        expr = _compat.symbol_of(value)
        return expr is None or symbol not in getattr(expr, "free_symbols", ())
    for s in value.shape:
        expr = _compat.symbol_of(s)
        if expr is not None and not follows(expr, symbol, rows) and symbol in expr.free_symbols:
            return False
    return True

