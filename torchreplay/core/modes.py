"""Calls an inference graph runs eagerly because the graph cannot do what eager does (internal).

A graph replays what it recorded: the kernels of the CUDA autocast setting it was captured
under, with no autograd. Eagerly:

- a module switched between train and eval runs other code (dropout, batch statistics);
- a call under another autocast setting computes in other dtypes and returns them;
- a call under a ``TorchDispatchMode`` sends every op through it: ``FlopCounterMode`` counts
  them, ``FakeTensorMode`` and a tracer (``make_fx``, non-strict ``torch.export``) follow fake
  tensors through them and record them; a replay would hide them (and hand real outputs to a
  trace as constants);
- a call with autograd on and an argument that requires grad records a backward to that
  argument (a frozen network used as a loss, an input-gradient attribution);
- a call inside another graph's capture (a graphed submodule of a model then graphed whole, or
  captured by ``torch.cuda.graph``) has its kernels recorded into that graph, where CUDA allows
  no replay (:meth:`~torchreplay.core.pool.Pool.on_stream` tells, when the stream changes).

Replaying would give another result than eager, or no gradient, silently. So ``tr.graph`` (one
shape, ``sizes=`` and ``breaks=``) runs such a call as the plain callable, warns once per
reason naming the fix (a dispatch mode and a capture are only logged: they are what the caller
asked for), and counts it in ``stats.fallbacks``; the next call in the captured setting
replays again. ``graph_step`` does the same for another autocast setting.
``make_graphed_callables`` records autograd itself and raises ``ReplayInputError`` on another
autocast setting instead: its backward cannot run eagerly once its forward has replayed.

Autograd through the module's parameters alone (grad mode on, no argument requiring grad) is
not a reason: most inference code runs without ``torch.no_grad()`` and never calls backward.
The graph's outputs carry no autograd history; ``tr.graph``'s docstring says so.

A parameter frozen or unfrozen since a training graph's capture (``requires_grad_``) is a
reason for ``graph_step`` and ``make_graphed_callables`` (:class:`GradFlags`): eagerly it gets
no gradient (or one), and an optimizer skips it (or updates it); a replay computes the
gradients it captured.

Forward hooks added to the module (or any of its submodules, or globally) after capture, or
removed, are a reason: a replay runs none of the hook's code, and still runs the tensor work of
a removed one (:class:`Hooks`). Hooks present at capture are recorded into the graph: their
tensor work replays, their Python side effects (a list of features, a counter) happened at
capture only, which is said once, when the graph is made.

``torch.inference_mode`` is no reason either: a graph records no autograd, so it replays the
same kernels under it, at capture or at a call. Our own buffers are normal tensors in either
mode (``_compat.normal_tensors``), so that a graph captured under it can be called outside it;
outputs are made in the caller's mode, as eager's are. A training step is different: eagerly
its backward fails with autograd off, so ``graph_step`` runs a call under ``torch.no_grad()`` or
``inference_mode`` eagerly (:data:`NO_GRAD`, where eager raises its own error), and
``make_graphed_callables`` and ``graph_step`` refuse to capture under ``inference_mode``
(:func:`refuse_inference_capture`).
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Callable, Sequence

import torch

from torchreplay import _compat
from torchreplay.core.capture import warn_mode_changed
from torchreplay.errors import CaptureError

__all__ = [
    "TRAIN_MODE", "AUTOCAST", "DISPATCH_MODE", "GRAD", "CAPTURE", "NO_GRAD", "HOOKS", "REQUIRES_GRAD", "TRANSFORM",
    "NO_GRADIENT", "REPLICA", "PY_VALUE",
    "EagerCalls", "GradFlags", "Hooks", "autocast_changed", "autocast_name", "refuse_inference_capture",
    "note_dispatch_mode", "note_transform", "replica_elsewhere", "tracked_leaf", "warn_autocast", "warn_hooks_changed",
    "warn_hooks_with_effects", "warn_no_sample_grad", "warn_replica", "warn_requires_grad", "warn_value_changed",
]

log = logging.getLogger(__name__)

TRAIN_MODE = "train/eval mode"
AUTOCAST = "autocast"
DISPATCH_MODE = "a TorchDispatchMode"
GRAD = "autograd"
CAPTURE = "another graph's capture"
NO_GRAD = "autograd off"
HOOKS = "forward hooks"
REQUIRES_GRAD = "requires_grad"
TRANSFORM = "a torch.func transform"
NO_GRADIENT = "a parameter without a gradient"
REPLICA = "an nn.DataParallel replica"
PY_VALUE = "a Python value the model read"

_Tensor = torch.Tensor
_any_autocast = _compat.any_autocast
_cuda_autocast = _compat.cuda_autocast
_dispatch_modes = _compat.dispatch_modes
_Handles = _compat.hook_handles_made  # its next_id counts every hook handle torch made
_forward_hooks = _compat.forward_hooks


def autocast_name(dtype: torch.dtype | None) -> str:
    return "no autocast" if dtype is None else f"autocast({str(dtype).removeprefix('torch.')})"


class Hooks:
    """The hooks a call of ``module`` runs (its own, its submodules', the global ones), as at
    capture: forward hooks; with ``backward``, backward hooks too, and the gradient hooks of
    ``tensors`` and the step hooks of ``optimizers`` (a training graph replays none of their code
    either). ``own`` False leaves out the module's own hooks (``make_graphed_callables``: they run
    eagerly around the graphed forward); ``skip``, those of modules that run eagerly at every
    call (inside a break). The per-call test is ``at != RemovableHandle.next_id and
    not look()``: one attribute read while no hook handle was made anywhere since the last look
    (which compares them all, O(modules + tensors)). While they differ, ``at`` is -1: every call
    looks again, so removing the hook lets calls replay again."""

    __slots__ = ("_modules", "_captured", "at", "_backward", "_tensors", "_optimizers")

    def __init__(
        self,
        module: torch.nn.Module | Sequence[torch.nn.Module] | None,
        *,
        own: bool = True,
        backward: bool = False,
        tensors: Sequence[torch.Tensor] = (),
        optimizers: Sequence[torch.optim.Optimizer] = (),
        skip: Sequence[torch.nn.Module] = (),
    ) -> None:
        roots = [] if module is None else [module] if isinstance(module, torch.nn.Module) else module
        mods = [m for root in roots for m in root.modules()]
        mods = mods if own else mods[1:]  # not own: of one module
        skipped = {id(m) for m in skip}
        self._modules = [m for m in mods if id(m) not in skipped] if skipped else mods
        self._backward = backward
        self._tensors = list(tensors)
        self._optimizers = list(optimizers)
        self.at = _Handles.next_id
        self._captured = self._state()

    def _state(self) -> list[Any]:
        dicts = [*_compat.global_forward_hooks()]
        if self._backward:
            dicts += [*_compat.global_backward_hooks(), *_compat.global_optimizer_hooks()]
        state: list[Any] = [tuple(d) for d in dicts]
        for m in self._modules:  # O(modules): only after a handle was made
            own = _forward_hooks(m) + _compat.backward_hooks(m) if self._backward else _forward_hooks(m)
            if any(own):
                state.append((id(m), *map(tuple, own)))
        for obj, of in (*((t, _compat.tensor_hooks) for t in self._tensors),
                        *((o, _compat.optimizer_hooks) for o in self._optimizers)):
            own = of(obj)
            if any(own):
                state.append((id(obj), *map(tuple, own)))
        return state

    def look(self) -> bool:
        """Look again; return whether they still are the captured ones."""
        same = self._state() == self._captured
        self.at = _Handles.next_id if same else -1
        return same

    def changed_names(self) -> str:
        """The modules (tensors, optimizers) whose hooks differ from capture (for the warning)."""
        names = {id(m): type(m).__name__ for m in self._modules}
        names.update((id(t), f"a tensor of shape {tuple(t.shape)}") for t in self._tensors)
        names.update((id(o), type(o).__name__) for o in self._optimizers)
        state = self._state()
        n = 6 if self._backward else 2  # the global dicts come first
        now = {k[0]: k for k in state[n:]}
        then = {k[0]: k for k in self._captured[n:]}
        diff = [names[i] for i in set(now) | set(then) if now.get(i) != then.get(i)]
        if state[:n] != self._captured[:n]:
            diff.append("the global hooks")
        return ", ".join(sorted(diff)[:5]) or "?"

    def with_effects(self) -> list[str]:
        """Modules with hooks at capture whose code is not torch's own (weight_norm, pruning
        and spectral_norm hooks only compute tensors): their Python side effects happen once.
        A function's or method's ``__module__`` is where it was defined; a hook object's, its
        class's."""
        return [
            type(m).__name__ for m in self._modules for hooks in _forward_hooks(m)
            for h in hooks.values() if not (getattr(h, "__module__", None) or "").startswith("torch.")
        ]

    def backward_ones(self) -> list[str]:
        """Modules with backward hooks or pre-hooks now, and the global ones: code that a
        backward graphed from ops recorded below autograd (training with breaks) never runs."""
        found = [type(m).__name__ for m in self._modules if any(_compat.backward_hooks(m))]
        if any(_compat.global_backward_hooks()):
            found.append("every module (register_module_full_backward_hook)")
        return found


