"""The private torch names of a ``torch.library.custom_op`` called without the dispatcher
(``pieces/direct.py``): the kernel the op registered for a device, and whether a mode is on."""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = [
    "OpOverload", "OpOverloadPacket", "OP_TYPES", "custom_op_kernel", "argument_kinds", "plain_value", "modes_active", "without_dynamo_guard",
    "eval_frame_callback", "compiled_target", "compiled_module", "static_address", "higher_order",
    "dynamo_tracing", "call_untraced",
]

#: The types of ``torch.ops.ns.name.overload`` and ``torch.ops.ns.name`` (``torch._ops``: private
#: module, public objects; what FX nodes of aten and custom ops have as targets).
OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket
OP_TYPES = (OpOverload, OpOverloadPacket)

# Python types the dispatcher hands a custom op's kernel unchanged, per schema type: an argument
# of another type (an int where the schema says float) would reach the kernel converted through
# the dispatcher and as is when called directly.
_PLAIN = {
    "Tensor": (torch.Tensor,),
    "int": (int,),
    "SymInt": (int,),
    "float": (float,),
    "bool": (bool,),
    "str": (str,),
}


def custom_op_kernel(op: Any, device_type: str) -> Callable[..., Any] | None:
    """The Python function ``torch.library.custom_op`` registered as ``op``'s kernel for
    ``device_type`` (or for every device), as the dispatcher calls it below autograd and the
    version-counter step; ``None`` when ``op`` is no such op, or one the dispatcher would do more
    for: an autocast rule (it casts the inputs), or a ``torch_dispatch`` rule.

    Reads ``torch._library.custom_ops.OPDEFS`` and the ``CustomOpDef``'s ``_backend_fns`` (private,
    torch >= 2.4; what ``torch.library.register_kernel`` fills). The autocast rule is
    ``_autocast_dtype`` (a dict, newer torch) or ``_autocast_cuda_dtype`` / ``_autocast_cpu_dtype``
    (torch 2.5-2.11). On a torch without them: ``None`` (the op is called through the dispatcher).
    """
    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:  # pragma: no cover - old torch
        return None
    name = getattr(op, "_name", None)
    if not isinstance(op, OpOverload) or name not in OPDEFS:
        return None
    opdef = OPDEFS[name]
    fns = getattr(opdef, "_backend_fns", None)
    if not isinstance(fns, dict):
        return None
    casts = [*(getattr(opdef, "_autocast_dtype", None) or {}).values()]
    casts += [getattr(opdef, "_autocast_cuda_dtype", None), getattr(opdef, "_autocast_cpu_dtype", None)]
    if any(c is not None for c in casts) or getattr(opdef, "_torch_dispatch_fns", None):
        return None
    return fns.get(device_type, fns.get(None))


