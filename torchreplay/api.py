"""``tr.graph``: the entry point that returns a :class:`~torchreplay.core.graphed.Graphed` (one
shape), a :class:`~torchreplay.sizes.bucketed.BucketedGraph` (``sizes=``) or a
:class:`~torchreplay.breaks.graph.BreakableGraph` (``breaks=``); and ``tr.make_graphed_callables``,
which takes ``breaks=`` too (:mod:`torchreplay.breaks.training`).

They live here, above what they return, so that none of those imports another.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Iterable, Literal, overload

import torch

from torchreplay.breaks.auto import suggest
from torchreplay.breaks.graph import BreakableGraph
from torchreplay.breaks.training import graph_around_breaks
from torchreplay.config import RANKS, BucketConfig, GraphConfig, RankConfig
from torchreplay.core.args import CallArgs, infer_device
from torchreplay.core.graphed import Graphed, resolve_config, resolve_pool
from torchreplay.errors import CaptureError
from torchreplay.core.pool import Pool
from torchreplay.sizes.bucketed import BucketedGraph
from torchreplay.training import callables as _training

__all__ = ["graph", "make_graphed_callables"]


@overload
def graph(
    fn: Callable[..., Any],
    *sample_args: Any,
    sizes: None = None,
    breaks: None = None,
    outputs: str | None = None,
    num_warmup_iters: int | None = None,
    pool: Pool | tuple[int, int] | Any | None = None,
    capture_error_mode: str | None = None,
    config: GraphConfig | None = None,
    device: torch.device | int | str | None = None,
    sample_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Graphed: ...


@overload
def graph(
    fn: Callable[..., Any],
    *sample_args: Any,
    sizes: Iterable[int],
    breaks: None = None,
    dim: Any = None,
    fill_value: Any = None,
    capture: Literal["ahead", "lazy"] | None = None,
    fallback: Literal["eager", "error"] | None = None,
    max_graphs: int | None = None,
    outputs: str | None = None,
    num_warmup_iters: int | None = None,
    pool: Pool | tuple[int, int] | Any | None = None,
    capture_error_mode: str | None = None,
    config: GraphConfig | None = None,
    device: torch.device | int | str | None = None,
    sample_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> BucketedGraph: ...


@overload
def graph(
    fn: Callable[..., Any],
    *sample_args: Any,
    sizes: Iterable[int] | None = None,
    breaks: Any,
    dim: Any = None,
    fill_value: Any = None,
    outputs: str | None = None,
    num_warmup_iters: int | None = None,
    pool: Pool | tuple[int, int] | Any | None = None,
    capture_error_mode: str | None = None,
    config: GraphConfig | None = None,
    device: torch.device | int | str | None = None,
    sample_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> BreakableGraph: ...


def graph(
    fn: Callable[..., Any],
    *sample_args: Any,
    sizes: Iterable[int] | None = None,
    breaks: Any = None,
    dim: Any = None,
    fill_value: Any = None,
    capture: Literal["ahead", "lazy"] | None = None,
    fallback: Literal["eager", "error"] | None = None,
    max_graphs: int | None = None,
    outputs: str | None = None,
    num_warmup_iters: int | None = None,
    pool: Pool | tuple[int, int] | Any | None = None,
    capture_error_mode: str | None = None,
    config: GraphConfig | None = None,
    device: torch.device | int | str | None = None,
    sync_sizes: Any = None,
    ranks: RankConfig | None = None,
    sample_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Graphed | BucketedGraph | BreakableGraph:
    """Capture ``fn(*sample_args, **sample_kwargs)`` as a CUDA graph and return the replayer.

    ``fn`` is a function or an ``nn.Module``; arguments are any pytree of tensors and other
    values, positional and keyword. The capture runs ``num_warmup_iters`` eager calls on a side
    stream first, under ``torch.no_grad()``; building the graph leaves the module's buffers and
    the RNG state as it found them. A CUDA ``torch.Generator`` argument is taken from every
    call (any generator on that device: the graph draws from where it stands and moves it on,
    as eagerly); any other non-tensor argument is a constant of the graph (but for those a break
    reads: see ``breaks``).

    With ``sizes=[...]``, one graph is captured per size of a varying dimension (``dim``) and a
    call is padded to the smallest captured size that holds it (see
    :class:`~torchreplay.sizes.bucketed.BucketedGraph`).

    With ``breaks=[...]``, what cannot be captured runs eagerly between graph segments (see
    :class:`~torchreplay.breaks.graph.BreakableGraph`).

    Args:
        fn: the callable to graph.
        *sample_args: positional arguments of a representative call.
        sizes: capture one graph per size (e.g. ``torchreplay.default_sizes(512)``); ``None``
            (default): one graph for the sample's shapes.
        breaks: what runs eagerly between graph segments: module instances or classes, Python
            functions, ``torch.library`` custom ops or aten ops (objects or names such as
            ``"mylib.attention"`` or ``"aten.nonzero"``). During capture each call of a break
            ends the current segment, runs eagerly and the next segment begins; at replay the
            segments replay and each break is called again with the same tensor arguments
            (same memory, this call's values) and this call's host values. The rule for what a
            break reads: a tensor the caller passed is read in the graph's input buffer (it
            holds this call's values); a tensor made inside the model is read where the segment
            before left it; a non-tensor or CPU value the caller passed (sequence lengths, a
            block table on the host) is taken from each call, never frozen; any other value,
            computed inside the model, is the constant it was at capture. A break whose outputs
            change shape, dtype or device from the captured ones raises
            :class:`~torchreplay.ReplayInputError`. With ``sizes``, a break gets the padded
            rows: pass the real count as a host argument (an int, or lengths on the CPU).
        dim: with ``sizes``: the varying dimension, one int for every tensor argument (default
            0), or a dict keyed by parameter name (or positional index) whose values are an int,
            ``None`` for a static argument, or a nested spec for a container argument, e.g.
            ``dim={"input_ids": 0, "positions": 0, "cache": None}``. Arguments a dict leaves out
            are static.
        fill_value: with ``sizes``: the value of the padding rows (default 0), one number or a
            dict keyed like ``dim``.
        capture: with ``sizes``: ``"ahead"`` (default; every size now, largest first) or
            ``"lazy"`` (the largest now, each other size on its first call).
        fallback: with ``sizes``: a call above the largest size (or of size 0) runs
            ``"eager"``ly with one warning per size (default), or raises (``"error"``).
        max_graphs: with ``sizes`` and ``capture="lazy"``: hold at most this many graphs; a size
            that would need another one is handled by ``fallback``.
        outputs: output policy: ``"checked"`` (default, zero-copy; an output read after a later
            replay overwrote it raises), ``"clone"`` (fresh tensors each call) or ``"static"``
            (the graph's own buffers, overwritten by the next replay without any check).
        num_warmup_iters: eager warm-up calls before capture (default 3).
        pool: a :class:`Pool` (or another graph, or a raw torch pool handle) to share memory with.
        capture_error_mode: ``"global"`` (default), ``"thread_local"`` or ``"relaxed"``.
        config: a :class:`~torchreplay.config.GraphConfig`; explicit keywords override it.
        device: the CUDA device to capture on. Default: that of the first CUDA tensor argument,
            else of the module's parameters; give it for a function without CUDA tensor
            arguments (one that samples noise with ``torch.randn(..., device="cuda")``).
        sync_sizes: with ``sizes`` and several ranks: ``True`` or a process group makes every
            rank of the group replay the same size (the one that holds the largest call of any
            rank; each rank's rows padded up to it), and run eagerly all together above the
            largest size. Default: on when the graph holds a ``torch.distributed`` collective
            (its group). ``False``: each rank picks its own size (then they must agree, or
            every rank raises).
        ranks: a :class:`~torchreplay.config.RankConfig`: how ranks agree before replaying a
            graph that holds collectives (the group, the per-call check, its timeout). A rank
            that would replay another graph or size, or run eagerly, makes every rank raise
            :class:`~torchreplay.ReplayInputError` before anything is launched; one that does not
            come makes the others raise after ``timeout`` seconds. Never a hang in NCCL.
        sample_kwargs: keyword arguments of the sample call, for names that clash with the
            options above.
        **kwargs: keyword arguments of the sample call.

    Returns:
        a :class:`Graphed` callable; with ``sizes``, a
        :class:`~torchreplay.sizes.bucketed.BucketedGraph`.

    .. warning::
        Tensor arguments are copied into static buffers; non-tensor arguments are captured as
        constants, and a call with another value raises :class:`~torchreplay.ReplayInputError`.
        Pass values that change between calls (positions, lengths) as tensors.

    .. warning::
        The graph is for inference: it is captured under ``torch.no_grad()`` and its outputs
        carry no autograd history. A call the graph cannot serve as eager would runs eagerly
        instead, warning once per reason and counted in ``stats.fallbacks``: with autograd on
        and an argument that requires grad (eager records a backward to it), under another CUDA
        autocast setting than the capture's (the graph computes in the captured dtypes), with
        the module switched between train and eval, or with forward hooks added or removed
        since capture (for a function: the modules it ran at capture, found then) (a replay runs no hook code: hooks present at capture replay their tensor
        work, but their Python side effects happened at capture only). Calls under a ``TorchDispatchMode``
        (``FlopCounterMode``, a trace) and inside another graph's capture run eagerly too,
        without a warning, so that the mode or the capture sees every op. ``torch.inference_mode``
        is no reason: capture and call under it or not, in any mix; a call under it returns
        inference tensors, as eager does. To train through graphs use
        :func:`torchreplay.make_graphed_callables` or :func:`torchreplay.graph_step`.

    .. warning::
        With ``outputs="checked"``, an output you keep across calls raises when read after the
        next replay (a ``RuntimeError`` whose message starts with ``StaleOutputError``);
        ``.clone()`` it to keep it.

    .. warning::
        With ``sizes``, padding is correct only when the rows of the varying dimension are
        independent (no batch statistics, no reduction across rows): see
        :class:`~torchreplay.sizes.bucketed.BucketedGraph`.

    .. warning::
        The graph reads the module's parameters and buffers where they were at capture. Update
        weights in place (``load_state_dict(sd)``, ``p.copy_(new)`` under ``no_grad``); a model
        moved or reloaded (``model.half()``, ``load_state_dict(sd, assign=True)``), a weight
        given a new ``nn.Parameter`` and a layer replaced raise
        :class:`~torchreplay.ReplayInputError` at the next call; graph it again. One tensor
        moved alone by ``p.data = new`` is not seen: the graph keeps its old memory and value
        (:mod:`torchreplay.core.placed`).
    """
    bucket_options = {
        "dim": dim,
        "fill_value": fill_value,
        "capture": capture,
        "fallback": fallback,
        "max_graphs": max_graphs,
        "sync_sizes": sync_sizes,
    }
    if sizes is None:
        given = [k for k, v in bucket_options.items() if v is not None]
        if given:
            raise TypeError(
                f"{', '.join(k + '=' for k in given)} only apply with sizes=[...]; to graph many "
                "sizes pass sizes (e.g. sizes=torchreplay.default_sizes(512)). If it is an "
                f"argument of the callable, pass it as sample_kwargs={{'{given[0]}': ...}}"
            )
    elif "dims" in kwargs and not _accepts_keyword(fn, "dims"):
        raise TypeError("graph() got dims=; the option is spelled dim= (an int or a dict)")
    if sample_kwargs:
        clash = set(sample_kwargs) & set(kwargs)
        if clash:
            raise TypeError(f"keyword arguments given twice: {sorted(clash)}")
        kwargs = {**kwargs, **sample_kwargs}
    cfg = resolve_config(
        config,
        outputs=outputs,
        num_warmup_iters=num_warmup_iters,
        capture_error_mode=capture_error_mode,
    )
    rank_cfg = _rank_config(ranks, sync_sizes)
    if breaks is not None:
        options = None if sizes is None else BucketConfig(
            sizes,  # type: ignore[arg-type]
            capture=capture or "ahead",
            fallback=fallback or "eager",
            max_graphs=max_graphs,
        )
        return BreakableGraph(
            fn,
            sample_args,
            kwargs,
            breaks=breaks,
            sizes=list(options.sizes) if options is not None else None,
            options=options,
            dim=0 if dim is None else dim,
            fill_value=0 if fill_value is None else fill_value,
            config=cfg,
            pool=resolve_pool(pool),
            device=device,
            ranks=rank_cfg,
        )
    try:
        return _graph(fn, sample_args, kwargs, sizes, dim, fill_value, capture, fallback,
                      max_graphs, cfg, pool, device, rank_cfg)
    except CaptureError as exc:
        if "failed at" not in str(exc) or not torch.cuda.is_available():
            raise  # only a capture that an op broke (check found it) has a breaks= answer
        d = infer_device(fn, CallArgs(fn, sample_args, kwargs), device)
        hint = suggest(fn, sample_args, kwargs, d)
        if not hint:
            raise
        raise CaptureError(f"{exc}{hint}") from exc


def _graph(
    fn: Callable[..., Any],
    sample_args: tuple[Any, ...],
    kwargs: dict[str, Any],
    sizes: Iterable[int] | None,
    dim: Any,
    fill_value: Any,
    capture: Any,
    fallback: Any,
    max_graphs: int | None,
    cfg: GraphConfig,
    pool: Any,
    device: Any,
    ranks: RankConfig,
) -> Graphed | BucketedGraph:
    if sizes is not None:
        options = BucketConfig(
            sizes,  # type: ignore[arg-type]  # validated and made a sorted tuple there
            capture=capture or "ahead",
            fallback=fallback or "eager",
            max_graphs=max_graphs,
        )
        return BucketedGraph(
            fn,
            sample_args,
            kwargs,
            options=options,
            dim=0 if dim is None else dim,
            fill_value=0 if fill_value is None else fill_value,
            config=cfg,
            pool=resolve_pool(pool),
            device=device,
            ranks=ranks,
        )
    return Graphed(
        fn, sample_args, kwargs, config=cfg, pool=resolve_pool(pool), device=device, ranks=ranks
    )


def _rank_config(ranks: RankConfig | None, sync_sizes: Any) -> RankConfig:
    """``ranks`` (default :data:`~torchreplay.config.RANKS`) with ``sync_sizes`` folded in: a
    bool sets it, a process group sets the group and turns it on."""
    cfg = RANKS if ranks is None else ranks
    if not isinstance(cfg, RankConfig):
        raise TypeError(f"ranks must be a torchreplay.config.RankConfig, got {ranks!r}")
    if sync_sizes is None:
        return cfg
    if isinstance(sync_sizes, bool):
        return dataclasses.replace(cfg, sync_sizes=sync_sizes)
    return dataclasses.replace(cfg, group=sync_sizes, sync_sizes=True)


def _accepts_keyword(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` (or a module's ``forward``) takes a keyword argument ``name``."""
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)


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
    breaks: Any = None,
) -> Any:
    if breaks is None:
        return _training.make_graphed_callables(
            callables, sample_args, num_warmup_iters, allow_unused_input, pool,
            sample_kwargs=sample_kwargs, outputs=outputs, capture_error_mode=capture_error_mode,
            config=config, verify=verify, verify_tol=verify_tol,
        )
    return graph_around_breaks(
        callables, sample_args, breaks, sample_kwargs=sample_kwargs,
        allow_unused_input=allow_unused_input, num_warmup_iters=num_warmup_iters, pool=pool,
        outputs=outputs, capture_error_mode=capture_error_mode, config=config, verify=verify,
        verify_tol=verify_tol,
    )


_BREAKS_DOC = """        breaks: what runs eagerly, named as for :func:`torchreplay.graph` (module instances or
            classes, functions, ops) or ``"auto"``; ``callables`` is then one module, and the
            module comes back with its ``forward`` replaced by a
            :class:`~torchreplay.breaks.training.BreakTraining`. One eager run of it (its
            buffers and RNG put back after) is recorded op by op; the ops between two breaks
            are a segment, graphed forward and backward as one autograd node. At each call the
            segments replay and the breaks run eagerly between them, with eager autograd; none
            of the model's own Python runs. A branch on a tensor's truth value between breaks
            is taken as recorded (a warning names it). A ``torch.autograd.Function`` between
            breaks is recorded as one call of it, run again with its own backward. A host read
            of a number, an op on a CPU tensor, a Triton kernel launched outside a Function or
            custom op, a change to Python state there, and an object the model makes anew at
            each call and hands a break (HF's ``DynamicCache``: pass ``use_cache=False``) are a
            :class:`~torchreplay.CaptureError`.
            ``tr.explain(model)`` lists the segments and breaks.
"""
_AT = "        verify_tol: ``(rtol, atol)`` for ``verify`` (default: per dtype).\n"
assert _training.make_graphed_callables.__doc__ is not None and _AT in _training.make_graphed_callables.__doc__
make_graphed_callables.__doc__ = _training.make_graphed_callables.__doc__.replace(_AT, _AT + _BREAKS_DOC)