def warn_autocast(name: str, captured: torch.dtype | None) -> None:
    """Log (once per graph: the caller keeps the flag) that calls under another autocast
    setting than the capture's run eagerly."""
    log.warning(
        "torchreplay: '%s' was captured under %s but is called under %s: a graph computes in the "
        "dtypes it was captured in, so calls under this setting run eagerly (counted in "
        "stats.fallbacks). Graph it under this setting to replay it there.",
        name, autocast_name(captured), autocast_name(_cuda_autocast()),
    )


def note_dispatch_mode(name: str) -> None:
    """Log (what the caller asked for: no warning) that a call runs eagerly under a mode."""
    log.info(
        "torchreplay: '%s' is called under a TorchDispatchMode: it runs its callable, so that "
        "the mode sees every op as it would eagerly", name,
    )


def note_transform(name: str) -> None:
    """Log (what the caller asked for: no warning) that a call runs eagerly in a transform."""
    log.info(
        "torchreplay: '%s' is called inside a torch.func transform (vmap, grad, jvp) or with "
        "forward-AD duals: it runs its callable eagerly there, as the transform expects", name,
    )


def replica_elsewhere(forward: Any, index: int | None) -> bool:
    """Is ``forward`` (a graph that is a module's forward) called by an ``nn.DataParallel``
    replica of that module on another GPU than the graph's (device ``index``; None: this process
    sees one GPU, so no)? Its weights there are copies made for this call: only its own forward,
    run eagerly, computes what eager DataParallel does (``_compat.replica_calling``)."""
    return index is not None and torch.cuda.current_device() != index and _compat.replica_calling(forward) is not None


