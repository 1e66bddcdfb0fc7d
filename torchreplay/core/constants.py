"""Constants that a callable makes on the device from Python values, made by kernels under capture.

``torch.tensor(0.0, device="cuda")`` (transformers' eager attention mask, in Bloom and GPT-J) and
indexing with a Python list (``qkv[..., [-2], :]``, in Falcon) copy their values from pageable
host memory, which no capture can hold ("Cannot copy between CPU and CUDA tensors during CUDA
graph capture unless the CPU tensor is pinned"). Eagerly nothing else is wrong with them. Under
capture, :class:`DeviceConstants` makes each such value with fill kernels instead, so the graph
fills the same values at every replay, as each eager call copies them. A value that comes from
the call's Python state is frozen, as is any Python number an op reads (``x * self.scale``): a
non-tensor argument is guarded, and Python state the call changes is refused (core/effects.py).

The mode costs every op of a capture some host time, and a function mode is part of what a
compiled region is guarded on. So it is on only for a callable whose last warm-up made such a
constant (:func:`watching`, a dispatch mode that sees ``lift_fresh``), and for its later
captures (other sizes, which have no warm-up of their own: :func:`remembered`). Any other
callable captures exactly as before.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from torchreplay import _compat

__all__ = ["DeviceConstants", "watching", "remembered"]

#: the most elements a constant made with fills may have; a larger one fails to capture as before
MAX_ELEMENTS = 64

_Tensor = torch.Tensor
_GETITEM = _Tensor.__getitem__
_SETITEM = _Tensor.__setitem__
_NEW_TENSOR = _Tensor.new_tensor


def _plain(data: Any) -> bool:
    """Python numbers (bools too), or lists and tuples of them, nested: what ``torch.tensor``
    copies from the host."""
    if isinstance(data, (bool, int, float)):
        return True
    if isinstance(data, (list, tuple)):
        return all(_plain(d) for d in data)
    return False


def _on(device: Any, kind: str) -> bool:
    try:
        return device is not None and torch.device(device).type == kind
    except (RuntimeError, TypeError):
        return False


def _index_list(idx: Any) -> bool:
    """A flat list of ints used as an index. Not bools (a mask: its count depends on its
    values), not floats, and not a list of lists (torch reads ``x[[[0, 1]]]`` as the tuple
    ``x[[0, 1],]``, not as one tensor index)."""
    return isinstance(idx, list) and all(type(v) is int for v in idx)


def made_on_device(data: Any, dtype: Any, device: Any) -> _Tensor | None:
    """``torch.tensor(data, dtype=dtype, device=device)`` made with fill kernels (one when every
    value is the same), or None when it has more than :data:`MAX_ELEMENTS` elements."""
    host = torch.tensor(data, dtype=dtype)  # (on the CPU: nothing is copied)
    if host.numel() > MAX_ELEMENTS:
        return None
    values = host.reshape(-1).tolist()
    if len({repr(v) for v in values}) <= 1:  # (repr: -0.0 is not 0.0)
        return torch.full(host.shape, values[0] if values else 0, dtype=host.dtype, device=device)
    out = torch.empty(host.shape, dtype=host.dtype, device=device)
    flat = out.view(-1)
    for i, v in enumerate(values):
        flat[i].fill_(v)
    return out


def _rewritten(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], kind: str = "cuda"
) -> Callable[[], Any] | None:
    """The call that makes ``func(*args, **kwargs)``'s host constant with kernels, or None when
    it copies nothing from the host to a device of type ``kind``."""
    if func is torch.tensor or func is torch.as_tensor:
        data, device, dtype = args[0] if args else kwargs.get("data"), kwargs.get("device"), kwargs.get("dtype")
        if len(args) > 1 or not _plain(data) or not _on(device, kind) or kwargs.get("pin_memory"):
            return None

        def tensor() -> Any:
            out = made_on_device(data, dtype, device)
            if out is None:
                return func(*args, **kwargs)
            return out.requires_grad_() if kwargs.get("requires_grad") else out
        return tensor
    if func is _NEW_TENSOR:
        self, data = args[0], args[1] if len(args) > 1 else kwargs.get("data")
        device = kwargs.get("device") or self.device  # (None: self's, as for dtype)
        if not _plain(data) or not _on(device, kind):
            return None

        def new_tensor() -> Any:
            out = made_on_device(data, kwargs.get("dtype") or self.dtype, device)
            if out is None:
                return func(*args, **kwargs)
            return out.requires_grad_() if kwargs.get("requires_grad") else out
        return new_tensor
    if func is _GETITEM or func is _SETITEM:
        self, idx = args[0], args[1]
        if not isinstance(self, _Tensor) or self.device.type != kind:
            return None
        parts = idx if isinstance(idx, tuple) else (idx,)
        lists = [i for i, p in enumerate(parts) if _index_list(p)]
        value = args[2] if func is _SETITEM and len(args) > 2 else None
        list_value = func is _SETITEM and isinstance(value, (list, tuple)) and _plain(value)
        if not lists and not list_value:
            return None

        def index() -> Any:
            new = list(parts)
            for i in lists:
                made = made_on_device(parts[i], torch.long, self.device)
                if made is None:
                    return func(*args, **kwargs)
                new[i] = made
            new_idx = tuple(new) if isinstance(idx, tuple) else new[0]
            rest = list(args[2:])
            if list_value:
                made = made_on_device(value, self.dtype, self.device)
                if made is None:
                    return func(*args, **kwargs)
                rest[0] = made
            return func(self, new_idx, *rest, **kwargs)
        return index
    return None


class DeviceConstants(TorchFunctionMode):
    """While on: each host constant (see the module) is made with kernels on its device.
    ``kind``: the device type it acts for ("cpu" in the tests, where it changes nothing but
    how the values are made)."""

    def __init__(self, kind: str = "cuda") -> None:
        super().__init__()
        self.kind = kind

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        call = _rewritten(func, args, kwargs, self.kind)
        return call() if call is not None else func(*args, **kwargs)


class _Watch(_compat.LightDispatchMode):
    """Notes whether the call made a tensor from Python data on a device of type ``kind``
    (``lift_fresh`` of such a tensor: ``torch.tensor``, ``as_tensor``, indexing with a list), and
    changes nothing. A dispatch mode, as the build's other watches (a function mode would be a
    change of the mode stack that a compiled region inside is guarded on)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.seen = False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func in _LIFTS and args and isinstance(args[0], _Tensor) and args[0].device.type == self.kind:
            self.seen = True
        return func(*args, **(kwargs or {}))


_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


# The callables (a module, a function; a bound method's object) whose warm-up made one: their
# captures without a warm-up (later sizes, later pieces) turn the mode on too.
_NEEDING: weakref.WeakSet[Any] = weakref.WeakSet()


def _key(fn: Any) -> Any:
    owner = getattr(fn, "__self__", None)  # (not ``or``: a module with a length can be falsy)
    return fn if owner is None else owner


@contextlib.contextmanager
def watching(fn: Any, on: bool = True, kind: str = "cuda") -> Iterator[None]:
    """Around a warm-up call of ``fn`` (``on``: its last): note whether it makes a host constant
    on a device of type ``kind``, for :func:`remembered`."""
    if not on:
        yield
        return
    watch = _Watch(kind)
    with watch:
        yield
    with contextlib.suppress(TypeError):  # (not weakly referable: its later captures go without)
        if watch.seen:
            _NEEDING.add(_key(fn))
        else:
            _NEEDING.discard(_key(fn))


def remembered(fn: Any) -> bool:
    """Did the last watched warm-up of ``fn`` make a host constant on the device?"""
    try:
        return _key(fn) in _NEEDING
    except TypeError:
        return False
