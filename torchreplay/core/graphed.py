"""Graphed: one captured shape and its replay hot path (``tr.graph`` is in api.py)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Sequence

import torch

from torchreplay import _compat
from torchreplay.config import RANKS, SAFE, GraphConfig, RankConfig
from torchreplay.core.args import CallArgs, called_module, fn_name, infer_device, owning_module
from torchreplay.core.capture import capture, side_stream
from torchreplay.core.eager_form import EagerForm
from torchreplay.core.snapshot import StateSnapshot
from torchreplay.core.effects import PyState
from torchreplay.core.io import Inputs, TransformedInput
from torchreplay.core.modes import (
    AUTOCAST, CAPTURE, DISPATCH_MODE, GRAD, HOOKS, PY_VALUE, REPLICA, TRAIN_MODE, TRANSFORM, EagerCalls,
    tracked_leaf,
)
from torchreplay.core.outputs import Outputs
from torchreplay.core.placed import CHANGES, GONE, Placed
from torchreplay.core.rewind import Rewind
from torchreplay.core.pool import Pool, release_with
from torchreplay.core.pystate import path_of, state_tensors, walk_state
from torchreplay.core.threads import Callers, get_ident, outputs_to_clones
from torchreplay.distributed import EAGER, GRAPH, agreement
from torchreplay.errors import CaptureError
from torchreplay.stats import GraphStats

_current_stream = _compat.current_stream
_any_autocast = _compat.any_autocast
_cuda_autocast = _compat.cuda_autocast
_dispatch_modes = _compat.dispatch_modes
_dynamo_tracing = _compat.dynamo_tracing
_Handles = _compat.hook_handles_made  # its next_id counts every hook handle torch made

__all__ = [
    "Graphed", "owned_by", "refuse_objects_holding_graph_tensors", "refuse_static_written_outputs",
    "resolve_config", "resolve_pool",
]

log = logging.getLogger(__name__)


class Graphed(EagerForm):
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
        device: torch.device | int | str | None = None,
        ranks: RankConfig = RANKS,
    ) -> None:
        self.fn = fn
        self.name = fn_name(fn)
        self.config = config
        self._module = owning_module(fn)
        self._training = self._module.training if self._module is not None else False
        call = CallArgs(fn, args, kwargs)
        device = infer_device(fn, call, device)
        self.device = device
        self.pool = pool if pool is not None else Pool(device)
        self.stats = GraphStats(self.pool.reserved_bytes)

        self._inputs = Inputs(call, device, adopt=True)
        self._inputs.eager_if_tracked = True  # copy_in: None for a call autograd must record
        self.static_args = self._inputs.static_args
        self.static_kwargs = self._inputs.static_kwargs
        self._stream = side_stream(device)

        find = self._module is None  # a plain function: the modules it runs are found
        snapshot = (
            StateSnapshot(self._module, device, find=find, save=config.restore_state)
            if config.restore_state or find else None
        )
        runs = snapshot.called if find and snapshot is not None else [self._module]  # filled in place
        python = PyState(self.name, fn, self.static_args, self.static_kwargs, lambda: runs or [], reads=True)
        with self._inputs.rewinding() as adopted:  # (what the build writes into adopted tensors)
            captured = capture(
                fn,
                self.static_args,
                self.static_kwargs,
                device=device,
                stream=self._stream,
                pool=self.pool,
                config=config,
                snapshot=snapshot,
                watch=[s.static for s in self._inputs.tensor_slots],
                reset=_reset_written(self._inputs, call.leaves, adopted),
                effects=python,  # the Python state it changes: core/effects.py
                # The graph copies its tensor arguments in itself, as its first nodes: a call
                # points them at its tensors, and launches no copy (_compat/copy_nodes.py).
                copy_in=self._inputs.copied_by_graph(),
            )
        if snapshot is not None:
            snapshot.restore()
            if find:
                self._module = called_module(snapshot.called or ())
                self._training = self._module.training if self._module is not None else False
        del snapshot  # its copies of the module's buffers
        # after capture: hooks a warm-up removed (a lazy module's) are not counted as changed
        self._eager = EagerCalls(self.name, self._training, self._module)  # calls a replay cannot serve
        self._hooks = self._eager.hooks
        self._graph = captured.graph
        self._inputs.attach(captured.copies)
        self._spares = captured.spares  # (copies not found: written at every replay)
        self._inputs.set_written(captured.written)
        self._inputs.check_aliasing(call.leaves, where="capture")
        del call  # it holds the caller's sample tensors
        refuse_static_written_outputs(self._inputs, captured.out, config.outputs, self.name)
        owned = owned_by(self.pool, self._inputs)
        refuse_objects_holding_graph_tensors(captured.out, owned, self.name)
        self._writes = bool(self._inputs.written or self._inputs.rebound)  # (generators: moved on)
        self._outputs = Outputs(
            captured.out, config.outputs, self.name, owned, reuse=True,
            inputs=[s.static for s in self._inputs.slots],  # an argument returned: the caller's
        )
        self.stats.captures = 1
        self.stats.capture_seconds = captured.seconds
        self.stats.written_inputs = self._inputs.written_paths()
        self.stats.graph_copies = len(captured.copies)
        self.collectives = captured.collectives
        self._ranks = agreement(
            ranks, captured.collectives, captured.collective_log, name=self.name, device=device
        )
        del captured
        self._position = self.pool.register(self)
        self.pool.track(self, [self._graph], self._outputs.retire)
        release_with(self, self.collectives, self._ranks)
        # Hot-path constants, looked up once.
        self._replay = _compat.direct_replay(self._graph)
        self._device_index = device.index
        self._check_device = torch.cuda.device_count() > 1
        self._callers = Callers()  # one call at a time: threads share the buffers and outputs
        self._placed = Placed.of(self._module, device)
        self._reads = python.reads()  # tensors in Python state it reads: replaced since, it raises
        self._eager.values = self._reads.values if self._reads is not None else None  # (plain ones)
        log.info(
            "torchreplay: captured '%s' on %s in %.3f s (outputs=%s%s)",
            self.name,
            device,
            self.stats.capture_seconds,
            self._outputs.policy,
            f"; writes {', '.join(self._inputs.written_paths())}" if self._inputs.written else "",
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _dynamo_tracing():  # called from code torch.compile traces: run outside it
            return _compat.call_untraced(self, args, kwargs)
        module = self._module
        eager = self._eager  # core/modes.py: what a replay cannot do as eager does
        why = None
        if module is not None and module.training != self._training:
            why = TRAIN_MODE
        elif (eager.autocast is not None or _any_autocast()) and _cuda_autocast() != eager.autocast:
            why = AUTOCAST
        elif _dispatch_modes():  # FlopCounterMode, FakeTensorMode, a tracer: they see each op
            why = DISPATCH_MODE
        elif self._hooks.at != _Handles.next_id and not self._hooks.look():  # a hook came or went
            why = HOOKS
        elif eager.values is not None and eager.values.changed():  # a flag, a scale the code read
            why = PY_VALUE
        placed = self._placed  # the model moved, or weights or submodules replaced
        moved = placed is not None and (
            placed.seen != CHANGES[0] or placed.table.get(placed.key, GONE).data_ptr() != placed.at
        ) and placed.moved()
        stale = self._reads.replaced(self.name) if self._reads is not None else None
        if self._ranks is not None:  # collectives inside: every rank replays, or all raise
            if why is None and tracked_leaf(self._inputs.flatten(args, kwargs)) is not None:
                why = GRAD  # decided before the agreement, not at the copy-in
            self._ranks(0, EAGER if why or moved or stale else GRAPH)
        if moved:
            raise placed.error(self.name)  # type: ignore[union-attr]
        if stale is not None:
            raise stale
        if why is not None:
            return self._fallback(args, kwargs, why)
        callers = self._callers
        elsewhere = self._check_device and torch.cuda.current_device() != self._device_index
        if elsewhere and _compat.replica_calling(self) is not None:  # nn.DataParallel's, on another
            return self._fallback(args, kwargs, REPLICA)  # GPU: it never touches the graph's memory
        with callers.lock:
            if get_ident() != callers.thread:
                callers.another(get_ident(), self._make_clones)
            # Another stream than the pool's last call's waits for that one (core/threads.py
            # follow_stream, inline: a Python frame less on every replay).
            pool = self.pool
            stream = _current_stream(pool.index)
            if stream != pool.stream and pool.on_stream(stream):  # inside another capture
                return self._fallback(args, kwargs, CAPTURE)
            if elsewhere:
                with torch.cuda.device(self._device_index):
                    return self._run(args, kwargs)
            return self._run(args, kwargs)

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # Copy-in first: an argument may be a previous output of this graph (y = g(y)), which
        # must be read before the replay overwrites it and before it is marked stale.
        try:
            leaves = self._inputs.copy_in(args, kwargs)
        except TransformedInput:  # inside vmap, grad, jvp: eagerly, as the transform expects
            return self._fallback(args, kwargs, TRANSFORM)
        if leaves is None:  # autograd on and an argument that requires grad
            return self._fallback(args, kwargs, GRAD)
        if self._writes:
            self._inputs.check_aliasing(leaves)
        if self.pool.shared:
            self.pool.before_replay(self._position)
        self._replay()
        if self._writes:  # eager semantics: the callable's writes reach the caller's tensors
            self._inputs.copy_back(leaves)
            if self._inputs.large:  # a KV cache copied in and out at every call: say so, once
                self._inputs.note_same_large(leaves, self.name)
        self.stats.replays += 1
        return self._outputs.emit(leaves)

    def invalidate_outputs(self) -> None:
        """Mark the outputs handed out so far as stale (another graph may overwrite them)."""
        self._outputs.invalidate()

    def _make_clones(self) -> None:
        outputs_to_clones(self, [self._outputs])

    def _fallback(self, args: tuple[Any, ...], kwargs: dict[str, Any], why: str) -> Any:
        what = self._inputs.tracked_path(args, kwargs) if why == GRAD else ""
        return self._eager.run(self._eager_fn(), args, kwargs, why, self.stats, what)

    def __repr__(self) -> str:
        return f"Graphed({self.name}, device={self.device}, {self.stats.explain()})"


def refuse_static_written_outputs(inputs: Inputs, out: Any, policy: str, name: str) -> None:
    """Under ``outputs="static"``, refuse an output that is (a view of) an input the callable
    writes: eagerly it would be the caller's own tensor, but the graph can only return its static
    buffer, which the next call overwrites and which later writes by the caller would not reach."""
    if policy != "static" or not inputs.written:
        return
    written = {
        inputs.slots[i].static.untyped_storage().data_ptr(): inputs.slots[i].path  # type: ignore[union-attr]
        for i in inputs.written
    }
    for k, leaf in enumerate(_compat.tree_flatten(out)[0]):
        if isinstance(leaf, torch.Tensor):
            path = written.get(leaf.untyped_storage().data_ptr())
            if path is not None:
                raise CaptureError(
                    f"'{name}' writes {path} in place and returns it (output {k}) under "
                    "outputs='static': eagerly the output is the caller's own tensor, but a "
                    "graph can only return its static copy, which differs from the caller's "
                    "tensor after later writes. Use outputs='checked' (the default) or "
                    "'clone', or return a new tensor (x.clone())"
                )


_PLAIN_OUTPUTS = (str, bytes, int, float, bool, complex, torch.dtype, torch.device, torch.Size, type(None))


def refuse_objects_holding_graph_tensors(out: Any, owned: Callable[[torch.Tensor], bool], name: str) -> None:
    """An output that is an object holding tensors the graph made (not a pytree: HF's
    ``DynamicCache``, which a decoder makes anew at each call with ``use_cache=True`` and no
    cache passed in). A replay hands out that same object at every call, its tensors in the
    graph's memory: the next call overwrites them with no ``StaleOutputError`` (they are not
    outputs the policy sees), and a caller that grows the object (the next decode step) leaves
    it holding other tensors than the graph writes. Refused, with the fix."""
    for k, leaf in enumerate(_compat.tree_flatten(out)[0]):
        if isinstance(leaf, (torch.Tensor, *_PLAIN_OUTPUTS)):
            continue
        for node, key, t in state_tensors(walk_state([(f"output {k}", leaf)], [], name)):
            if owned(t):
                raise CaptureError(
                    f"'{name}' returns a {type(leaf).__name__} (output {k}) that holds a tensor the "
                    f"graph made ({path_of(node, key)}): every replay would hand out this same "
                    "object, its tensors overwritten by the next call, unchecked. Return tensors "
                    "or a pytree of them: register the class as a pytree node "
                    "(torch.utils._pytree.register_dataclass for a dataclass), and each call "
                    "hands out a new one, checked. For an HF model, pass use_cache=False (or a "
                    "cache you pass in and keep, such as a StaticCache)"
                )


def owned_by(pool: Pool, inputs: Inputs) -> Callable[[torch.Tensor], bool]:
    """Return a predicate: does the graph own this output's memory (pool or static inputs)?"""
    ranges = pool.segment_ranges()
    static_ptrs = {s.static.untyped_storage().data_ptr() for s in inputs.tensor_slots}

    def owned(t: torch.Tensor) -> bool:
        ptr = t.untyped_storage().data_ptr()
        return ptr in static_ptrs or any(lo <= ptr < hi for lo, hi in ranges)

    return owned


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


def _reset_written(inputs: Inputs, leaves: Sequence[Any], adopted: Rewind | None) -> Callable[[], None]:
    """Put back the static buffers the last warm-up call wrote (their version counter moved),
    from the caller's sample tensors, and what it wrote into the adopted ones (the caller's
    own, ``adopted`` recording), so that every warm-up starts from the sample's state."""
    pairs = [(s.static, leaf) for s, leaf in zip(inputs.slots, leaves) if s.static is not None and not s.adopted]
    versions = [static._version for static, _ in pairs]

    def reset() -> None:
        if adopted is not None:
            adopted.undo()
        with torch.no_grad():
            for (static, leaf), version in zip(pairs, versions):
                if static._version != version:
                    static.copy_(leaf)

    return reset
