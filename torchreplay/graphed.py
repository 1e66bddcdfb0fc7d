"""``tr.graph`` and :class:`Graphed`: one captured shape and its replay hot path."""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterable, Literal, overload

import torch

from torchreplay import _compat
from torchreplay.capture import (
    StateSnapshot,
    capture,
    fn_name,
    owning_module,
    side_stream,
    warn_mode_changed,
)
from torchreplay.config import SAFE, GraphConfig
from torchreplay.errors import CaptureError, UnsupportedError
from torchreplay.io import Inputs, Outputs
from torchreplay.pool import Pool
from torchreplay.stats import GraphStats

if TYPE_CHECKING:  # buckets.py imports this module
    from torchreplay.buckets import BucketedGraph

__all__ = ["graph", "Graphed", "resolve_config", "resolve_pool", "infer_device"]

log = logging.getLogger(__name__)


class Graphed:
    """A callable captured as one CUDA graph for one set of argument shapes.

    Calling it checks the arguments against the capture (:class:`~torchreplay.ReplayInputError`
    on any mismatch), copies tensors into the graph's static inputs, replays the graph and returns
    the outputs in the structure ``fn`` returned them, under the output policy.

    Build it with :func:`torchreplay.graph`.

    Attributes:
        stats: counters (captures, replays, fallbacks, capture seconds, pool bytes).
        pool: the memory pool; pass it as ``pool=`` to another graph to share memory.
        static_args, static_kwargs: the static input buffers, in the captured structure.
            Writing into them and calling ``g(*g.static_args, **g.static_kwargs)`` skips the copy.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        config: GraphConfig = SAFE,
        pool: Pool | None = None,
    ) -> None:
        self.fn = fn
        self.name = fn_name(fn)
        self.config = config
        self._module = owning_module(fn)
        self._training = self._module.training if self._module is not None else False
        device = infer_device(fn, args, kwargs)
        self.device = device
        self.pool = pool if pool is not None else Pool(device)
        self.stats = GraphStats(self.pool.reserved_bytes)
        self._warned_fallback = False

        self._inputs = Inputs(fn, args, kwargs, device)
        self.static_args = self._inputs.static_args
        self.static_kwargs = self._inputs.static_kwargs
        self._stream = side_stream(device)

        snapshot = (
            StateSnapshot(self._module, device) if config.restore_state else None
        )
        captured = capture(
            fn,
            self.static_args,
            self.static_kwargs,
            device=device,
            stream=self._stream,
            pool=self.pool,
            config=config,
            snapshot=snapshot,
        )
        if snapshot is not None:
            snapshot.restore()
        self._graph = captured.graph
        self._outputs = Outputs(
            captured.out, config.outputs, self.name, _owned_by(self.pool, self._inputs)
        )
        self._position = self.pool.register(self)
        self.stats.captures = 1
        self.stats.capture_seconds = captured.seconds
        # Hot-path constants, looked up once.
        self._replay = captured.graph.replay
        self._device_index = device.index
        self._check_device = torch.cuda.device_count() > 1
        log.info(
            "torchreplay: captured '%s' on %s in %.3f s (outputs=%s)",
            self.name,
            device,
            captured.seconds,
            self._outputs.policy,
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module
        if module is not None and module.training != self._training:
            return self._fallback(args, kwargs)
        if self._check_device and torch.cuda.current_device() != self._device_index:
            with torch.cuda.device(self._device_index):
                return self._run(args, kwargs)
        return self._run(args, kwargs)

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # Copy-in first: an argument may be a previous output of this graph (y = g(y)), which
        # must be read before the replay overwrites it and before it is marked stale.
        self._inputs.copy_in(args, kwargs)
        if self.pool.shared:
            self.pool.before_replay(self._position)
        self._replay()
        self.stats.replays += 1
        return self._outputs.emit()

    def invalidate_outputs(self) -> None:
        """Mark the outputs handed out so far as stale (another graph may overwrite them)."""
        self._outputs.invalidate()

    def _fallback(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.stats.fallbacks += 1
        if not self._warned_fallback:
            self._warned_fallback = True
            warn_mode_changed(self.name, self._training)
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Graphed({self.name}, device={self.device}, {self.stats.explain()})"


def _owned_by(pool: Pool, inputs: Inputs) -> Callable[[torch.Tensor], bool]:
    """Return a predicate: does the graph own this output's memory (pool or static inputs)?"""
    ranges = pool.segment_ranges()
    static_ptrs = {s.static.untyped_storage().data_ptr() for s in inputs.tensor_slots}

    def owned(t: torch.Tensor) -> bool:
        ptr = t.untyped_storage().data_ptr()
        return ptr in static_ptrs or any(lo <= ptr < hi for lo, hi in ranges)

    return owned


