"""What a training warm-up changes, saved before it changes and put back after capture.

Warm-up runs the user's code for real: a forward updates BatchNorm statistics, an optimizer step
moves parameters and creates its state (Adam's ``exp_avg``, ``exp_avg_sq``, ``step``), a
``GradScaler`` grows its scale, dropout advances the RNG. Building a graph must not count as
training steps, so :class:`StateKeeper` saves each of these before its first change and
:meth:`StateKeeper.restore` puts them back, with optimizer state that warm-up created reset to what
a fresh first step expects (the graph updates those tensors in place from then on).

Which modules and optimizers a training step touches is found while it runs: during the first
warm-up call, torch's global module-forward and optimizer-step pre-hooks (public API) report
each module before its forward and each optimizer before its step, which is exactly before its
state first changes.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

from torchreplay import _compat
from torchreplay.core.generators import Draws


__all__ = ["StateKeeper", "reset_fresh_state", "referenced_objects", "find_instances"]

log = logging.getLogger(__name__)


class _OptimizerState:
    """One optimizer's per-parameter state as it was before warm-up."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt
        self.saved: dict[int, dict[str, Any]] = {}
        with torch.no_grad():
            for group in opt.param_groups:
                for p in group["params"]:
                    st = opt.state.get(p)
                    if st:
                        self.saved[id(p)] = {
                            k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                            for k, v in st.items()
                        }

    def restore(self) -> None:
        opt = self.opt
        with torch.no_grad():
            for group in opt.param_groups:
                for p in group["params"]:
                    st = opt.state.get(p)
                    saved = self.saved.get(id(p))
                    if saved is None:
                        if st:
                            reset_fresh_state(opt, group, st)
                        continue
                    if st is None:  # pragma: no cover - state dropped during warm-up
                        continue
                    for k, v in saved.items():
                        cur = st.get(k)
                        # Copy into the tensor the graph uses; a Python value is set back.
                        if isinstance(cur, torch.Tensor) and isinstance(v, torch.Tensor) and (
                            cur.shape == v.shape
                        ):
                            cur.copy_(v)
                        else:
                            st[k] = v
                    new_keys = [k for k in st if k not in saved]
                    if new_keys:
                        reset_fresh_state(opt, group, st, keys=new_keys)


def _lr_value(group: dict[str, Any]) -> float:
    lr = group["lr"]
    return float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)


# The value each lazily created optimizer-state entry has right after its creation, when that is
# not zero. Keys are torch's own names: NAdam's mu_product, ASGD's eta and mu, Rprop's step_size.
_FRESH: dict[str, Callable[[dict[str, Any]], float]] = {
    "mu_product": lambda group: 1.0,
    "mu": lambda group: 1.0,
    "eta": _lr_value,
    "step_size": _lr_value,
}


def reset_fresh_state(
    opt: torch.optim.Optimizer,
    group: dict[str, Any],
    state: dict[str, Any],
    keys: Iterable[str] | None = None,
) -> None:
    """Reset one parameter's optimizer state, in place, to what its creation produces.

    The tensors stay the same objects (a captured graph updates them in place); only their
    values change. Every entry is zero when created except those in ``_FRESH``. SGD's
    momentum buffer is special: torch creates it as a copy of the first gradient, which a zero
    buffer reproduces only with ``dampening=0`` (:func:`torchreplay.training.optimizers.check_optimizer` refuses
    the other case).
    """
    with torch.no_grad():
        for k in list(state) if keys is None else keys:
            v = state[k]
            fresh = _FRESH[k](group) if k in _FRESH else 0.0
            if isinstance(v, torch.Tensor):
                v.fill_(fresh)
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                state[k] = type(v)(fresh)


