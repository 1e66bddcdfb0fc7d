"""Optimizers inside a captured training step: which can be captured, and the hyperparameters a
graph reads at every call (the learning rate, from a device tensor) or freezes (the others,
guarded at every call).
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch

from torchreplay import _compat
from torchreplay.errors import UnsupportedError

__all__ = [
    "check_optimizer",
    "check_scaler_support",
    "fused_hint",
    "reads_lr_tensor",
    "LrSlot",
    "GroupGuard",
]

_Tensor = torch.Tensor


def check_optimizer(opt: torch.optim.Optimizer) -> None:
    """Raise :class:`~torchreplay.UnsupportedError` unless ``opt.step()`` can be captured.

    Capturable: optimizers with a ``capturable`` flag that is on in every param group (Adam,
    AdamW, and torch's other optimizers that have the flag keep the step count on the device),
    and ``SGD``. ``SGD`` with momentum and ``dampening != 0`` is refused while it has no momentum
    buffers yet: torch's first step sets the buffer to the gradient and later steps to
    ``momentum * buf + (1 - dampening) * grad``, and a graph holds only the latter.
    """
    name = type(opt).__name__
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"optimizers must be torch.optim.Optimizer instances, got {name}")
    if "capturable" in opt.defaults:
        off = [i for i, g in enumerate(opt.param_groups) if not g.get("capturable", False)]
        if off:
            groups = "every param group" if len(off) == len(opt.param_groups) else f"param_groups {off}"
            raise UnsupportedError(
                f"{name} has capturable=False in {groups}: its step reads the step count on "
                f"the CPU, which a CUDA graph would freeze. Create it with "
                f"{name}(..., capturable=True) (with fused=True too if you like; learning rate "
                "schedulers keep working)"
            )
        return
    if isinstance(opt, torch.optim.SGD):
        for i, g in enumerate(opt.param_groups):
            if g.get("momentum", 0) != 0 and g.get("dampening", 0) != 0:
                fresh = [p for p in g["params"] if not opt.state.get(p)]
                if fresh:
                    raise UnsupportedError(
                        f"SGD param_groups[{i}] has momentum={g['momentum']} and "
                        f"dampening={g['dampening']} and no momentum buffers yet: torch's first "
                        "step sets the buffer to the gradient, later steps to momentum * buffer + "
                        "(1 - dampening) * gradient, and a graph holds only the second. Take one "
                        "eager step before graph_step, or use dampening=0"
                    )
        return
    raise UnsupportedError(
        f"{name} has no capturable=True option, so its step may read state on the CPU, which a "
        "CUDA graph would freeze; graph_step supports optimizers with a capturable flag (Adam, "
        "AdamW, ...: pass capturable=True) and SGD. Graph the forward and backward with "
        "torchreplay.make_graphed_callables and run this optimizer's step eagerly"
    )


def fused_hint(opt: torch.optim.Optimizer) -> str | None:
    """The faster setting for a captured step, when ``opt`` has a fused twin it does not use.

    A capturable foreach step launches several multi-tensor kernels per group of parameters and
    keeps its step counts on the device; the fused kernel does the whole update in one pass.
    Measured inside ``graph_step`` on an H100 (benchmarks/RESULTS.md): ResNet-50 training with
    ``AdamW(capturable=True)`` 4625 us at batch 1, with ``fused=True`` 3321 us.
    """
    if "fused" not in opt.defaults or any(g.get("fused") for g in opt.param_groups):
        return None
    params = [p for g in opt.param_groups for p in g["params"]]
    if not params or not all(p.is_cuda and p.dtype.is_floating_point for p in params):
        return None  # fused kernels need floating-point CUDA parameters
    name = type(opt).__name__
    return (
        f"{name}(capturable=True) runs a multi-kernel foreach step inside the graph; "
        f"{name}(..., capturable=True, fused=True) does the same update in one fused kernel "
        "per parameter group and is faster (ResNet-50 training step: 0.72x the time). Pass "
        "fused=True unless you need the foreach implementation"
    )


def check_scaler_support(opt: torch.optim.Optimizer) -> None:
    """Raise :class:`~torchreplay.UnsupportedError` unless ``GradScaler.step(opt)`` can be captured."""
    if not _compat.supports_amp_scaling(opt):
        name = type(opt).__name__
        raise UnsupportedError(
            f"GradScaler.step({name}) checks the gradients for inf/NaN with .item(), a host sync "
            "that a CUDA graph cannot capture, unless the optimizer has fused kernels that skip "
            f"the step on the device. Create it with fused=True ({name}(..., fused=True"
            + (", capturable=True" if "capturable" in opt.defaults else "")
            + ")), or train in bfloat16 autocast without a GradScaler"
        )


def reads_lr_tensor(opt: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Does this param group's step read a tensor learning rate on the device (inside a graph)?"""
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        return bool(group.get("capturable") or group.get("fused"))
    if isinstance(opt, torch.optim.SGD):
        return bool(group.get("fused"))
    return False


class LrSlot:
    """The device tensor a captured step reads its learning rate from, kept equal to
    ``group["lr"]`` (whatever the user or a scheduler put there) at every call."""

    def __init__(self, group: dict[str, Any], device: torch.device) -> None:
        self.group = group
        lr = group["lr"]
        if isinstance(lr, _Tensor) and lr.device == device and lr.numel() == 1 and (
            lr.dtype.is_floating_point
        ):
            self.tensor = lr  # the user's own device tensor: the graph reads it directly
        else:
            dtype = lr.dtype if isinstance(lr, _Tensor) and lr.dtype.is_floating_point else None
            self.tensor = torch.tensor(float(lr), dtype=dtype or torch.get_default_dtype(), device=device)
        self.value = float(lr) if not isinstance(lr, _Tensor) or lr.device.type == "cpu" else None
        #: The value at graphing time; warm-up must not change it (a scheduler inside the step).
        self.initial = float(self.tensor.item())  # as stored (float32), one sync at graphing
        self.last: Any = lr
        self._user: Any = lr

    def install(self) -> None:
        """Put the device tensor in the group (for warm-up, capture and verify's eager step)."""
        self._user = self.group["lr"]
        self.group["lr"] = self.tensor

    def uninstall(self) -> None:
        """Give the group back what the user had in it."""
        if self.group["lr"] is self.tensor:
            self.group["lr"] = self._user

    def sync(self) -> None:
        """Copy the group's current learning rate into the device tensor if it changed."""
        cur = self.group["lr"]
        if cur is self.tensor:
            return
        if isinstance(cur, _Tensor):
            if cur.device.type != "cpu":
                # Updated in place (a scheduler's fill_) without our seeing it: copy each call.
                self.tensor.copy_(cur.reshape(()))
                self.value = None
                return
            value = float(cur)
        elif cur is self.last:
            return
        else:
            self.last = cur
            value = float(cur)
        if value != self.value:
            self.tensor.fill_(value)
            self.value = value


class GroupGuard:
    """The hyperparameters of one param group that the graph froze, checked at every call."""

    _SKIP = ("params", "param_names", "initial_lr")

    def __init__(self, opt: torch.optim.Optimizer, index: int, group: dict[str, Any], lr_live: bool) -> None:
        self.label = f"{type(opt).__name__}.param_groups[{index}]"
        self.group = group
        skip = self._SKIP + (("lr",) if lr_live else ())
        self.keys = tuple(k for k in group if k not in skip)
        keys = self.keys
        # itemgetter returns a tuple for two keys or more: one C call per check.
        self._get: Callable[[dict[str, Any]], tuple[Any, ...]] = (
            operator.itemgetter(*keys) if len(keys) > 1 else (lambda g: tuple(g[k] for k in keys))
        )
        self.values = self._get(group)

    def changed(self) -> list[str]:
        """Keys whose value differs from capture time (empty when none)."""
        try:
            now = self._get(self.group)
        except KeyError:
            return [k for k in self.keys if k not in self.group]
        try:
            if now == self.values:
                return []
        except Exception:  # noqa: BLE001 - tensors that compare ambiguously: check one by one
            pass
        out = []
        for k, old, new in zip(self.keys, self.values, now):
            if old is new:
                continue
            try:
                same = bool(old == new)
            except Exception:  # noqa: BLE001
                same = False
            if not same:
                out.append(k)
        return out

    def error(self, keys: list[str]) -> str:
        parts = ", ".join(
            f"'{k}' from {self.values[self.keys.index(k)]!r} to {self.group.get(k)!r}"
            for k in keys
            if k in self.keys
        )
        lr_hint = (
            "; the learning rate can change between calls with Adam/AdamW(capturable=True) or "
            "SGD(fused=True), which read it from the device"
            if "lr" in keys
            else ""
        )
        return (
            f"{self.label} changed {parts} after graph_step captured the step, which froze "
            f"these values into the graph{lr_hint}. Graph the step again after changing them"
        )
