"""Autograd's private names: the order of its nodes, the version counters of saved tensors, and
copies it must not record; the version counters of inference tensors, which have none; and the
``torch.autograd.Function`` classes a run calls (and Triton's launches, which bypass torch)."""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Sequence

import torch

__all__ = [
    "direct_apply", "foreach_copy_untracked", "saved_tensor_hooks", "set_sequence_nr", "sequence_nr",
    "restore_unversioned", "copy_back", "unexpanded", "expanded_dims", "clone_strided", "dense",
    "in_backward", "is_accumulate_grad", "is_view", "normal_tensors", "versions_of",
    "function_forwards", "function_of_call", "function_of_ctx", "is_custom_op_function", "triton_launches",
    "watch_saved", "transformed", "transform_active", "dual_level",
]

_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)

_foreach_copy = torch._foreach_copy_
_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled  # what torch.no_grad() calls, without its frames


def foreach_copy_untracked(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``torch._foreach_copy_`` (one launch for many copies) with autograd off. A source that
    requires grad, copied in under grad mode, would make a static buffer require grad too, with
    a history (``NotImplemented`` for the multi-tensor copy) that keeps the source's autograd
    graph alive until the next call; and recording it costs about 2 us a call."""
    if not _grad_enabled():
        _foreach_copy(dsts, srcs)
        return
    _set_grad_enabled(False)
    try:
        _foreach_copy(dsts, srcs)
    finally:
        _set_grad_enabled(True)


_FunctionBase = getattr(torch._C, "_FunctionBase", None)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", None)


def direct_apply(cls: type) -> Callable[..., Any]:
    """``cls.apply`` for a ``torch.autograd.Function`` without a ``setup_context``, with no
    Python preamble where it has nothing to do. ``Function.apply`` binds default arguments (only
    for a ``setup_context``) and passes every argument through functorch's
    ``unwrap_dead_wrappers`` (a loop of C calls, about 10 us for a graphed call with a few dozen
    tensors; it only matters inside a functorch transform). Outside a transform this calls the
    C++ apply bound to ``cls`` (what ``Function.apply`` ends in); inside one, or on a torch
    without those names, ``cls.apply``."""
    raw = _FunctionBase.__dict__.get("apply") if _FunctionBase is not None else None
    if raw is None or _functorch_active is None or "setup_context" in cls.__dict__:
        return cls.apply  # type: ignore[attr-defined, no-any-return]
    c_apply = raw.__get__(None, cls)
    slow = cls.apply  # type: ignore[attr-defined]
    active = _functorch_active

    def apply(*args: Any) -> Any:
        return slow(*args) if active() else c_apply(*args)

    return apply


_top_saved_hooks = getattr(getattr(torch._C, "_autograd", None), "_top_saved_tensors_default_hooks", None)


def saved_tensor_hooks() -> str | None:
    """The pack hook of the innermost ``torch.autograd.graph.saved_tensors_hooks`` active now
    (activation checkpointing without reentrance, ``save_on_cpu``), by its qualified name; None
    when none is (or torch cannot tell)."""
    if _top_saved_hooks is None:
        return None
    hooks = _top_saved_hooks(False)
    return None if hooks is None else getattr(hooks[0], "__qualname__", repr(hooks[0]))


_hooks_enabled = getattr(getattr(torch._C, "_autograd", None), "_saved_tensors_hooks_is_enabled", None)


def watch_saved(on_save: Callable[[torch.Tensor], None]) -> Any:
    """A context in which every tensor autograd saves for a backward is passed to ``on_save``
    (detached) and saved (``torch.autograd.graph.saved_tensors_hooks``); a null context where
    such hooks are turned off (torch refuses new ones there)."""
    if _hooks_enabled is not None and not _hooks_enabled():
        return contextlib.nullcontext()

    def pack(t: torch.Tensor) -> torch.Tensor:
        # Detached (same data, same version counter): the live tensor, kept by the node that
        # saved it, would hold that node's graph in a cycle no collector breaks when no backward
        # runs (the record's eager run), and with it the parameters' AccumulateGrad nodes made on
        # this stream, which a captured backward then cannot use (pytorch#189025). Autograd puts
        # the grad_fn back on unpack.
        t = t.detach()
        on_save(t)
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def in_backward() -> bool:
    """Is this thread running a backward (autograd's engine: a backward graph, or a checkpoint's
    forward run again)? ``torch._C._current_graph_task_id`` is -1 outside one; a torch without
    it says no."""
    return _graph_task_id is not None and _graph_task_id() >= 0


_AccumulateGrad = getattr(getattr(torch._C, "_functions", None), "AccumulateGrad", None)


def is_accumulate_grad(node: Any) -> bool:
    """Is this autograd node a leaf tensor's ``AccumulateGrad`` (what an edge to a leaf that
    requires grad points to)? ``torch._C._functions.AccumulateGrad``; a torch without it: by its
    ``variable`` attribute, which only that node has."""
    if _AccumulateGrad is not None:
        return isinstance(node, _AccumulateGrad)
    return node is not None and hasattr(node, "variable")


def set_sequence_nr(grad_fn: Any, seq: int) -> None:
    """Set an autograd node's sequence number, which orders the engine's ready queue.

    The engine runs ready nodes with the larger sequence number first; giving each graphed
    backward a number from its capture order makes shared-pool backward graphs replay in the
    order they were captured for. ``Node._set_sequence_nr`` exists since torch 2.1.
    """
    setter: Callable[[int], None] | None = getattr(grad_fn, "_set_sequence_nr", None)
    if setter is None:  # pragma: no cover - old torch
        raise RuntimeError("this torch has no grad_fn._set_sequence_nr; torchreplay needs >= 2.6")
    setter(seq)


def sequence_nr(grad_fn: Any) -> int:
    """Return an autograd node's sequence number (``Node._sequence_nr``, since torch 1.x)."""
    return int(grad_fn._sequence_nr())


