"""The tensors held in Python state that a graph reads (an object's attribute, a list's or
dict's item, a global; not a module's parameters or buffers: ``core/placed.py``), found by a
dispatch mode over the first capture (:class:`ReadWatch`) and checked at each replay
(:class:`StateReads`): one put in place of another since, or, for a tensor off the graph's
device that the call read on the host, one written in place since, raises
:class:`ReplayInputError`. What decides which tensors are watched: ``core/effects.py``."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.overrides import TorchFunctionMode

from torchreplay._compat import LightDispatchMode
from torchreplay.core.frozen import FrozenValues
from torchreplay.core.pystate import MISSING, Node, live_value, path_of, show
from torchreplay.errors import ReplayInputError

__all__ = ["ReadWatch", "StateReads", "on_device"]


class StateReads:
    """The tensors held in Python state that a graph reads, each where it was at capture: an
    object's attribute, a list's or dict's item, a global (not a module's parameters or
    buffers: ``core/placed.py``). A caller that puts another tensor there between calls
    (``cache.keys = torch.zeros(...)``, a plain tensor attribute of a module recomputed) leaves
    the graph reading the old one. :meth:`replaced` is asked at each replay: an identity test
    per place; and the old tensor is kept alive, so a replay never reads freed memory.

    ``frozen``: the version counters at capture of those off the graph's device that the call
    read on the host (:class:`ReadWatch`); such a tensor written in place since is an error
    too, as the graph keeps what the capture read."""

    __slots__ = ("_dicts", "_others", "_frozen", "_armed", "values")

    def __init__(
        self,
        places: list[tuple[Node, Any, torch.Tensor]],
        frozen: dict[int, int] | None = None,
        values: FrozenValues | None = None,
    ) -> None:
        self.values = values or None  # the plain values its code read (core/frozen.py: the
        # graphs' EagerCalls test them, and run a call eagerly while one differs)
        self._dicts: list[tuple[dict[Any, Any], Any, torch.Tensor, str]] = []
        self._others: list[tuple[Node, Any, torch.Tensor, str]] = []
        self._frozen: list[tuple[torch.Tensor, int, str]] = []
        self._armed = False
        frozen = frozen or {}
        for node, key, t in places:
            d = node.obj if node.kind in ("dict", "global") else None
            attrs = getattr(node.obj, "__dict__", None) if node.kind == "attrs" else None
            if isinstance(attrs, dict) and attrs.get(key, MISSING) is t:
                d = attrs  # (an attribute of __dict__, not a slot)
            if d is not None:
                self._dicts.append((d, key, t, path_of(node, key)))
            else:
                self._others.append((node, key, t, path_of(node, key)))
            if id(t) in frozen:
                self._frozen.append((t, frozen[id(t)], path_of(node, key)))

    def arm(self) -> None:
        """At the end of the build, once: take the versions from here on (the build's last
        put-back of what its warm-ups wrote moved them; the values are the capture's)."""
        if not self._armed:
            self._armed = True
            self._frozen = [(t, t._version, path) for t, _, path in self._frozen]

    def replaced(self, name: str) -> ReplayInputError | None:
        """The error for the first place that holds another tensor now, or for a tensor read on
        the host that was written since; or None."""
        for d, key, t, path in self._dicts:
            if d.get(key, MISSING) is not t:
                return _replaced_error(name, path, t, d.get(key, MISSING), self._host_read(t))
        for node, key, t, path in self._others:
            now = live_value(node, key)
            if now is not t:
                return _replaced_error(name, path, t, now, self._host_read(t))
        for t, version, path in self._frozen:
            if t._version != version:
                return _host_read_error(name, path, t)
        return None

    def _host_read(self, t: torch.Tensor) -> bool:
        return any(f is t for f, _, _ in self._frozen)


def _replaced_error(name: str, path: str, old: torch.Tensor, now: Any, host: bool = False) -> ReplayInputError:
    if host:
        return _host_read_error(name, path, old, now)
    return ReplayInputError(
        f"{path} is {show(now)}, but '{name}' was captured reading {show(old)} there: the graph "
        "reads the old tensor at every replay, not the one put there since. Write new values "
        "into the captured tensor in place (`.copy_(new)`, `.zero_()`), or graph again"
    )


def _host_read_error(name: str, path: str, t: torch.Tensor, now: Any = MISSING) -> ReplayInputError:
    what = "was written in place since" if now is MISSING else f"was replaced since (by {show(now)})"
    return ReplayInputError(
        f"{path} (a {t.dtype} tensor{tuple(t.shape)} on {t.device}) {what}, but '{name}' read it "
        "on the host while it was captured (a value taken from it, or a 0-dim CPU operand of a "
        "device op): a replay runs only the device's work and keeps the capture's value, where "
        "eagerly each call reads it again. Keep it on the graph's device (`register_buffer`, or "
        "`.to(device)` once) and write it in place there, read it inside a break (`breaks=`), "
        "or graph again"
    )


_COPIES = (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default)
# Ops that take only a tensor's shape, dtype and device (a view reads nothing either: what is
# done with it later reads the same storage, and is seen then).
_METADATA_ONLY = frozenset(
    f"aten::{op}" for op in (
        "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
        "randint_like", "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full",
    )
)


class ReadWatch(LightDispatchMode):
    """Record which of ``tensors`` the ops run inside it read (by storage, views included);
    with the graph's ``device``, which of those off it were read on the host (:attr:`host_read`:
    by any op but a copy to the device, which a replay repeats)."""

    def __init__(self, tensors: Sequence[torch.Tensor], device: torch.device | None = None) -> None:
        super().__init__()
        self._by_ptr = {t.untyped_storage().data_ptr(): id(t) for t in tensors}
        self.read: set[int] = set()
        self.host_read: set[int] = set()
        self._device = device
        self.paused = 0  # inside an eager part: its reads are not the graph's

    def add(self, t: torch.Tensor) -> None:
        self._by_ptr[t.untyped_storage().data_ptr()] = id(t)

    def host_calls(self) -> Any:
        """A context that sees ``Tensor.tolist`` and ``Tensor.numpy`` of the watched tensors
        off the graph's device, which read their memory without an op (None: no device)."""
        return _HostCalls(self) if self._device is not None else None

    def _saw_on_host(self, t: torch.Tensor) -> None:
        hit = self._by_ptr.get(t.untyped_storage().data_ptr())
        if hit is not None and self._device is not None and not on_device(t, self._device):
            self.read.add(hit)
            self.host_read.add(hit)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # as WriteWatch: a compiled region runs its compiled code

    def __torch_dispatch__(
        self, func: Any, types_: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        for a in (*args, *kwargs.values()):
            for t in a if isinstance(a, (list, tuple)) else (a,):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    hit = self._by_ptr.get(t.untyped_storage().data_ptr())
                    if hit is not None:
                        self.read.add(hit)
                        if self._device is not None and _host_read(func, args, kwargs, t, self._device):
                            self.host_read.add(hit)
        return func(*args, **kwargs)


_NO_OP_READS = (torch.Tensor.tolist, torch.Tensor.numpy)


class _HostCalls(TorchFunctionMode):
    """Reads on the host that dispatch no op (``Tensor.tolist``, ``Tensor.numpy``), for a
    :class:`ReadWatch`."""

    def __init__(self, watch: ReadWatch) -> None:
        super().__init__()
        self.watch = watch

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func in _NO_OP_READS and args and isinstance(args[0], torch.Tensor) and not self.watch.paused:
            self.watch._saw_on_host(args[0])
        return func(*args, **(kwargs or {}))


def on_device(t: torch.Tensor, device: torch.device) -> bool:
    """Is ``t`` on ``device`` (any index where ``device`` names none)?"""
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def _host_read(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], t: torch.Tensor, device: torch.device) -> bool:
    """Is ``t``, an argument of ``func``, off ``device`` and read by the host at capture? A copy
    of it to the device (pinned memory) is read by each replay; its destination is no read."""
    if on_device(t, device) or getattr(func, "is_view", False):
        return False
    name = getattr(func, "name", None)  # (an OpOverload's "aten::zeros_like")
    if callable(name) and name() in _METADATA_ONLY:
        return False
    if func is _COPIES[0]:  # copy_(dst, src): a copy to the device reads src at replay
        return args[1] is t and not on_device(args[0], device)
    if func is _COPIES[1]:  # _to_copy(src, device=...): to the device, read at replay
        to = kwargs.get("device")
        return to is None or torch.device(to).type != device.type
    return True