def warn_replica(name: str) -> None:
    """Log (once per graph: the caller keeps the flag) that replicas on other GPUs run eagerly."""
    log.warning(
        "torchreplay: '%s' is run by nn.DataParallel (Hugging Face's Trainer uses it on a "
        "machine with several GPUs when not launched by torchrun): its replicas on other GPUs "
        "than the graph's hold copies of the weights made anew at every call, which no graph "
        "can read, so their calls run their own forward eagerly (counted in stats.fallbacks); "
        "the call on the graph's GPU replays. To replay on every GPU, use "
        "DistributedDataParallel (torchrun: each process graphs its own model), or run on one "
        "GPU (CUDA_VISIBLE_DEVICES=0).", name,
    )


def warn_hooks_with_effects(name: str, hooks: Hooks) -> None:
    """Log that hooks present at capture run their Python only then (none: nothing)."""
    hooked = hooks.with_effects()
    if hooked:
        log.warning(
            "torchreplay: '%s' has forward hooks (on %s): they run while the graph is "
            "captured, so their tensor work replays every call, but their Python side effects "
            "(appending to a list, logging, counting) happen only then. Hooks added or "
            "removed after capture make calls run eagerly.",
            name, ", ".join(sorted(set(hooked))[:5]),
        )


def warn_hooks_changed(name: str, hooks: Hooks) -> None:
    """Log (once per graph: the caller keeps the flag) that hooks changed since capture."""
    log.warning(
        "torchreplay: hooks of '%s' changed since capture (on %s): a replay would run none of a "
        "new hook's code and still the tensor work of a removed one, so calls run eagerly while "
        "they differ (counted in stats.fallbacks). Remove them to replay again, or graph it "
        "again with them (their tensor work then replays; their Python side effects happen at "
        "capture only).",
        name, hooks.changed_names(),
    )


def refuse_inference_capture(what: str) -> None:
    """Raise when a training graph (``what``) is captured under ``torch.inference_mode``: the
    tensors made there have no autograd, so the backward it records cannot run."""
    if torch.is_inference_mode_enabled():
        raise CaptureError(
            f"{what} was called under torch.inference_mode(): it records a backward, and no "
            "tensor made under inference_mode has autograd (torch.enable_grad() inside it does "
            f"not change that). Call {what} outside inference_mode; for inference, graph the "
            "model with tr.graph, which may be captured and called under inference_mode"
        )