_set_versions = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)


def restore_unversioned(saved: Sequence[tuple[torch.Tensor, torch.Tensor]], versions: Sequence[int | None]) -> None:
    """Copy each saved value back into its tensor and set its version counter back to
    ``versions`` (read by :func:`versions_of` when the values were saved). What a warm-up or
    capture wrote is undone, so the tensor holds again what autograd may have saved of it for a
    pending backward: a counter bumped by the undo would make that backward fail ("modified by an
    inplace operation"). ``torch.autograd._unsafe_preserve_version_counter`` does the same. An
    inference tensor is put back only under ``torch.inference_mode``: outside it nothing can
    have written it (and nothing may)."""
    inference = torch.is_inference_mode_enabled()
    with torch.no_grad():
        for t, value in saved:
            if inference or not t.is_inference():
                copy_back(t, value)
    counted = [(t, v) for (t, _), v in zip(saved, versions) if v is not None]
    if _set_versions is not None and counted:
        _set_versions(tuple(t for t, _ in counted), tuple(v for _, v in counted))


def copy_back(t: torch.Tensor, value: torch.Tensor) -> None:
    """``t.copy_(value)`` for a ``t`` whose elements may share memory: an expanded tensor (an
    attention mask ``expand``-ed over the heads, saved for a backward) or a window view
    (``unfold``). ``copy_`` refuses those ("more than one element of the written-to tensor
    refers to a single memory location"); the elements that share a location hold one value,
    so each location is written once: the expanded dimensions are narrowed to one element, and
    what still overlaps is written through its storage, location by location. No copy-back of
    saved state may fail on the layout of the tensor it restores."""
    if not _may_overlap(t):
        t.copy_(value)
        return
    dims = expanded_dims(t)
    t, value = unexpanded(t, dims), unexpanded(value.expand_as(t), dims)
    if not _may_overlap(t):
        t.copy_(value)
        return
    # (a window view: the flat offset of each element in a 1-D view over the span it covers;
    # a location written more than once gets the one value its elements all hold)
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    flat = t.as_strided((span,), (1,))
    offsets = torch.arange(span, device=t.device).as_strided(t.shape, t.stride())
    flat[offsets.reshape(-1)] = value.reshape(-1).to(t.dtype)