def infer_device(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    """Return the CUDA device of the first CUDA tensor argument, else of the module's state."""
    if not torch.cuda.is_available():
        raise UnsupportedError(
            "CUDA is not available: torchreplay captures CUDA graphs and needs a CUDA device; "
            "on this machine use torchreplay.check(fn, *args) to see what would break capture"
        )
    for leaf in _compat.tree_flatten((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
            return leaf.device
    module = owning_module(fn)
    if module is not None:
        for t in [*module.parameters(), *module.buffers()]:
            if t.is_cuda:
                return t.device
    raise CaptureError(
        f"'{fn_name(fn)}' gets no CUDA tensor (arguments and module state are all on the CPU); "
        "a graph of it would be empty. Move the module and its inputs to a CUDA device first"
    )


def resolve_config(config: GraphConfig | None, **options: Any) -> GraphConfig:
    """Merge explicit keyword options over ``config`` (default :data:`~torchreplay.config.SAFE`)."""
    base = config if config is not None else SAFE
    given = {k: v for k, v in options.items() if v is not None}
    return dataclasses.replace(base, **given) if given else base


def resolve_pool(pool: Pool | tuple[int, int] | Any | None) -> Pool | None:
    """Accept a :class:`Pool`, a graph with ``.pool``, or a raw torch pool handle."""
    if pool is None or isinstance(pool, Pool):
        return pool
    if isinstance(getattr(pool, "pool", None), Pool):
        return pool.pool
    if isinstance(pool, tuple) and len(pool) == 2:
        return Pool.from_handle(pool)
    raise TypeError(
        f"pool must be a torchreplay.Pool, a graphed callable, or a torch pool handle "
        f"(torch.cuda.graph_pool_handle()), got {type(pool).__name__}"
    )


@overload
def graph(
    fn: Callable[..., Any],
    *sample_args: Any,
    sizes: None = None,
    outputs: str | None = None,
    num_warmup_iters: int | None = None,
    pool: Pool | tuple[int, int] | Any | None = None,
    capture_error_mode: str | None = None,
    config: GraphConfig | None = None,
    sample_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Graphed: ...


@overload
def graph(
    fn: Callable[..., Any],
    *sample_args: Any,
    sizes: Iterable[int],
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
    sample_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> BucketedGraph: ...


def graph(
    fn: Callable[..., Any],
    *sample_args: Any,
    sizes: Iterable[int] | None = None,
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
    sample_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Graphed | BucketedGraph:
    """Capture ``fn(*sample_args, **sample_kwargs)`` as a CUDA graph and return the replayer.

    ``fn`` is a function or an ``nn.Module``; arguments are any pytree of tensors and other
    values, positional and keyword. The capture runs ``num_warmup_iters`` eager calls on a side
    stream first, under ``torch.no_grad()``; building the graph leaves the module's buffers and
    the RNG state as it found them.

    With ``sizes=[...]``, one graph is captured per size of a varying dimension (``dim``) and a
    call is padded to the smallest captured size that holds it (see
    :class:`~torchreplay.buckets.BucketedGraph`).

    Args:
        fn: the callable to graph.
        *sample_args: positional arguments of a representative call.
        sizes: capture one graph per size (e.g. ``torchreplay.default_sizes(512)``); ``None``
            (default): one graph for the sample's shapes.
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
        sample_kwargs: keyword arguments of the sample call, for names that clash with the
            options above.
        **kwargs: keyword arguments of the sample call.

    Returns:
        a :class:`Graphed` callable; with ``sizes``, a
        :class:`~torchreplay.buckets.BucketedGraph`.

    .. warning::
        Tensor arguments are copied into static buffers; non-tensor arguments are captured as
        constants, and a call with another value raises :class:`~torchreplay.ReplayInputError`.
        Pass values that change between calls (positions, lengths) as tensors.

    .. warning::
        The graph is for inference: it is captured under ``torch.no_grad()``. To train through
        graphs use :func:`torchreplay.make_graphed_callables` or :func:`torchreplay.graph_step`.

    .. warning::
        With ``outputs="checked"``, an output you keep across calls raises when read after the
        next replay (a ``RuntimeError`` whose message starts with ``StaleOutputError``);
        ``.clone()`` it to keep it.

    .. warning::
        With ``sizes``, padding is correct only when the rows of the varying dimension are
        independent (no batch statistics, no reduction across rows): see
        :class:`~torchreplay.buckets.BucketedGraph`.
    """
    bucket_options = {
        "dim": dim,
        "fill_value": fill_value,
        "capture": capture,
        "fallback": fallback,
        "max_graphs": max_graphs,
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
    if sizes is not None:
        from torchreplay.buckets import BucketedGraph  # buckets.py imports this module
        from torchreplay.config import BucketConfig

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
        )
    return Graphed(fn, sample_args, kwargs, config=cfg, pool=resolve_pool(pool))


def _accepts_keyword(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` (or a module's ``forward``) takes a keyword argument ``name``."""
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)