class GradFlags:
    """``requires_grad`` of the parameters a training graph can give gradients to, as at capture.

    A layer frozen since (``requires_grad_(False)``) gets no gradient eagerly, so an optimizer
    skips it; one unfrozen gets one and is updated. A replay computes the gradients it captured:
    a captured optimizer step updates the frozen layer, the unfrozen one stays as it was,
    silently. ``graph_step`` watches every parameter; ``make_graphed_callables`` only those
    that did not require grad at capture (autograd drops a gradient for one that no longer does).
    """

    __slots__ = ("tensors", "flags", "names")

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        modules: Sequence[torch.nn.Module | None] = (),
        only_unfrozen: bool = False,
    ) -> None:
        names = {id(p): n for m in modules if m is not None for n, p in m.named_parameters()}
        seen: dict[int, torch.Tensor] = {}
        for t in tensors:
            if not (only_unfrozen and t.requires_grad):
                seen.setdefault(id(t), t)
        self.tensors = list(seen.values())
        self.names = [names.get(id(t), f"a tensor {tuple(t.shape)}") for t in self.tensors]
        self.flags = [t.requires_grad for t in self.tensors]

    def changed(self) -> bool:
        """Does any ``requires_grad`` differ from capture (an attribute read per parameter)?"""
        return bool(self.tensors) and list(map(_requires_grad, self.tensors)) != self.flags

    def describe(self) -> str:
        """The parameters whose ``requires_grad`` changed, with it then and now."""
        now = [t.requires_grad for t in self.tensors]
        diff = [f"{n} ({a} -> {b})" for n, a, b in zip(self.names, self.flags, now) if a != b]
        return ", ".join(diff[:4]) + (f" and {len(diff) - 4} more" if len(diff) > 4 else "")


_requires_grad = operator.attrgetter("requires_grad")


def autocast_changed(name: str, captured: torch.dtype | None) -> str:
    """The error of a ``make_graphed_callables`` forward called under another autocast setting
    (its backward cannot run eagerly once its forward has replayed)."""
    return (
        f"'{name}' was graphed under {autocast_name(captured)} but is called under "
        f"{autocast_name(_cuda_autocast())}; the graph always computes in the precision it was "
        "captured in. Call it under the same autocast setting, or graph it again under this one"
    )


def warn_no_sample_grad(name: str, path: str) -> None:
    """Log (once per argument: the caller keeps the flags) that a training graph's argument
    requires grad while its sample did not, so it gets no gradient."""
    log.warning(
        "torchreplay: %s of '%s' requires grad, but its sample argument did not, so the "
        "backward graph computes no gradient for it (its .grad stays None, and nothing flows "
        "back through it). Graph with a sample that has requires_grad=True to get it, or pass "
        "it .detach()ed to silence this", path, name,
    )


def warn_requires_grad(name: str, what: str) -> None:
    log.warning(
        "torchreplay: requires_grad of parameters of '%s' changed since capture: %s. Eagerly a "
        "frozen parameter gets no gradient and no update, an unfrozen one does; a replay computes "
        "the gradients it captured. Such calls run eagerly (counted in stats.fallbacks). Graph "
        "it again after freezing or unfreezing layers to replay it.", name, what,
    )


def warn_value_changed(name: str, change: str) -> None:
    log.warning(
        "torchreplay: %s, but '%s' read it at capture: its graph replays none of the code that "
        "read it, and would compute with the old value (and take the branches it chose). Calls "
        "while it differs run eagerly (counted in stats.fallbacks); set it back to replay, or "
        "graph again after changing it. A value that must change at every call belongs in a "
        "tensor written in place (`buf.fill_(v)`), or inside a break (`breaks=`)", change, name,
    )


def tracked_leaf(leaves: Sequence[Any]) -> int | None:
    """The index of the first tensor among ``leaves`` that requires grad while autograd is on:
    eagerly the call would record a backward to it. ``None`` otherwise."""
    if not torch.is_grad_enabled():
        return None
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, _Tensor) and leaf.requires_grad:
            return i
    return None