def expanded_dims(t: torch.Tensor) -> tuple[int, ...]:
    """The dimensions of ``t`` that ``expand`` made: stride 0, more than one element."""
    return tuple(d for d, (n, s) in enumerate(zip(t.shape, t.stride())) if s == 0 and n > 1)


def clone_strided(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its strides (``clone`` gives an expanded or sliced tensor
    contiguous ones): Inductor's code asserts the strides of each input it was compiled for. An
    expanded dimension stays expanded, held once."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    with torch.no_grad():
        copy_back(out, t)
    return out


def unexpanded(t: torch.Tensor, dims: Sequence[int] | None = None) -> torch.Tensor:
    """``t`` with each expanded dimension (stride 0; or each of ``dims``) narrowed to one
    element: what a copy of its values needs to hold (an attention mask expanded over heads and
    queries: the mask's rows, not a tensor heads x queries times larger). :func:`copy_back`
    writes it back."""
    for d in expanded_dims(t) if dims is None else dims:
        t = t.narrow(d, 0, 1)
    return t


def dense(t: torch.Tensor) -> bool:
    """Does ``t`` fill its memory without gaps or overlap, in some order of its dimensions? Then
    ``clone`` keeps its strides; else (padded rows, a slice, an expansion) it makes them
    contiguous. Read from the strides: nothing is allocated."""
    expected = 1
    for s, n in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n != 1):
        if n == 0:
            return True
        if s != expected:
            return False
        expected *= n
    return True


def _may_overlap(t: torch.Tensor) -> bool:
    """Could two elements of ``t`` share a memory location? False only when, the dimensions
    ordered by stride, each stride reaches past the one before it (sufficient, not necessary:
    an unusual non-overlapping layout is written element by element, still correctly)."""
    dims = sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1)
    reach = 1
    for s, n in dims:
        if s < reach:
            return True
        reach = s * n
    return False


def versions_of(tensors: Sequence[torch.Tensor]) -> list[int | None]:
    """Each tensor's version counter; None for an inference tensor (one made under
    ``torch.inference_mode``), which has none: reading ``_version`` raises "Inference tensors do
    not track version counter"."""
    return [None if t.is_inference() else t._version for t in tensors]


def version_of(t: torch.Tensor) -> int | None:
    """One tensor's version counter, as :func:`versions_of` reads it."""
    return None if t.is_inference() else t._version


def normal_tensors() -> Any:
    """A context in which new tensors are normal ones, under ``torch.inference_mode`` too.

    Our buffers (static inputs, padded samples, the buffers between pieces) must be: the copy
    into one at a call outside ``inference_mode`` would raise "Inplace update to inference
    tensor outside InferenceMode", and their version counters tell which of them a capture
    wrote. Copying an inference tensor into a normal one is allowed in either mode."""
    return torch.inference_mode(False)


def is_view(t: torch.Tensor) -> bool:
    """Is ``t`` a view of another tensor (sharing its storage)? ``Tensor._is_view`` is private
    but has been there since torch 1.x, as has ``_base`` (not None for a view), which a torch
    without it falls back to."""
    check = getattr(t, "_is_view", None)
    return check() if check is not None else getattr(t, "_base", None) is not None


_BackwardCFunction = getattr(torch.autograd.function, "BackwardCFunction", None)


_FUNCTION_FILE = torch.autograd.function.__file__  # (the base classes' forward raises)


def function_forwards() -> set[Any]:
    """The code of every ``torch.autograd.Function`` subclass's ``forward`` (its own, or the
    one it inherits), but activation checkpointing's reentrant ``CheckpointFunction``, whose
    forward runs a whole stretch of the model. A class defined later is not in it; which class
    a run of a shared code is for, :func:`function_of_ctx` or :func:`function_of_call` tell."""
    skip = {getattr(getattr(torch.utils, "checkpoint", None), "CheckpointFunction", None)}
    found: set[Any] = set()
    todo = list(torch.autograd.Function.__subclasses__())
    seen: set[type] = set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo.extend(cls.__subclasses__())
        fwd = getattr(cls, "forward", None)  # (its own, or the one it inherits)
        code = getattr(fwd, "__code__", None)
        if code is not None and cls not in skip and code.co_filename != _FUNCTION_FILE:
            found.add(code)
    return found