class _ScalerState:
    """A ``GradScaler``'s scale, growth tracker and per-optimizer stages as they were before
    warm-up."""

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler
        st = _compat.grad_scaler_state(scaler)
        self.scale = st.scale.detach().clone() if st.scale is not None else None
        self.tracker = st.growth_tracker.detach().clone() if st.growth_tracker is not None else None
        self.per_optimizer = st.per_optimizer

    def restore(self) -> None:
        st = _compat.grad_scaler_state(self.scaler)
        with torch.no_grad():
            # The tensors that warm-up created lazily stay (the graph reads them); their values
            # go back to what the scaler starts with.
            if st.scale is not None:
                if self.scale is not None:
                    st.scale.copy_(self.scale)
                else:
                    st.scale.fill_(st.init_scale)
            if st.growth_tracker is not None:
                if self.tracker is not None:
                    st.growth_tracker.copy_(self.tracker)
                else:
                    st.growth_tracker.fill_(st.init_growth_tracker)
        _compat.set_grad_scaler_state(self.scaler, self.per_optimizer)


class StateKeeper:
    """Saves module state, optimizer state, gradients, ``GradScaler`` state and RNG; restores it.

    Args:
        device: the device whose RNG (besides the CPU's) is saved.
        modules: modules saved now, with their submodules (buffers, parameters and gradients).
        optimizers: optimizers saved now.
        scalers: ``GradScaler``\\ s saved now.
        on_optimizer: called with each optimizer before it is saved (it may raise, to refuse one).
        params: save modules' parameters and gradients too (not only buffers).

    Modules and optimizers met later, inside :meth:`discovering`, are saved when first met.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        modules: Iterable[torch.nn.Module] = (),
        optimizers: Iterable[torch.optim.Optimizer] = (),
        scalers: Iterable[Any] = (),
        on_optimizer: Callable[[torch.optim.Optimizer], None] | None = None,
        params: bool = True,
    ) -> None:
        self._device = device
        self._params = params
        self._tensors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._grads: dict[int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = {}
        self.modules: list[torch.nn.Module] = []
        self._module_ids: set[int] = set()
        #: Modules whose forward ran inside :meth:`discovering`, in call order.
        self.called_modules: list[torch.nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self._optimizer_states: list[_OptimizerState] = []
        self._on_optimizer = on_optimizer
        self._scalers = [_ScalerState(s) for s in scalers]
        self._cpu_rng = torch.get_rng_state()
        self._cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        #: the generators of the user's that the warm-ups drew from (core/generators.py)
        self.draws = Draws(device)
        for m in modules:
            self.add_module(m)
        for opt in optimizers:
            self.add_optimizer(opt)

    # -- saving ---------------------------------------------------------------------------------

    def add_module(self, module: torch.nn.Module, recurse: bool = True) -> None:
        """Save ``module``'s buffers, parameters and their gradients (once per module)."""
        for m in module.modules() if recurse else (module,):
            if id(m) in self._module_ids:
                continue
            self._module_ids.add(id(m))
            self.modules.append(m)
            for b in m.buffers(recurse=False):
                if b is not None:
                    self._save(b)
            if self._params:
                for p in m.parameters(recurse=False):
                    self._save(p)
                    self._save_grad(p)

    def add_optimizer(self, opt: torch.optim.Optimizer) -> None:
        """Save ``opt``'s state and its parameters (once per optimizer)."""
        if any(o is opt for o in self.optimizers):
            return
        if self._on_optimizer is not None:
            self._on_optimizer(opt)
        self.optimizers.append(opt)
        self._optimizer_states.append(_OptimizerState(opt))
        for group in opt.param_groups:
            for p in group["params"]:
                self._save(p)
                self._save_grad(p)

    def add_params(self, params: Iterable[torch.Tensor]) -> None:
        """Save these parameters and their gradients (those not saved yet)."""
        for p in params:
            self._save(p)
            self._save_grad(p)

    def _save(self, t: torch.Tensor) -> None:
        if id(t) not in self._tensors:
            with torch.no_grad():
                self._tensors[id(t)] = (t, t.detach().clone())

    def _save_grad(self, p: torch.Tensor) -> None:
        if id(p) not in self._grads:
            g = p.grad
            self._grads[id(p)] = (p, g, None if g is None else g.detach().clone())

    @property
    def params(self) -> list[torch.Tensor]:
        """Every saved parameter (module parameters and optimizer parameters), in saving order."""
        return [p for p, _, _ in self._grads.values()]

    @contextlib.contextmanager
    def discovering(self) -> Iterator[None]:
        """Within the block, save each module before its forward and optimizer before its step."""
        handles = [
            register_module_forward_pre_hook(self._module_hook),
            register_optimizer_step_pre_hook(self._optimizer_hook),
        ]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @contextlib.contextmanager
    def drawing(self, leaves: Iterable[Any]) -> Iterator[None]:
        """Around an eager run that :meth:`restore` undoes (``verify=``'s reference): the CUDA
        generators it draws from, the arguments among the call's ``leaves`` and those a module
        holds, are put back too, so that the replay after it draws the same numbers."""
        self.draws.keep(list(leaves))
        with self.draws.watch(compare=False):
            yield

    def _module_hook(self, module: torch.nn.Module, args: Any) -> None:
        # Not recursive: each submodule reports itself before its own forward, and a
        # submodule that is never called keeps its state anyway.
        if not any(m is module for m in self.called_modules):
            self.called_modules.append(module)
        self.add_module(module, recurse=False)

    def _optimizer_hook(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.add_optimizer(opt)

    # -- restoring ------------------------------------------------------------------------------

    def restore(self) -> None:
        """Put everything back: tensors' values in place, ``.grad`` objects and values, optimizer
        state (warm-up-created entries reset to fresh), scalers and RNG."""
        with torch.no_grad():
            for t, saved in self._tensors.values():
                t.copy_(saved)
            for p, g, saved in self._grads.values():
                if g is not None and saved is not None:
                    g.copy_(saved)
                if p.grad is not g:
                    p.grad = g
        for st in self._optimizer_states:
            st.restore()
        for sc in self._scalers:
            sc.restore()
        torch.set_rng_state(self._cpu_rng)
        if self._cuda_rng is not None:
            torch.cuda.set_rng_state(self._cuda_rng, self._device)
        self.draws.put_back()


def referenced_objects(fn: Callable[..., Any]) -> list[Any]:
    """Objects that ``fn`` can reach by name: its closure cells, the globals its code names, the
    ``self`` of a bound method (and that object's attributes), a partial's arguments.

    Used to find a ``GradScaler`` that a training step uses without passing it in; one level
    deep, so it finds ``scaler`` in ``def step(x): ... scaler.step(opt)`` and ``self.scaler``.
    """
    found: list[Any] = []
    target: Any = fn
    for _ in range(3):  # unwrap functools.partial / bound methods / functools.wraps
        if hasattr(target, "func") and hasattr(target, "args"):  # functools.partial
            found += list(target.args) + list((target.keywords or {}).values())
            target = target.func
        elif hasattr(target, "__self__") and hasattr(target, "__func__"):
            owner = target.__self__
            found.append(owner)
            found += list(getattr(owner, "__dict__", {}).values())
            target = target.__func__
        elif hasattr(target, "__wrapped__"):
            target = target.__wrapped__
        else:
            break
    if isinstance(target, torch.nn.Module):
        return found
    closure = getattr(target, "__closure__", None) or ()
    for cell in closure:
        try:
            found.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    code = getattr(target, "__code__", None)
    glob = getattr(target, "__globals__", None)
    if code is not None and glob is not None:
        found += [glob[n] for n in code.co_names if n in glob]
    return found


def find_instances(fn: Callable[..., Any], cls: type | tuple[type, ...]) -> list[Any]:
    """Return the distinct instances of ``cls`` among :func:`referenced_objects` of ``fn``."""
    out: list[Any] = []
    for obj in referenced_objects(fn):
        if isinstance(obj, cls) and not any(o is obj for o in out):
            out.append(obj)
    return out

