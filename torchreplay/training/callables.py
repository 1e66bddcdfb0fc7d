"""``tr.make_graphed_callables``: forward and backward as CUDA graphs inside one autograd node,
a drop-in superset of ``torch.cuda.make_graphed_callables``.

This module checks the arguments, captures the graphs and hands them to
:class:`~torchreplay.training.graphed_callable.GraphedCallable` (the replay side: argument guards, the
autograd node, gradient accumulation, replay order).

Capture follows torch's rule for graphs that share a pool: each callable is warmed up (forward and
backward, eagerly, on the side stream) and its forward captured, in the order given; then the
backwards are captured in reverse order, so that replaying forward 1..N then backward N..1 is the
order the pool's memory was laid out for. Module state and RNG that warm-up changed are restored
afterwards; the autocast weight cache is off while warming up and capturing (see
:func:`make_graphed_callables`).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence, overload

import torch

from torchreplay import _compat
from torchreplay.config import GraphConfig
from torchreplay.core.args import CallArgs, infer_device
from torchreplay.core.capture import capture, side_stream
from torchreplay.core.eager_form import EagerForm
from torchreplay.core.effects import PyState
from torchreplay.core.graphed import owned_by, resolve_config, resolve_pool
from torchreplay.core.io import graph_copyable
from torchreplay.core.modes import refuse_inference_capture, replica_elsewhere
from torchreplay.core.pool import Pool, release_with
from torchreplay.stats import TrainingStats
from torchreplay.training.graphed_callable import GraphedCallable
from torchreplay.training.pair import Order, Pair, output_reach, retire_pair
from torchreplay.training.state import StateKeeper
from torchreplay.training.verify import check_verify, resolve_tolerance

__all__ = ["make_graphed_callables", "graph_callables", "GraphedCallable", "Launchless", "TrainingStats"]

log = logging.getLogger(__name__)

_Tensor = torch.Tensor


# -- capture ---------------------------------------------------------------------------------


def _capture_pairs(
    runners: Sequence[GraphedCallable], *, device: torch.device, pool: Pool, config: GraphConfig
) -> list[Pair | None]:
    """Warm up and capture forward 1..N, then backward N..1, into ``pool``; None for a
    callable whose forward launches no kernel (a :class:`Launchless`)."""
    stream = side_stream(device)
    forwards = []
    python: list[PyState] = []
    for r in runners:
        python.append(forward_effects(r))
        forwards.append(
            capture(
                r._warm_fn,
                r._inputs.static_args,
                r._inputs.static_kwargs,
                device=device,
                stream=stream,
                pool=pool,
                config=config,
                grad=True,
                warmup=True,
                snapshot=r._keeper,  # type: ignore[arg-type]
                watch=[s.static for s in r._inputs.tensor_slots],
                effects=python[-1],  # the Python state its forward changes: core/effects.py
                free_warmup=True,  # (the record's and warm-up's memory, for the pool)
                allow_launchless=True,  # (nn.Flatten, nn.Identity: run eagerly, see _build)
                # The graph copies its tensor arguments in itself, as its first nodes: a call
                # points them at its tensors, and launches no copy (_compat/copy_nodes.py).
                copy_in=r._inputs.copied_by_graph(),
            )
        )
    pairs: list[Pair | None] = [None] * len(runners)
    for i in reversed(range(len(runners))):
        r, fwd = runners[i], forwards[i]
        if fwd.graph is None:  # it launches no kernel (core/failures.py): nothing to replay
            forwards[i] = None  # type: ignore[call-overload]
            del fwd
            continue
        leaves, spec = _compat.tree_flatten(fwd.out)
        owned = owned_by(pool, r._inputs)
        diff_idx = [
            j
            for j, o in enumerate(leaves)
            if isinstance(o, _Tensor) and o.requires_grad and owned(o)
        ]
        bwd = None
        grads: list[torch.Tensor | None] = []
        grad_outputs: list[torch.Tensor] = []
        reach: tuple[int, ...] = ()
        seconds = fwd.seconds
        if diff_idx and r._grad_inputs:
            # Outside the pool: they must outlive every later capture into it.
            grad_outputs = [torch.empty_like(leaves[j]) for j in diff_idx]
            outputs = [leaves[j] for j in diff_idx]
            inputs, allow_unused = r._grad_inputs, r._allow_unused
            reach = output_reach(outputs, inputs)  # (before the backward frees the graph)

            def backward() -> Any:
                return torch.autograd.grad(
                    outputs, inputs, grad_outputs=grad_outputs, allow_unused=allow_unused
                )

            backward.__qualname__ = f"{r.name} (backward)"
            bwd = capture(
                backward,
                (),
                {},
                device=device,
                stream=stream,
                pool=pool,
                config=config,
                grad=True,
                warmup=False,
                snapshot=r._keeper,  # type: ignore[arg-type]
                allow_empty=True,  # (gradients handed on as they are: no kernel, eagerly too)
                # The incoming gradients are copied in by the graph's own first nodes, as the
                # forward's arguments are: a backward points them and launches no copy.
                copy_in=grad_outputs if graph_copyable(grad_outputs) else [],
            )
            grads = list(bwd.out)
            seconds += bwd.seconds
            del outputs, backward
        # Keep the outputs' memory, drop their autograd history (freed by the backward capture).
        kept = [o.detach() if isinstance(o, _Tensor) and owned(o) else o for o in leaves]
        pairs[i] = Pair(
            fwd_replay=_compat.direct_replay(fwd.graph),
            bwd_replay=(_compat.direct_replay(bwd.graph) if bwd.graph is not None else _replays_nothing)
            if bwd is not None else None,
            leaves=kept,
            spec=spec,
            diff_idx=diff_idx,
            owned=owned,
            static_grad_outputs=grad_outputs,
            static_grad_inputs=grads,
            graphs=(fwd.graph, bwd.graph if bwd is not None else None),
            seconds=seconds,
            written=fwd.written,
            collectives=fwd.collectives + (bwd.collectives if bwd is not None else ()),
            collective_log=fwd.collective_log or (bwd.collective_log if bwd is not None else None),
            reads=python[i].reads(),
            generators=fwd.generators,
            copies=fwd.copies,
            spares=fwd.spares,
            bwd_copies=bwd.copies if bwd is not None else (),
            bwd_spares=bwd.spares if bwd is not None else (),
            reach=reach,
        )
        forwards[i] = None  # type: ignore[call-overload]
        del leaves, fwd, bwd
    return pairs


def _replays_nothing() -> None:
    """The replay of a backward that launches no kernel (its gradients are the incoming ones)."""


def forward_effects(r: GraphedCallable) -> PyState:
    """The Python state ``r``'s forward can change, compared around its capture
    (core/effects.py); its :meth:`~PyState.reads` are the tensors in that state the forward
    reads, checked at every call."""
    return PyState(
        r.name, r.fn, r._inputs.static_args, r._inputs.static_kwargs,
        modules=lambda: [r._module] if r._module is not None else (r._called or []),
        reads=True,
    )


class Launchless(EagerForm):
    """A callable of :func:`make_graphed_callables` whose forward launches no kernel: it returns
    its arguments or views of them (``nn.Flatten``, ``nn.Identity``, ``nn.Dropout(p=0)`` in a
    tuple of layers), or of its parameters (a learned positional embedding's
    ``self.weight[:n]``). A graph would replay nothing, so every call runs it as it is: its
    outputs are views of the caller's tensors (or of the parameters), with eager's autograd,
    as eagerly. (Torch's tool captures an empty graph and hands out views of its own static
    inputs, which the next call overwrites.)

    Attributes:
        name: the callable's name.
        stats: all zero: nothing was captured, nothing replays, no call falls back.
        pool: the memory pool of the callables graphed with it.
    """

    _eager_attr = "_run_fn"
    #: what it does at a call, as ``repr`` and ``tr.explain`` say it
    WHY = "launches no kernel, so every call runs it eagerly"

    def __init__(self, runner: GraphedCallable, pool: Pool) -> None:
        self.fn = runner.fn
        self.name = runner.name
        self.device = runner.device
        self.config = runner.config
        self.pool = pool
        self.stats = TrainingStats(pool.reserved_bytes)
        self._run_fn = runner._run_fn
        # (several GPUs: an nn.DataParallel replica elsewhere runs its own forward, whose
        # views are of its own weights, not of the original's on another GPU)
        self._multi = self.device.index if torch.cuda.device_count() > 1 else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._multi is not None and replica_elsewhere(self, self._multi):
            return self._eager_fn()(*args, **kwargs)
        return self._run_fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Launchless({self.name}, device={self.device}: it {self.WHY})"


def _build(runners: list[Any], device: torch.device, pool: Pool, config: GraphConfig) -> None:
    """Capture every runner's graphs into ``pool``, leave module state and RNG as they were,
    and register the graphs in capture order; a runner whose forward launches no kernel is
    replaced in ``runners`` by its :class:`Launchless`."""
    start = time.perf_counter()
    keeper = (
        StateKeeper(device, modules=[r._module for r in runners if r._module is not None])
        if config.restore_state
        else None
    )
    for r in runners:
        r._keeper = keeper
        if r._module is not None:
            _warn_inner_hooks(r._module, r.name)
    try:
        with _compat.autocast_cache_disabled():
            pairs = _capture_pairs(runners, device=device, pool=pool, config=config)
    except BaseException:
        # capture() undid the failing graph; the graphs captured before it go with the
        # exception's frames, and the state goes back to where it was.
        if keeper is not None:
            keeper.restore()
        raise
    finally:
        for r in runners:
            r._keeper = None
    if keeper is not None:
        keeper.restore()
    graphed = []
    for k, (r, pair) in enumerate(zip(runners, pairs)):
        if pair is None:
            runners[k] = Launchless(r, pool)  # type: ignore[call-overload]
            log.info("torchreplay: %r", runners[k])
            continue
        r._adopt(pair, pool)
        pool.track(r, [g for g in pair.graphs if g is not None], retire_pair(r._outputs, pair))
        release_with(r, r.collectives, r._ranks)
        graphed.append(r)
    for r in graphed:  # each reports its outputs to the pool (core/pool.py)
        r._fwd_pos = pool.register(r.fwd_member, reports=True)
        r._outputs.on_live = pool.on_live(r._fwd_pos)
    for r in reversed(graphed):
        r._bwd_pos = -1
        if r._has_backward:
            r._bwd_pos = pool.register(r.bwd_member, reports=True)
            r._input_grads.on_live = pool.on_live(r._bwd_pos)
    log.info(
        "torchreplay: graphed %d callable(s) for training (%s) on %s in %.3f s",
        len(runners),
        ", ".join(r.name for r in runners),
        device,
        time.perf_counter() - start,
    )


def _warn_inner_hooks(module: torch.nn.Module, name: str) -> None:
    hooked = [
        sub_name
        for sub_name, sub in module.named_modules()
        if sub is not module and _compat.module_hooks(sub)
    ]
    if hooked:
        log.warning(
            "torchreplay: hooks on submodules of '%s' (%s) run inside the graph: their tensor "
            "work replays every call, but their Python side effects (appending to a list, "
            "logging, counters) happened only during capture",
            name,
            ", ".join(hooked[:5]) + (", ..." if len(hooked) > 5 else ""),
        )


# -- public entry point ----------------------------------------------------------------------


@overload
def make_graphed_callables(
    callables: torch.nn.Module | Callable[..., Any],
    sample_args: tuple[Any, ...],
    num_warmup_iters: int | None = ...,
    allow_unused_input: bool = ...,
    pool: Any = ...,
    *,
    sample_kwargs: dict[str, Any] | None = ...,
    outputs: str | None = ...,
    capture_error_mode: str | None = ...,
    config: GraphConfig | None = ...,
    verify: int = ...,
    verify_tol: Any = ...,
) -> Any: ...


@overload
def make_graphed_callables(
    callables: tuple[Any, ...] | list[Any],
    sample_args: tuple[tuple[Any, ...], ...] | list[Any],
    num_warmup_iters: int | None = ...,
    allow_unused_input: bool = ...,
    pool: Any = ...,
    *,
    sample_kwargs: Sequence[dict[str, Any] | None] | None = ...,
    outputs: str | None = ...,
    capture_error_mode: str | None = ...,
    config: GraphConfig | None = ...,
    verify: int = ...,
    verify_tol: Any = ...,
) -> tuple[Any, ...]: ...


def make_graphed_callables(
    callables: Any,
    sample_args: Any,
    num_warmup_iters: int | None = None,
    allow_unused_input: bool = False,
    pool: Any = None,
    *,
    sample_kwargs: Any = None,
    outputs: str | None = None,
    capture_error_mode: str | None = None,
    config: GraphConfig | None = None,
    verify: int = 0,
    verify_tol: Any = None,
) -> Any:
    """Graph the forward and backward of each callable; return drop-in replacements.

    A superset of ``torch.cuda.make_graphed_callables`` with the same positional arguments and
    meaning: each result runs its callable's forward as one CUDA graph inside one autograd node
    whose backward replays the backward graph. A module comes back itself, with ``forward``
    replaced (calling it in the other train/eval mode runs the original forward eagerly, counted
    in ``module.forward.stats.fallbacks``); a function comes back as a :class:`GraphedCallable`.

    Beyond torch's: keyword arguments and non-tensor arguments (constants, guarded at every
    call); pytree outputs, outputs that do not require grad, inputs that do not need a
    gradient; buffers (BatchNorm statistics update once per call) and warm-up that leaves
    parameters, buffers and RNG as it found them; autocast with or without its weight cache;
    dropout (a fresh mask each call, the same masks as eager from the same seed); gradient
    accumulation (``.grad`` accumulates g1 + g2, never aliases the graph); parameters used
    through closures get gradients; a module's own hooks run eagerly around every call; checked
    replay order for callables that share a pool; ``verify=K``; a callable that launches no
    kernel (``nn.Flatten`` between two layers: it returns a view of its argument) runs eagerly,
    its output a view of the caller's tensor as eagerly (a :class:`Launchless`).

    Args:
        callables: a module or function, or a tuple of them; a tuple shares one memory pool and
            must be given in the order the callables run.
        sample_args: the positional arguments of one call (a tuple), or one tuple per callable.
            A tensor's ``requires_grad`` says whether that argument gets a gradient.
        num_warmup_iters: eager forward+backward calls before capture (default 3).
        allow_unused_input: allow tensor arguments and parameters that the outputs do not
            depend on (their gradient is None).
        pool: a :class:`~torchreplay.Pool`, a graphed object with ``.pool`` or a raw torch pool
            handle to capture into.
        sample_kwargs: the keyword arguments of one call (a dict), or one per callable.
        outputs: output policy, as for :func:`torchreplay.graph` (default ``"checked"``).
        capture_error_mode: passed to the capture (``"global"`` by default).
        config: a :class:`~torchreplay.config.GraphConfig`; explicit keywords override it.
        verify: the first ``verify`` calls also run eagerly from the same state and compare
            outputs, buffers and gradients; a difference raises
            :class:`~torchreplay.VerifyError`.
        verify_tol: ``(rtol, atol)`` for ``verify`` (default: per dtype).

    Returns:
        the graphed callable, or a tuple of them.

    .. note::
        Callables that share a pool replay fastest called in the order they were given, their
        backwards in reverse (as one ``backward()`` over all of them does). A backward that
        would read activations another replay overwrote, a higher-order gradient
        (``create_graph=True``) and a second backward of one forward (``retain_graph=True``) run
        the forward again eagerly and differentiate it (eager's gradients; one warning per
        reason; ``stats.recomputed``).

    .. warning::
        Hooks on the module itself run eagerly around every call. Hooks on its submodules run
        inside the graph: their tensor work replays, their Python side effects happened once,
        at capture (a warning says so). A forward or backward hook added to a submodule (or
        globally) after graphing, or removed, makes calls run eagerly while it differs
        (counted in ``stats.fallbacks``, one warning).

    .. warning::
        After graphing, do not replace or move the tensors the graphs use (assigning a new
        ``nn.Parameter``, ``module.to(...)``, ``load_state_dict(..., assign=True)``): the graphs
        keep reading the captured ones. A module moved or reloaded, a new ``nn.Parameter``
        (even over the same memory) or a submodule replaced raises
        :class:`~torchreplay.ReplayInputError` at the next call (core/placed.py); one tensor
        moved alone by ``p.data = new`` is not seen (the graphs hold its old memory and
        compute with it), but ``verify=K`` catches it. In-place updates (optimizer steps,
        ``load_state_dict``) are fine.

    .. warning::
        A tensor argument whose sample did not require grad must not require grad at a call
        (:class:`~torchreplay.ReplayInputError`; torch's silently returns no gradient for it).

    .. warning::
        The graph computes in the autocast setting it was captured under; a call under another
        one raises :class:`~torchreplay.ReplayInputError`. The autocast weight cache is turned
        off during warm-up and capture, so casts of weights are part of the graph and follow
        optimizer steps (torch's refuses ``cache_enabled=True`` instead).
    """
    single = not isinstance(callables, (tuple, list))
    fns = [callables] if single else list(callables)
    if not fns:
        raise ValueError("callables is empty: pass a module or function, or a tuple of them")
    for i, fn in enumerate(fns):
        if not callable(fn):
            where = "callables" if single else f"callables[{i}]"
            raise TypeError(f"{where} is a {type(fn).__name__}, which is not callable")
    _check_distinct_modules(fns)
    refuse_inference_capture("make_graphed_callables")
    args_list = _per_callable_args(sample_args, single, len(fns))
    kwargs_list = _per_callable_kwargs(sample_kwargs, single, len(fns))
    if not isinstance(allow_unused_input, bool):
        raise TypeError(f"allow_unused_input must be a bool, got {allow_unused_input!r}")
    verify = check_verify(verify)
    tol = resolve_tolerance(verify_tol)
    cfg = resolve_config(
        config,
        outputs=outputs,
        num_warmup_iters=num_warmup_iters,
        capture_error_mode=capture_error_mode,
    )
    devices = [infer_device(fn, CallArgs(fn, a, k)) for fn, a, k in zip(fns, args_list, kwargs_list)]
    device = devices[0]
    for i, d in enumerate(devices):
        if d != device:
            raise ValueError(
                f"callables[{i}] runs on {d} but callables[0] on {device}; callables graphed "
                "together share one memory pool on one device: graph them in separate calls"
            )
    the_pool = resolve_pool(pool)
    if the_pool is None:
        the_pool = Pool(device)
    runners = graph_callables(
        fns, args_list, kwargs_list, device=device, pool=the_pool, config=cfg,
        allow_unused=allow_unused_input, verify=verify, tol=tol,
    )
    results: list[Any] = []
    for fn, r in zip(fns, runners):
        if isinstance(fn, torch.nn.Module):
            fn.forward = r  # type: ignore[method-assign]  # as torch's does
            results.append(fn)
        else:
            results.append(r)
    return results[0] if single else tuple(results)


def graph_callables(
    fns: Sequence[Callable[..., Any]],
    args_list: Sequence[tuple[Any, ...]],
    kwargs_list: Sequence[dict[str, Any]],
    *,
    device: torch.device,
    pool: Pool,
    config: GraphConfig,
    allow_unused: bool,
    verify: int,
    tol: Any,
    names: Sequence[str] | None = None,
) -> list[GraphedCallable | Launchless]:
    """Capture forward and backward graphs of each callable (checked arguments, in the order
    they run) into ``pool``; ``names`` name them in messages (default: the class or function).
    A callable whose forward launches no kernel comes back as a :class:`Launchless`."""
    order = Order()
    runners: list[Any] = [
        GraphedCallable(
            fn,
            a,
            k,
            device=device,
            config=config,
            order=order,
            allow_unused=allow_unused,
            verify=verify,
            tol=tol,
            name=names[i] if names is not None else None,
        )
        for i, (fn, a, k) in enumerate(zip(fns, args_list, kwargs_list))
    ]
    _build(runners, device, pool, config)
    return runners


def _check_distinct_modules(fns: Sequence[Any]) -> None:
    seen: dict[int, int] = {}
    for i, fn in enumerate(fns):
        if isinstance(fn, torch.nn.Module):
            if id(fn) in seen:
                raise ValueError(
                    f"callables[{seen[id(fn)]}] and callables[{i}] are the same module; a module "
                    "is graphed once (its forward is replaced): pass it once"
                )
            seen[id(fn)] = i


def _per_callable_args(sample_args: Any, single: bool, n: int) -> list[tuple[Any, ...]]:
    if single:
        if not isinstance(sample_args, (tuple, list)):
            raise TypeError(
                f"sample_args must be a tuple of the callable's positional arguments, e.g. (x,), "
                f"got {type(sample_args).__name__}"
            )
        return [tuple(sample_args)]
    if not isinstance(sample_args, (tuple, list)) or len(sample_args) != n:
        got = f"{len(sample_args)} entries" if isinstance(sample_args, (tuple, list)) else type(sample_args).__name__
        raise TypeError(
            f"with {n} callables, sample_args must be a tuple of {n} tuples (one per callable, "
            f"e.g. ((x,), (h,))), got {got}"
        )
    out = []
    for i, a in enumerate(sample_args):
        if not isinstance(a, (tuple, list)):
            raise TypeError(
                f"sample_args[{i}] must be a tuple of callables[{i}]'s positional arguments, "
                f"e.g. (x,), got {type(a).__name__}"
            )
        out.append(tuple(a))
    return out


def _per_callable_kwargs(sample_kwargs: Any, single: bool, n: int) -> list[dict[str, Any]]:
    if sample_kwargs is None:
        return [{} for _ in range(n)]
    if single:
        if not isinstance(sample_kwargs, dict):
            raise TypeError(
                f"sample_kwargs must be a dict of keyword arguments, got {type(sample_kwargs).__name__}"
            )
        return [dict(sample_kwargs)]
    if not isinstance(sample_kwargs, (tuple, list)) or len(sample_kwargs) != n:
        raise TypeError(
            f"with {n} callables, sample_kwargs must be a tuple of {n} dicts (or None), one per callable"
        )
    out = []
    for i, k in enumerate(sample_kwargs):
        if k is not None and not isinstance(k, dict):
            raise TypeError(f"sample_kwargs[{i}] must be a dict or None, got {type(k).__name__}")
        out.append(dict(k or {}))
    return out
