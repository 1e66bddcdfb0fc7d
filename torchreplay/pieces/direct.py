"""A ``torch.library.custom_op`` called at replay without the dispatcher (:func:`direct_call`).

The eager step between two graphs is often one custom op: a splitting op, an attention that
reads host-side lengths. Called through ``torch.ops``, such an op passes three Python kernels of
torch's before the user's function runs (autograd, the version counters, the device kernel with
its check of what the function returned): 13-19 us of host time per call, most of what a
split costs. vLLM registers its ops without ``custom_op`` for that reason. A replay calls the
function the op registered for the device itself, and does what those kernels do on the path it
takes: it bumps the version counter of every argument the schema marks as written. It goes
through the dispatcher whenever that would do more: grad mode on and an argument that requires
grad (autograd records the op), a dispatch or function mode on. Capture calls the op through the
dispatcher, so its checks of what the function returns run there.

Torch also wraps the registered function to turn Dynamo's frame hook off and on around it
(about 1 us), so that Dynamo never traces into it. A replay with no hook on (the usual case:
compiled code calls its backend with Dynamo off) calls the function under that wrapper.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from torchreplay import _compat

__all__ = ["direct_call", "device_type_of"]

_Tensor = torch.Tensor
_grad_enabled = torch.is_grad_enabled
_modes_active = _compat.modes_active
_bump = torch.autograd.graph.increment_version
_dynamo_hook = _compat.eval_frame_callback


def device_type_of(values: Sequence[Any]) -> str | None:
    """The device type whose kernel the dispatcher runs for the tensors in ``values`` (lists
    included): their one type, or CUDA for CUDA tensors with CPU ones (host-side lengths);
    ``None`` for no tensor or another mix."""
    types = set()
    for v in values:
        for t in v if isinstance(v, list) else (v,):
            if isinstance(t, _Tensor):
                types.add(t.device.type)
    if types == {"cpu", "cuda"}:
        return "cuda"
    return types.pop() if len(types) == 1 else None


def direct_call(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Callable[..., Any] | None:
    """A function that computes ``op(*a, **k)`` for arguments like ``args`` and ``kwargs``
    (the values of a call at capture, or an FX node's traced values), calling the kernel
    ``op`` registered for their device directly; ``None`` when ``op`` is no
    ``torch.library.custom_op``, or an argument would reach the kernel converted through the
    dispatcher (an int where the schema says float, a tuple for a list).

    The function's arguments must keep the kinds of ``args`` and ``kwargs`` (a replay's do:
    the same slots, the same buffers).
    """
    kinds = _compat.argument_kinds(op)
    if kinds is None or len(args) > len(kinds):
        return None
    device_type = device_type_of([*args, *kwargs.values()])
    if device_type is None:
        return None
    kernel = _compat.custom_op_kernel(op, device_type)
    if kernel is None:
        return None
    index = {name: i for i, (name, *_) in enumerate(kinds)}
    given = list(enumerate(args)) + [(index.get(name, -1), v) for name, v in kwargs.items()]
    for i, value in given:
        if i < 0:
            return None
        _, kind, optional, _ = kinds[i]
        if not (value is None and optional) and not _compat.plain_value(kind, value):
            return None
    written = tuple((i, name) for i, (name, _, _, w) in enumerate(kinds) if w)
    # torch wraps the kernel to keep Dynamo from tracing into it; with no Dynamo hook on (a
    # replay: compiled code calls its backend with Dynamo off) there is nothing to keep off.
    bare = _compat.without_dynamo_guard(kernel) or kernel

    def call(*a: Any, **k: Any) -> Any:
        if _modes_active() or (_grad_enabled() and _needs_grad(a, k)):
            return op(*a, **k)
        out = (bare if _dynamo_hook() is None else kernel)(*a, **k)
        for i, name in written:  # what the dispatcher's version-counter kernel does
            value = a[i] if i < len(a) else k.get(name)
            if isinstance(value, _Tensor):
                _bump(value)
            elif isinstance(value, list):
                for t in value:
                    _bump(t)
        return out

    call.__name__ = call.__qualname__ = "direct_" + str(getattr(op, "_name", "op")).replace("::", "_")
    return call


def _needs_grad(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    for v in (*args, *kwargs.values()):
        if isinstance(v, _Tensor):
            if v.requires_grad:
                return True
        elif isinstance(v, list) and any(isinstance(t, _Tensor) and t.requires_grad for t in v):
            return True
    return False