def argument_kinds(op: Any) -> list[tuple[str, str, bool, bool]] | None:
    """Per schema argument of ``op``: its name, its type (``"Tensor"``, ``"int"``, ...;
    ``"Tensor[]"`` for a list; ``""`` for a type not handed over as is), whether it may be
    ``None``, and whether the op writes it (``Tensor(a!)``); ``None`` without a schema.
    ``OpOverload._schema`` is private but read by every torch tracer (see ``written_tensors``)."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return None
    kinds = []
    for arg in schema.arguments:
        t = arg.type
        optional = isinstance(t, torch.OptionalType)
        if optional:
            t = t.getElementType()
        if isinstance(t, torch.ListType):
            name = "Tensor[]" if str(t.getElementType()) == "Tensor" else ""
        else:
            name = str(t) if str(t) in _PLAIN else ""
        info = arg.alias_info
        kinds.append((arg.name, name, optional, info is not None and info.is_write))
    return kinds


def plain_value(kind: str, value: Any) -> bool:
    """Does the dispatcher hand ``value`` to a kernel unchanged for a schema argument of
    ``kind`` (see :func:`argument_kinds`)? A list is handed over as a list."""
    if kind == "Tensor[]":
        return type(value) is list and all(isinstance(v, torch.Tensor) for v in value)
    if kind == "Tensor":  # a Parameter too: handed over as the same object
        return isinstance(value, torch.Tensor)
    types = _PLAIN.get(kind)
    return types is not None and type(value) in types


def modes_active() -> bool:
    """Is a ``TorchDispatchMode`` or a ``TorchFunctionMode`` on (it would see an op called
    through ``torch.ops``)? ``torch._C._len_torch_dispatch_stack`` and
    ``_is_torch_function_mode_enabled`` are private (torch >= 2.0); without them: True (the
    dispatcher is used)."""
    try:
        return bool(torch._C._len_torch_dispatch_stack()) or torch._C._is_torch_function_mode_enabled()
    except AttributeError:  # pragma: no cover - old torch
        return True


def _dynamo_guard_code() -> Any:
    """The code object of the function ``torch._disable_dynamo`` wraps a function in (``None``
    on a torch without it)."""
    disable = getattr(torch, "_disable_dynamo", None)
    if disable is None:  # pragma: no cover - old torch
        return None
    return getattr(disable(lambda: None), "__code__", None)


_DYNAMO_GUARD_CODE = _dynamo_guard_code()


def without_dynamo_guard(kernel: Callable[..., Any]) -> Callable[..., Any] | None:
    """The function under ``kernel``'s ``torch._disable_dynamo`` wrapper: what a custom op's
    registered kernel runs (its check of ``set_kernel_enabled`` included), without turning
    Dynamo's frame hook off and on around it (about 1 us). ``None`` when ``kernel`` is not such
    a wrapper (checked by its code object, not its name). Call it only while
    :func:`eval_frame_callback` is ``None``: no Dynamo hook to turn off."""
    code = getattr(kernel, "__code__", None)
    inner = getattr(kernel, "__wrapped__", None)
    if _DYNAMO_GUARD_CODE is None or code is not _DYNAMO_GUARD_CODE or not callable(inner):
        return None
    return inner


#: ``torch.compiler.is_dynamo_compiling`` (public, torch >= 2.3): False when called, True where
#: Dynamo traces the call (it folds the function to a constant). 30 ns: the first test of every
#: replay. A torch without it: False (Dynamo then traces into the call, as before).
dynamo_tracing: Callable[[], bool] = getattr(torch.compiler, "is_dynamo_compiling", lambda: False)


def _call(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return obj(*args, **kwargs)


_call.__name__ = _call.__qualname__ = "torchreplay_call_outside_torch_compile"
#: ``call_untraced(obj, args, kwargs)``: ``obj(*args, **kwargs)``, where Dynamo never traces.
#: Code that torch.compile traces makes it a graph break and runs it as eager code does (with
#: Dynamo off inside). ``torch._disable_dynamo`` (private, torch >= 2.1) imports Dynamo at the
#: first call, not here (1 s). A graphed callable that code compiled with torch.compile calls
#: goes through it: Dynamo traced our replay path otherwise, breaking in it and compiling it
#: again at every call.
call_untraced: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any] = (
    torch._disable_dynamo(_call) if hasattr(torch, "_disable_dynamo") else _call
)


def _no_eval_frame_getter() -> Any:  # pragma: no cover - old torch
    return True  # unknown: taken as a hook that is on


#: ``torch._C._dynamo.eval_frame.get_eval_frame_callback`` (private, torch >= 2.1): Dynamo's
#: frame hook of this thread; ``None`` outside any ``torch.compile``d frame and inside the
#: compiled code's calls of a backend (Dynamo disables itself there).
eval_frame_callback: Callable[[], Any] = getattr(
    getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None),
    "get_eval_frame_callback", _no_eval_frame_getter,
)


def compiled_target(obj: Any) -> Any:
    """What ``torch.compile`` compiled, for what it returned (``OptimizedModule._orig_mod``, a
    function's ``_torchdynamo_orig_callable``: private names); ``None`` for anything else."""
    target = getattr(obj, "_orig_mod", None)
    if target is None:
        target = getattr(obj, "_torchdynamo_orig_callable", None)
    return target


def compiled_module(module: torch.nn.Module) -> bool:
    """Is ``module`` what torch.compile returned, or compiled in place (``_compiled_call_impl``)?"""
    return compiled_target(module) is not None or getattr(module, "_compiled_call_impl", None) is not None


def static_address(t: Any) -> bool:
    """Did the caller mark ``t`` with ``torch._dynamo.mark_static_address`` (its address is
    constant across calls; the private attribute that function sets)?"""
    return getattr(t, "_dynamo_static_input_type", None) is not None


def higher_order(target: Any) -> bool:
    """Is an FX node's target a higher-order operator (``torch._ops.HigherOrderOperator``: a
    user Triton kernel's wrapper, ``auto_functionalized``, control flow), whose writes no schema
    states? False on a torch without the class."""
    cls = getattr(getattr(torch, "_ops", None), "HigherOrderOperator", None)
    return cls is not None and isinstance(target, cls)
