"""What an aten op writes and returns, read from its schema (``OpOverload._schema``: private, but
what every torch tracer reads for this: Dynamo's mutation detection, FX's ``is_impure``; it exists
since torch 1.x)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["written_tensors", "written_arguments", "returns_view", "returns_fresh"]


#: Batch-norm kernels that update their running statistics (arguments 3 and 4) in training
#: (argument 5) though their schemas do not mark them written; ``F.batch_norm`` reaches one of
#: these in eager mode (the native one on the CPU and without cuDNN, cuDNN's on CUDA).
_UNMARKED_STATS = frozenset({"aten::native_batch_norm", "aten::cudnn_batch_norm", "aten::miopen_batch_norm"})


def written_tensors(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an aten op writes: arguments its schema marks as written (``Tensor(a!)``),
    ``self`` of in-place ops and ``out=`` arguments, TensorList arguments included; and the
    running statistics of the batch-norm kernels whose schemas leave them unmarked.

    ``OpOverload._schema`` is private but is what every torch tracer reads for this (Dynamo's
    mutation detection, FX's ``is_impure``); it exists since torch 1.x. An op without a schema
    (a Python-only op) is reported as writing nothing.
    """
    return written_arguments(func, args, kwargs, torch.Tensor)


def written_arguments(func: Any, args: Sequence[Any], kwargs: dict[str, Any], kind: type = object) -> list[Any]:
    """:func:`written_tensors` for any argument values of type ``kind`` (the FX nodes of an
    op's call in a graph: which nodes it writes)."""
    try:
        spec = _SPECS.get(func)
    except TypeError:  # (an unhashable callable: read its schema each time)
        spec = _spec(func)
    else:
        if spec is None:
            spec = _SPECS[func] = _spec(func)
    stats, writes = spec
    out: list[Any] = []
    if stats and len(args) > 5 and args[5] is True:
        out.extend(a for a in args[3:5] if isinstance(a, kind))  # running_mean, running_var
    for i, name, kwarg_only in writes:
        value = kwargs.get(name) if kwarg_only or i >= len(args) else args[i]
        if isinstance(value, (list, tuple)):
            out.extend(t for t in value if isinstance(t, kind))
        elif isinstance(value, kind) and value is not None:
            out.append(value)
    return out


#: per op: (a batch-norm kernel with unmarked statistics, its written arguments as (position,
#: name, keyword-only)); read from the schema once (each dispatch mode over a model's ops asks
#: for every op: reading the schema's arguments each time cost about 5 us an op)
_SPECS: dict[Any, tuple[bool, tuple[tuple[int, str, bool], ...]]] = {}


def _spec(func: Any) -> tuple[bool, tuple[tuple[int, str, bool], ...]]:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False, ()
    writes = tuple(
        (i, arg.name, bool(arg.kwarg_only)) for i, arg in enumerate(schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
    )
    return schema.name in _UNMARKED_STATS, writes


def returns_view(func: Any) -> bool:
    """Does an aten op return a view of (an alias of) an argument (its schema's first return
    is annotated, ``Tensor(a)``: ``select``, ``view``, ``t``)? False without a schema."""
    returns = getattr(getattr(func, "_schema", None), "returns", ())
    return bool(returns) and returns[0].alias_info is not None


def returns_fresh(func: Any) -> bool:
    """Does an aten op return only new tensors (no return of its schema is annotated as an
    alias of an argument)? False without a schema."""
    schema = getattr(func, "_schema", None)
    return schema is not None and all(r.alias_info is None for r in schema.returns)