_APPLY = getattr(getattr(torch.autograd.Function, "apply", None), "__func__", None)
_APPLY_CODE = getattr(_APPLY, "__code__", None)


def function_of_call(frame: Any) -> type | None:
    """The ``torch.autograd.Function`` class whose ``forward`` runs in ``frame``, read from the
    ``Function.apply`` frame that called it (its ``cls``); None when another frame called it."""
    caller = frame.f_back
    if caller is None or _APPLY_CODE is None or caller.f_code is not _APPLY_CODE:
        return None
    cls = caller.f_locals.get("cls")
    return cls if isinstance(cls, type) else None


def function_of_ctx(ctx: Any) -> type | None:
    """The ``torch.autograd.Function`` class whose ``forward`` was handed ``ctx`` (the node
    ``apply`` made for the call: its class keeps the Function as ``_forward_cls``); None when
    ``ctx`` is no such node (a Function with a ``setup_context`` gets no ctx)."""
    if _BackwardCFunction is None or not isinstance(ctx, _BackwardCFunction):
        return None
    return getattr(ctx, "_forward_cls", None)


def is_custom_op_function(cls: type) -> bool:
    """Is this the Function ``torch.library``'s ``register_autograd`` made for a custom op? Its
    forward calls the op again below autograd, so the op itself, called with autograd on, is
    the same call."""
    return cls.__module__.startswith(("torch._library", "torch._custom_op"))  # (the older API's)


def triton_launches() -> dict[Any, str]:
    """The code of Triton's Python-side kernel launch (``JITFunction.run``), if Triton is
    imported: a launch never reaches torch's dispatcher. Empty when it is not (nothing
    imports it here)."""
    jit = sys.modules.get("triton.runtime.jit")
    run = getattr(getattr(jit, "JITFunction", None), "run", None)
    code = getattr(run, "__code__", None)
    return {code: "triton.runtime.jit.JITFunction.run"} if code is not None else {}


from torch.autograd import forward_ad as _forward_ad  # noqa: E402  (its level: a module global)

_functorch_wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)


def transformed(t: torch.Tensor) -> bool:
    """Is ``t`` a tensor of a ``torch.func`` transform (``vmap``'s batched tensor, ``grad``'s
    or ``jvp``'s wrapper: ``torch._C._functorch.is_functorch_wrapped_tensor``, private, torch >=
    2.0) or a forward-mode AD dual (a tangent at the current ``dual_level``)? A graph replays
    fixed kernels: it can neither batch nor carry a tangent. Called on an error path only."""
    if _functorch_wrapped is not None and _functorch_wrapped(t):
        return True
    if getattr(_forward_ad, "_current_level", -1) < 0:
        return False
    return _forward_ad.unpack_dual(t).tangent is not None


_maybe_level = getattr(getattr(torch._C, "_functorch", None), "maybe_current_level", None)


def dual_level() -> bool:
    """Is a forward-mode AD ``dual_level`` entered (``torch.autograd.forward_ad._current_level``,
    a private module global; absent: False)? A dual tensor has the primal's storage, so a copy
    by address would drop its tangent: the copy node steps aside while one is (core/io.py)."""
    return getattr(_forward_ad, "_current_level", -1) >= 0


def transform_active() -> bool:
    """Is a ``torch.func`` transform on (functorch's level: ``torch._C._functorch.
    maybe_current_level``, private, torch >= 2.0) or a forward-AD ``dual_level`` entered? About
    0.1 us: for calls that take tens of microseconds (a training forward)."""
    if _maybe_level is not None and _maybe_level() is not None:
        return True
    return getattr(_forward_ad, "_current_level", -1) >= 0