class EagerCalls:
    """One graph's reasons to run a call eagerly: the CUDA autocast setting it was captured
    under (``autocast``: the dtype, ``None`` when off), and which reasons it has warned about.

    :meth:`reason` tests the module's mode, the autocast setting and the dispatch modes;
    ``tr.graph``'s one-shape hot path inlines it. Either costs two C calls when autocast was
    off at capture and no mode is on. The
    autograd reason is found where the arguments are copied in, at no cost when no argument
    requires grad.
    """

    __slots__ = ("name", "training", "autocast", "hooks", "values", "_warned")

    def __init__(self, name: str, training: bool, module: torch.nn.Module | None = None) -> None:
        self.name = name
        self.training = training
        self.autocast = _compat.cuda_autocast()
        self.hooks = Hooks(module)
        self.values: Any = None  # the plain values its code read (core/frozen.py), after the build
        self._warned: set[str] = set()
        warn_hooks_with_effects(name, self.hooks)

    def autocast_changed(self) -> bool:
        return (self.autocast is not None or _any_autocast()) and _cuda_autocast() != self.autocast

    def reason(self, module: torch.nn.Module | None, leaves: Sequence[Any] | None = None) -> str | None:
        """Why this call runs eagerly: the module's train/eval mode or the autocast setting
        changed since capture, or (only when ``leaves`` are given: graphs whose ranks agree
        before the copy-in) autograd must record a backward to an argument. ``None``: replay."""
        if module is not None and module.training != self.training:
            return TRAIN_MODE
        autocast = self.autocast  # autocast_changed, inline: every call of sizes= and breaks=
        if (autocast is not None or _any_autocast()) and _cuda_autocast() != autocast:
            return AUTOCAST
        if _dispatch_modes():
            return DISPATCH_MODE
        hooks = self.hooks
        if hooks.at != _Handles.next_id and not hooks.look():
            return HOOKS
        values = self.values
        if values is not None and values.changed():
            return PY_VALUE
        if leaves is not None and tracked_leaf(leaves) is not None:
            return GRAD
        return None

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        why: str,
        stats: Any,
        what: str = "an argument",
    ) -> Any:
        """Count the call, warn once for ``why`` (``what``: the argument that requires grad),
        and run ``fn`` eagerly."""
        stats.fallbacks += 1
        seen = why if why != PY_VALUE else self.values.last  # (each value changed, once)
        if seen not in self._warned:
            self._warned.add(seen)
            self._warn(why, what)
        return fn(*args, **kwargs)

    def _warn(self, why: str, what: str) -> None:
        if why == TRAIN_MODE:
            warn_mode_changed(self.name, self.training)
        elif why == DISPATCH_MODE:  # what the caller asked for: no warning
            note_dispatch_mode(self.name)
        elif why == TRANSFORM:  # what the caller asked for: the transform sees each op
            note_transform(self.name)
        elif why == CAPTURE:  # what eager code does there: not a degradation, no warning
            log.info(
                "torchreplay: '%s' is called inside another CUDA graph's capture: it runs its "
                "callable there, recorded into that graph", self.name,
            )
        elif why == NO_GRAD:
            log.warning(
                "torchreplay: '%s' is called with autograd off (torch.no_grad() or "
                "torch.inference_mode()): eagerly its backward would fail, so such calls run "
                "the step eagerly, where it raises or does what the step itself enables "
                "(counted in stats.fallbacks). Call the step with autograd on to replay it.",
                self.name,
            )
        elif why == HOOKS:
            warn_hooks_changed(self.name, self.hooks)
        elif why == REPLICA:
            warn_replica(self.name)
        elif why == PY_VALUE:
            warn_value_changed(self.name, self.values.last)
        elif why == REQUIRES_GRAD:
            warn_requires_grad(self.name, what)
        elif why == AUTOCAST:
            warn_autocast(self.name, self.autocast)
        elif why == NO_GRADIENT:
            log.warning(
                "torchreplay: '%s' reads the .grad of %s, which is None at this call: eagerly "
                "the optimizer skips such a parameter, and a replay cannot (it would step it on "
                "a zero gradient), so such calls run eagerly (counted in stats.fallbacks). To "
                "replay, give every parameter the step updates a gradient, or build the step "
                "on the parameters that have one.",
                self.name, what,
            )
        else:
            log.warning(
                "torchreplay: '%s' is called with autograd on and %s requiring grad: eagerly the "
                "call records a backward to it, which an inference graph cannot, so such calls "
                "run eagerly (counted in stats.fallbacks). To replay the graph, call it under "
                "torch.no_grad() or pass %s.detach(); to train through graphs, use "
                "tr.make_graphed_callables.",
                self.name, what, what,
            )
