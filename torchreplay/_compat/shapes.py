"""The private torch names of Dynamo's traced shapes and graph inputs, for the compile split
and backend: data-dependent (unbacked) sizes, size-oblivious tracing, a SymInt's expression, the
fake mode of traced values, which graph inputs are module state, and where Dynamo found each."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch

__all__ = [
    "adopt_scalar_fakes",
    "new_unbacked_symbols", "fresh_unbacked_ignored", "backed_size_oblivious", "symbol_of",
    "fake_mode_of", "is_static_input", "dynamo_source_name", "maybe_mark_dynamic", "mark_dynamic", "mark_unbacked", "dynamo_restart",
]


def dynamo_restart(exc: BaseException) -> bool:
    """Is ``exc`` Dynamo's request to trace the frame again? Inductor raises
    ``TensorifyScalarRestartAnalysis`` for a float Dynamo made an input (a module's ``eps`` seen
    with two values) that it cannot take as a tensor; Dynamo's call of the backend lets it
    through, makes the float a constant and compiles again. A backend that catches it compiles
    a graph with a symbolic float Inductor cannot handle. False on a torch without it."""
    exc_module = getattr(getattr(torch, "_dynamo", None), "exc", None)
    restart = getattr(exc_module, "TensorifyScalarRestartAnalysis", None)
    return restart is not None and isinstance(exc, restart)


def adopt_scalar_fakes(placeholders: Sequence[Any], example_inputs: Sequence[Any]) -> int:
    """Give each graph input that Dynamo made of a Python float (a 0-dim tensor whose traced
    value knows its ``.item()``: a module's ``dropout`` ``p`` or ``eps`` seen with two values)
    the fake tensor of the tracing context's fake mode. Its ``example_value`` is of another
    mode; AOT autograd makes a fake of it anew in its own, which no longer knows the
    ``.item()``, and Inductor fails with ``DataDependentOutputException`` (the graph then ran
    as FX code). From the real input, the context's mode gives back the fake Dynamo traced,
    which knows it: Inductor then asks Dynamo to make the float a constant, as with its own
    backend. Returns how many it changed; 0 outside a ``torch.compile`` or on a torch
    without these (private) names."""
    context = getattr(torch._guards, "TracingContext", None)
    context = context.try_get() if context is not None else None
    mode = getattr(context, "fake_mode", None)
    if mode is None:
        return 0
    changed = 0
    for p, real in zip(placeholders, example_inputs):
        value = p.meta.get("example_value")
        if (
            isinstance(real, torch.Tensor) and real.dim() == 0 and real.is_floating_point()
            and getattr(value, "item_memo", None) is not None
            and getattr(value, "fake_mode", mode) is not mode
            and not isinstance(real, torch._subclasses.FakeTensor)
        ):
            ours = mode.from_tensor(real)
            if getattr(ours, "item_memo", None) is not None:
                p.meta["example_value"] = ours
                changed += 1
    return changed


def new_unbacked_symbols(value: Any, inputs: Sequence[Any]) -> bool:
    """Does a traced value (a fake tensor, a SymInt, a tuple of them) have a size that depends
    on the data (an unbacked symbol, from ``nonzero``, a boolean mask, ``.item()``) that none of
    ``inputs`` has (a dimension marked unbacked on purpose flows through every op)? Read with
    ``torch.fx.experimental.symbolic_shapes.free_unbacked_symbols`` (private, torch >= 2.1); on a
    torch without it, False: the node is then captured and a capture that fails falls back."""
    try:
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    except ImportError:  # pragma: no cover - old torch
        return False
    try:
        made = set(free_unbacked_symbols(value))
        if not made:
            return False
        for v in inputs:
            made -= set(free_unbacked_symbols(v))
        return bool(made)
    except Exception:
        return False


@contextlib.contextmanager
def fresh_unbacked_ignored(fake_mode: Any) -> Iterator[None]:
    """Let a fake run make unbacked symbols (``nonzero``) without leaving them pending in the
    shape environment, where Inductor would later fail with PendingUnbackedSymbolNotFound.
    ``ShapeEnv.ignore_fresh_unbacked_symbols`` exists since torch 2.3; without it, nothing."""
    env = getattr(fake_mode, "shape_env", None)
    ignore = getattr(env, "ignore_fresh_unbacked_symbols", None)
    if ignore is None:
        yield
        return
    with ignore():
        yield


def backed_size_oblivious() -> contextlib.AbstractContextManager[Any]:
    """While Dynamo traces: size symbols range over [0, inf] with no 0/1 guard, so a graph
    traced at more rows serves a 1-row call too (else Dynamo guards the size ``>= 2`` and a
    1-row call compiles again). ``torch.fx.experimental._config.backed_size_oblivious`` (torch
    >= 2.6, marked experimental); without it, nothing changes."""
    from torch.fx.experimental import _config as fx_config

    if not hasattr(fx_config, "backed_size_oblivious"):
        return contextlib.nullcontext()
    return fx_config.patch(backed_size_oblivious=True)


def maybe_mark_dynamic(t: torch.Tensor, dim: int) -> None:
    """Hint that dimension ``dim`` of ``t`` varies, for the Dynamo trace that next takes ``t``
    as an input (the frame resumed after a graph break): it traces that dimension symbolic at
    once instead of compiling it static and again dynamic at the next size. Soft: Dynamo may
    still specialise it, and never raises. ``torch._dynamo.maybe_mark_dynamic`` (torch >= 2.1);
    without it, nothing."""
    mark = getattr(torch._dynamo, "maybe_mark_dynamic", None)
    if mark is not None:
        mark(t, dim)


def mark_dynamic(t: torch.Tensor, dim: int) -> None:
    """Make dimension ``dim`` of ``t`` symbolic for the Dynamo trace that takes ``t`` (a size of
    2 or more; ``torch._dynamo.mark_dynamic``, documented though under ``_dynamo``)."""
    torch._dynamo.mark_dynamic(t, dim)


def mark_unbacked(t: torch.Tensor, dim: int) -> None:
    """Make dimension ``dim`` of ``t`` an unbacked symbol (a size of 0 or 1 Dynamo would
    otherwise specialise; ``torch._dynamo.decorators.mark_unbacked``)."""
    torch._dynamo.decorators.mark_unbacked(t, dim)


def symbol_of(value: Any) -> Any:
    """The sympy expression of a SymInt (``s0``), or None for a plain int."""
    node = getattr(value, "node", None)
    return getattr(node, "expr", None)


def fake_mode_of(values: Sequence[Any]) -> Any:
    """The FakeTensorMode of the first fake tensor in ``values`` (Dynamo's example values)."""
    for v in values:
        mode = getattr(v, "fake_mode", None)
        if mode is not None:
            return mode
    return None


def is_static_input(t: Any) -> bool:
    """Is a Dynamo graph input a parameter or buffer of a module (an address that stays put)?

    Dynamo marks them with ``_dynamo_static_input_type`` when it inlines nn modules (the
    default since torch 2.5); a plain ``nn.Parameter`` counts too."""
    return isinstance(t, torch.nn.Parameter) or getattr(t, "_dynamo_static_input_type", None) is not None


def dynamo_source_name(node: Any) -> str | None:
    """Where Dynamo found a graph input, in its words (``L['self']._buffers['seen']``): the
    ``source.name`` of the placeholder's ``meta["grapharg"]`` (a property in torch 2.11 to
    2.13, called where it is a method), or None."""
    name = getattr(getattr(node.meta.get("grapharg"), "source", None), "name", None)
    try:
        name = name() if callable(name) else name
    except Exception:
        return None
    return name if isinstance(name, str) else None
