"""``tr.graph_step``: a whole training iteration (forward, backward, optimizer step, zero_grad) as
one CUDA graph.

``step_fn`` is ordinary training code that returns the loss (and anything else). Graphing it
takes ``num_warmup_iters`` eager steps (they create the optimizer's state and the per-stream
library handles) and one captured step; afterwards parameters, buffers, gradients, optimizer
state (state that warm-up created is reset to what a fresh first step expects), ``GradScaler``
state and RNG are back where they were, so N graphed steps equal N eager steps from there.

What the graph reads at every call, and what it freezes:

- The learning rate is read at every call. For ``Adam``/``AdamW`` (``capturable=True`` or
  ``fused=True``) and ``SGD(fused=True)`` the captured step reads it from a one-element tensor
  on the device; each call copies ``param_groups[i]["lr"]`` into that tensor when it changed
  (a float set by a scheduler, or a tensor updated in place or replaced), so LR schedulers work
  unchanged: call ``scheduler.step()`` outside the graphed step, as usual.
- Every other hyperparameter (betas, weight decay, momentum, and the learning rate of optimizers
  that read it as a Python number, such as ``SGD`` without ``fused=True``) is frozen into the
  graph; a call after it changed raises :class:`~torchreplay.ReplayInputError`.
- ``.grad`` follows eager semantics: after each call ``p.grad`` is the tensor the captured step
  left there (or None, for a step that ends with ``zero_grad()``).

Which modules and optimizers the step touches is found while warm-up runs (torch's global
module and optimizer pre-hooks); pass ``optimizers=`` to have them checked before anything runs.
While their hooks (forward, backward, gradient, optimizer step), which a replay does not run,
differ from the capture's, calls run the step eagerly (``stats.fallbacks``, one warning).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, Sequence

import torch

from torchreplay import _compat
from torchreplay.config import RANKS, GraphConfig, RankConfig
from torchreplay.core.args import CallArgs, fn_name, owning_module
from torchreplay.core.capture import capture, side_stream
from torchreplay.core.eager_form import EagerForm
from torchreplay.core.effects import PyState
from torchreplay.core.graphed import owned_by, resolve_config, resolve_pool
from torchreplay.core.io import Inputs
from torchreplay.core.outputs import Outputs
from torchreplay.core.placed import Placed
from torchreplay.core.modes import (
    AUTOCAST, HOOKS, NO_GRAD, NO_GRADIENT, PY_VALUE, REQUIRES_GRAD, EagerCalls, GradFlags, Hooks,
    refuse_inference_capture,
)
from torchreplay.core.pool import Pool, release_with
from torchreplay.core.threads import Callers, one_at_a_time
from torchreplay.distributed import EAGER, GRAPH, agreement
from torchreplay.errors import CaptureError, ReplayInputError, UnsupportedError
from torchreplay.stats import TrainingStats
from torchreplay.training.pair import capturing
from torchreplay.training.optimizers import (
    GroupGuard, LrSlot, check_optimizer, check_scaler_support, fused_hint, reads_lr_tensor,
)
from torchreplay.training.state import StateKeeper, referenced_objects
from torchreplay.training.step_parts import (
    Accumulated, StepGrads, as_optimizers, as_scalers, ddp_warmup, explained, param_names, roots_of,
    step_device,
)
from torchreplay.training.verify import (
    Tolerance,
    check_close,
    check_tree,
    check_verify,
    resolve_tolerance,
)

__all__ = ["graph_step", "GraphedStep", "check_optimizer", "check_scaler_support"]

log = logging.getLogger(__name__)
_Handles = _compat.hook_handles_made  # its next_id counts every hook handle torch made

_Tensor = torch.Tensor
_grad_enabled = torch.is_grad_enabled
_dynamo_tracing = _compat.dynamo_tracing


# -- the graphed step ----------------------------------------------------------------------------


class GraphedStep(EagerForm):
    """A training iteration captured as one CUDA graph; call it like ``step_fn``.

    Build it with :func:`torchreplay.graph_step`.

    Attributes:
        name: the step function's name.
        stats: counters (replays, fallbacks, verified, capture seconds, pool bytes).
        pool: the memory pool.
        optimizers: the optimizers the step uses (given or found during warm-up).
        static_args, static_kwargs: the static input buffers (write into them and call with
            them to skip the copy).
    """

    def __init__(
        self,
        step_fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        optimizers: Sequence[torch.optim.Optimizer],
        scalers: Sequence[Any],
        config: GraphConfig,
        pool: Pool | None,
        verify: int,
        tol: Tolerance | None,
        ranks: RankConfig = RANKS,
    ) -> None:
        self.fn = step_fn
        self.name = fn_name(step_fn)
        self.config = config
        self._verify_left = verify
        self._verify_total = verify
        self._tol = tol
        self._scalers = list(scalers)
        self.optimizers: list[torch.optim.Optimizer] = []
        self._lr_slots: list[LrSlot] = []
        self._guards: list[GroupGuard] = []
        self._warned_fallback = False
        self._eager_calls = EagerCalls(self.name, True)  # the autocast setting of the capture
        for opt in optimizers:  # before anything runs: refuse what cannot be captured
            check_optimizer(opt)
            if self._scalers:
                check_scaler_support(opt)
        call = CallArgs(step_fn, args, kwargs)
        device = step_device(step_fn, call, optimizers)
        self.device = device
        self.pool = pool if pool is not None else Pool(device)
        self.stats = TrainingStats(self.pool.reserved_bytes)
        with torch.no_grad():
            self._inputs = Inputs(call, device)
        del call  # it holds the caller's sample tensors
        self.static_args = self._inputs.static_args
        self.static_kwargs = self._inputs.static_kwargs

        # Modules and optimizers the step names are saved now, before it runs: a step that
        # begins with zero_grad() would otherwise drop the gradients before the pre-hooks see
        # them. Optimizers are adopted (checked, learning rate made live) when they step.
        named = referenced_objects(step_fn)
        module = owning_module(step_fn)
        modules = [module] if module is not None else []
        modules += [o for o in named if isinstance(o, torch.nn.Module)]
        keeper = StateKeeper(
            device,
            modules=modules,
            scalers=self._scalers,
            on_optimizer=self._adopt_optimizer,
        )
        # .grad the step may set with no optimizer stepping inside it (GradScaler, a plain leaf).
        opts = [o for o in named if isinstance(o, torch.optim.Optimizer)]
        leaves = [o for o in named if isinstance(o, torch.Tensor) and o.is_leaf and o.requires_grad]
        self._named_leaves = [p for o in opts for g in o.param_groups for p in g["params"]] + leaves
        keeper.add_params(self._named_leaves)
        warmup = ddp_warmup(modules, config.num_warmup_iters)
        if warmup != config.num_warmup_iters:
            config = dataclasses.replace(config, num_warmup_iters=warmup)
        self._keeper = keeper
        self._discovered = False
        self._grads_before: list[torch.Tensor | None] = []
        self._grads_after: list[torch.Tensor | None] = []
        self._params: list[torch.Tensor] = []
        self._accumulated: set[int] = set()

        def call(*a: Any, **k: Any) -> Any:
            return self._capture_fn(*a, **k)

        call.__qualname__ = self.name  # capture() names the callable in its messages
        call.owner = self  # type: ignore[attr-defined]
        self._capture_call = call
        python = PyState(self.name, step_fn, self.static_args, self.static_kwargs, lambda: modules, reads=True)
        try:
            for opt in optimizers:
                keeper.add_optimizer(opt)
            with _compat.autocast_cache_disabled():
                captured = capture(
                    self._capture_call,
                    self.static_args,
                    self.static_kwargs,
                    device=device,
                    stream=side_stream(device),
                    pool=self.pool,
                    config=config,
                    grad=True,
                    warmup=True,
                    snapshot=keeper,  # type: ignore[arg-type]
                    watch=[s.static for s in self._inputs.tensor_slots],
                    effects=python,  # the Python state it changes: core/effects.py
                    free_warmup=True,  # (the warm-up step's activations, for the pool)
                )
        except CaptureError as exc:
            self._uninstall()
            if isinstance(exc.__cause__, (UnsupportedError, ReplayInputError)):
                raise exc.__cause__ from None
            better = explained(exc, self.name, modules, [*optimizers, *opts])
            if better is not None:
                raise better from exc
            raise
        except BaseException:
            self._uninstall()
            keeper.restore()
            raise
        keeper.restore()
        self._uninstall()
        self._keeper = None  # type: ignore[assignment]
        self._capture_call = None  # only capture needs it (it refers back to self: a cycle)

        self._identity = [
            (opt, opt.state, opt.param_groups, len(opt.param_groups)) for opt in self.optimizers
        ]
        roots = roots_of(keeper.called_modules)
        self._roots = roots
        self._modes = [(m, m.training) for m in roots]
        # The modules it ran, moved or with weights or submodules replaced (core/placed.py).
        self._placed = Placed.of(roots, device, objects=True)
        # hooks the step ran at capture only (its modules', its parameters' gradient hooks,
        # its optimizers'): added or removed since, eagerly they would run, or not
        self._hooks = Hooks(roots, backward=True, tensors=self._params, optimizers=self.optimizers)
        self._eager_calls.hooks = self._hooks  # named in its warning
        self._param_names = param_names(self._params, roots, self.optimizers)
        # .grad after each call must be what the captured step left there (step_parts.StepGrads)
        self._grads = StepGrads(
            self._params, self._grads_before, self._grads_after, self._accumulated, self._param_names
        )
        # a layer frozen or unfrozen since capture: calls run eagerly
        self._grad_flags = GradFlags([p for m in roots for p in m.parameters()] + self._params, roots)
        self._reads = python.reads()  # tensors in Python state it reads: replaced since, it raises
        self._eager_calls.values = self._reads.values if self._reads is not None else None  # plain

        leaves, spec = _compat.tree_flatten(captured.out)
        owned = owned_by(self.pool, self._inputs)
        out = _compat.tree_unflatten(
            [t.detach() if isinstance(t, _Tensor) and owned(t) else t for t in leaves], spec
        )
        self._outputs = Outputs(out, config.outputs, self.name, owned)
        self._graph = captured.graph
        self._replay = _compat.direct_replay(captured.graph)
        self._inputs.set_written(captured.written)
        self._writes = bool(self._inputs.written or self._inputs.rebound)  # (generators: moved on)
        self.stats.written_inputs = self._inputs.written_paths()
        self._position = self.pool.register(self)
        self.pool.track(self, [self._graph], self._outputs.retire)
        self.stats.captures = 1
        self.stats.capture_seconds = captured.seconds
        self.collectives = captured.collectives
        self._ranks = agreement(
            ranks, captured.collectives, captured.collective_log, name=self.name, device=device
        )
        release_with(self, self.collectives, self._ranks)
        self._device_index = device.index
        self._check_device = torch.cuda.device_count() > 1
        self._callers = Callers()
        log.info(
            "torchreplay: captured training step '%s' on %s in %.3f s (%d optimizer(s), %d "
            "parameters, outputs=%s)",
            self.name,
            device,
            captured.seconds,
            len(self.optimizers),
            len(self._params),
            self._outputs.policy,
        )

    # -- capture -------------------------------------------------------------------------------

    def _adopt_optimizer(self, opt: torch.optim.Optimizer) -> None:
        """Check an optimizer the step uses, and make its learning rate live (before its first
        step runs)."""
        check_optimizer(opt)
        if self._scalers:
            check_scaler_support(opt)
        hint = fused_hint(opt)
        if hint is not None:
            log.warning("torchreplay: graph_step '%s': %s", self.name, hint)
        self.optimizers.append(opt)
        for i, group in enumerate(opt.param_groups):
            live = reads_lr_tensor(opt, group)
            if live:
                slot = LrSlot(group, self.device)
                slot.install()
                self._lr_slots.append(slot)
            self._guards.append(GroupGuard(opt, i, group, lr_live=live))

    def _capture_fn(self, *args: Any, **kwargs: Any) -> Any:
        keeper = self._keeper
        if capturing():
            params = self._touched_params()
            self._params = params
            self._grads_before = [p.grad for p in params]
            with Accumulated(params) as acc:  # which .grad a backward inside the step writes
                out = self.fn(*args, **kwargs)
            self._grads_after, self._accumulated = [p.grad for p in params], acc.seen
            return out
        with keeper.discovering() if not self._discovered else contextlib.nullcontext():
            out = self.fn(*args, **kwargs)
        self._discovered = True
        self._check_unchanged_in_warmup()
        return out

    def _touched_params(self) -> list[torch.Tensor]:
        """Parameters of the optimizers that stepped and of the modules that ran, in order."""
        keeper = self._keeper
        out: list[torch.Tensor] = []
        seen: set[int] = set()
        groups = [g["params"] for opt in self.optimizers for g in opt.param_groups]
        modules = (m.parameters(recurse=False) for m in keeper.called_modules)
        for params in [*groups, *modules, self._named_leaves]:
            for p in params:
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def _check_unchanged_in_warmup(self) -> None:
        for slot in self._lr_slots:
            if slot.group["lr"] is not slot.tensor or float(slot.tensor.item()) != slot.initial:
                raise UnsupportedError(
                    f"'{self.name}' replaced a learning rate while it ran (a scheduler.step() "
                    "inside the step?): a graph would replay the value it had at capture. Call "
                    "scheduler.step() outside the graphed step; graph_step reads the learning "
                    "rate at every call"
                )
        for guard in self._guards:
            keys = guard.changed()
            if keys:
                raise UnsupportedError(
                    f"'{self.name}' changed {guard.label} {keys} while it ran (a scheduler "
                    "inside the step?): a graph would replay the values it had at capture. "
                    "Change hyperparameters outside the graphed step"
                )

    def _uninstall(self) -> None:
        for slot in self._lr_slots:
            slot.uninstall()

    # -- replay --------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _dynamo_tracing():  # called from code torch.compile traces: run outside it
            return _compat.call_untraced(self, args, kwargs)
        fallback = False
        for module, training in self._modes:  # a loop, not any(): no generator per call
            if module.training != training:
                fallback = True
                break
        autocast = not fallback and self._eager_calls.autocast_changed()
        hooks = self._hooks
        hooked = hooks.at != _Handles.next_id and not hooks.look()
        no_grad = not _grad_enabled()  # no_grad or inference_mode: eagerly the backward fails
        frozen = self._grad_flags.changed()
        unset = self._grads.missing()
        values = self._eager_calls.values  # a flag, a scale the step's code read, changed since
        valued = values is not None and values.changed()
        placed = self._placed  # a step takes milliseconds: the check's method, not inlined
        reads = self._reads  # or a tensor in Python state it reads replaced (core/effects.py)
        stale = placed.error(self.name) if placed is not None and placed.changed() else (
            reads and reads.replaced(self.name))
        if self._ranks is not None:  # collectives inside (DDP): every rank replays, or all raise
            eager = fallback or autocast or no_grad or stale or hooked or frozen or unset or valued
            self._ranks(0, EAGER if eager else GRAPH)
        if stale:
            raise stale
        if autocast:  # called under another autocast setting than captured: other dtypes
            return self._eager_calls.run(self.fn, args, kwargs, AUTOCAST, self.stats)
        if no_grad:
            return self._eager_calls.run(self.fn, args, kwargs, NO_GRAD, self.stats)
        if fallback:
            return self._fallback(args, kwargs)
        if hooked:
            return self._eager_calls.run(self.fn, args, kwargs, HOOKS, self.stats)
        if frozen:
            what = self._grad_flags.describe()
            return self._eager_calls.run(self.fn, args, kwargs, REQUIRES_GRAD, self.stats, what)
        if unset:  # eagerly the optimizer skips it: a replay would step it
            return self._eager_calls.run(self.fn, args, kwargs, NO_GRADIENT, self.stats, unset)
        if valued:
            return self._eager_calls.run(self.fn, args, kwargs, PY_VALUE, self.stats)
        return one_at_a_time(self, self._dispatch, args, kwargs)  # core/threads.py

    def _dispatch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._verify_left:
            return self._verified_call(args, kwargs)
        return self._run(args, kwargs)

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        leaves = self._inputs.copy_in(args, kwargs)
        if self._writes:
            self._inputs.check_aliasing(leaves)
        self._sync_optimizers()
        self._grads.sync()
        if self.pool.shared:
            self.pool.before_replay(self._position)
        self._replay()
        if self._writes:  # eager semantics: the step's writes reach the caller's tensors
            self._inputs.copy_back(leaves)
        self.stats.replays += 1
        return self._outputs.emit()

    def _sync_optimizers(self) -> None:
        for opt, state, groups, n in self._identity:
            if opt.state is not state or opt.param_groups is not groups or len(groups) != n:
                raise ReplayInputError(
                    f"{type(opt).__name__}'s state or param groups were replaced or extended "
                    "after graph_step captured the step (optimizer.load_state_dict or "
                    "add_param_group?); the graph still updates the tensors it captured. Change "
                    "the optimizer before graphing, or graph the step again"
                )
        for guard in self._guards:
            keys = guard.changed()
            if keys:
                raise ReplayInputError(guard.error(keys))
        for slot in self._lr_slots:
            slot.sync()

    def invalidate_outputs(self) -> None:
        """Mark the outputs handed out so far as stale (another graph may overwrite them)."""
        self._outputs.invalidate()

    # -- verify --------------------------------------------------------------------------------

    def _verified_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # The first K calls are compared, whatever their outcome: count this one now.
        self._verify_left -= 1
        call = self._verify_total - self._verify_left
        self._sync_optimizers()
        self._grads.sync()
        keeper = StateKeeper(
            self.device, modules=self._roots, optimizers=self.optimizers, scalers=self._scalers
        )
        keeper.add_params(self._params)  # parameters outside the modules (optimizer-only) too
        leaves, spec = _compat.tree_flatten((tuple(args), dict(kwargs)))
        ref_args, ref_kwargs = _compat.tree_unflatten(
            [t.detach().clone() if isinstance(t, _Tensor) else t for t in leaves], spec
        )
        for slot in self._lr_slots:
            slot.install()
        try:
            with torch.enable_grad(), keeper.drawing(leaves):
                ref_out = self.fn(*ref_args, **ref_kwargs)
        finally:
            self._uninstall()
        ref_leaves, ref_spec = _compat.tree_flatten(ref_out)
        ref_out = _compat.tree_unflatten(
            [t.detach().clone() if isinstance(t, _Tensor) else t for t in ref_leaves], ref_spec
        )
        ref_params = [p.detach().clone() for p in self._params]
        keeper.restore()  # the graph steps from the state eager started from
        out = self._run(args, kwargs)
        check_tree("output", out, ref_out, call=call, name=self.name, tol=self._tol)
        for label, p, want in zip(self._param_names, self._params, ref_params):
            check_close(
                f"parameter '{label}' after the step", p, want, call=call, name=self.name, tol=self._tol
            )
        self.stats.verified += 1
        return out

    def _fallback(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.stats.fallbacks += 1
        if not self._warned_fallback:
            self._warned_fallback = True
            log.warning(
                "torchreplay: a module of training step '%s' changed train/eval mode since "
                "capture; running the step eagerly (counted in stats.fallbacks)",
                self.name,
            )
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"GraphedStep({self.name}, device={self.device}, {self.stats.explain()})"


def graph_step(
    step_fn: Callable[..., Any],
    *sample_args: Any,
    optimizers: Any = None,
    scaler: Any = None,
    outputs: str | None = None,
    num_warmup_iters: int | None = None,
    pool: Any = None,
    capture_error_mode: str | None = None,
    config: GraphConfig | None = None,
    verify: int = 0,
    verify_tol: Any = None,
    ranks: RankConfig | None = None,
    sample_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> GraphedStep:
    """Capture one training iteration ``step_fn(*sample_args, **sample_kwargs)`` as a CUDA graph.

    ``step_fn`` is ordinary code: forward, loss, ``backward()``, ``optimizer.step()``,
    ``zero_grad()`` (at its start or end), optionally under ``torch.autocast`` and with a
    ``GradScaler``; it returns the loss and whatever else, as tensors. The returned
    :class:`GraphedStep` replays the whole iteration in one launch.

    Args:
        step_fn: the training step.
        *sample_args: positional arguments of one step (e.g. a batch ``x, y``).
        optimizers: the optimizer(s) the step uses, checked before anything runs. Optional:
            the ones the step calls are found during warm-up anyway.
        scaler: the ``GradScaler`` the step uses; one the step reaches by name (a global, a
            closure variable, ``self.scaler``) is found without it.
        outputs: output policy, as for :func:`torchreplay.graph` (default ``"checked"``).
        num_warmup_iters: eager steps before capture (default 3; at least 1, since optimizers
            create their state in their first step). They do not count: state is restored.
        pool: a :class:`~torchreplay.Pool` (or graphed object, or raw handle) to capture into.
        capture_error_mode: passed to the capture.
        config: a :class:`~torchreplay.config.GraphConfig`; explicit keywords override it.
        verify: the first ``verify`` calls also run the step eagerly from the same state and
            compare outputs and parameters after the step (:class:`~torchreplay.VerifyError`).
        verify_tol: ``(rtol, atol)`` for ``verify`` (default: per dtype).
        ranks: a :class:`~torchreplay.config.RankConfig`: with collectives in the step (a
            ``DistributedDataParallel`` model's gradient all-reduce), the ranks check before
            each replay that all replay (or all fall back), and raise on every rank otherwise.
        sample_kwargs: keyword arguments of the step, for names that clash with the options.
        **kwargs: keyword arguments of the step.

    Returns:
        a :class:`GraphedStep`.

    .. warning::
        Optimizers must be capturable: ``Adam``/``AdamW`` (and torch's other optimizers with the
        flag) with ``capturable=True``, or ``SGD``. Others raise
        :class:`~torchreplay.UnsupportedError` naming the flag. Where torch has a fused kernel,
        use it: ``AdamW(params, capturable=True, fused=True)`` is the fastest captured step (one
        warning says so when a capturable optimizer is not fused).

    .. warning::
        Call ``scheduler.step()`` outside the graphed step. The learning rate is read at every
        call (Adam/AdamW with ``capturable=True`` or ``fused=True``, ``SGD(fused=True)``); other
        hyperparameters, and the learning rate of other optimizers, are frozen into the graph and
        a call after they changed raises :class:`~torchreplay.ReplayInputError`.

    .. warning::
        Load checkpoints in place (``model.load_state_dict(sd)``, ``optimizer.load_state_dict``
        before graphing). A model moved or given new parameter objects (``assign=True``, a new
        ``nn.Parameter``, a layer replaced) raises :class:`~torchreplay.ReplayInputError` at
        the next call: the graph would keep training the tensors it captured.

    .. warning::
        With a ``GradScaler``, the optimizer must be fused (``fused=True``): the unfused
        ``GradScaler.step`` syncs with the host. bfloat16 autocast needs no scaler.

    .. note::
        DistributedDataParallel: every rank builds the graphed step at the same point. Warm-up
        takes at least 11 eager steps (DDP times its first 10 iterations on the host, which a
        capture cannot hold); they do not count either. Build the DDP module with the default
        ``find_unused_parameters=False`` (finding them reads the graph on the host).

    .. warning::
        Tensors the step changes that belong to no module, optimizer or ``GradScaler`` (a global
        step counter tensor, say) are not restored after warm-up.
    """
    if not callable(step_fn):
        raise TypeError(f"step_fn must be callable, got {type(step_fn).__name__}")
    refuse_inference_capture("graph_step")
    if sample_kwargs:
        clash = set(sample_kwargs) & set(kwargs)
        if clash:
            raise TypeError(f"keyword arguments given twice: {sorted(clash)}")
        kwargs = {**kwargs, **sample_kwargs}
    opts = as_optimizers(optimizers)
    scalers = as_scalers(scaler, step_fn)
    verify = check_verify(verify)
    tol = resolve_tolerance(verify_tol)
    cfg = resolve_config(config, outputs=outputs, num_warmup_iters=num_warmup_iters,
                         capture_error_mode=capture_error_mode)
    if cfg.num_warmup_iters < 1:
        raise ValueError(
            f"graph_step needs num_warmup_iters >= 1, got {cfg.num_warmup_iters}: optimizers "
            "create their state (Adam's exp_avg, step) in their first step, which must run "
            "before capture"
        )
    return GraphedStep(
        step_fn, sample_args, kwargs, optimizers=opts, scalers=scalers, config=cfg,
        pool=resolve_pool(pool), verify=verify, tol=tol, ranks=RANKS if ranks is None else ranks,
    )
