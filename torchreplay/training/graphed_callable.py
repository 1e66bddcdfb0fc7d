"""The replay side of :func:`torchreplay.make_graphed_callables`: :class:`GraphedCallable`, one
callable's forward and backward graphs, and the autograd node that joins them.

A call ``y = f(x)`` of a graphed callable:

1. checks the arguments against the capture and copies tensors into static buffers
   (core/io.py, Inputs);
2. replays the forward graph and hands the outputs out under the output policy (Outputs);
3. attaches one ``torch.autograd.Function`` node to the differentiable outputs, whose inputs are
   the caller's tensors and every tensor the callable differentiates into (its module's
   parameters, and any other leaf found in its autograd graph at capture);
4. when autograd reaches that node: copies the incoming gradients into static buffers, replays
   the backward graph and hands the gradients to autograd. A parameter whose ``.grad`` is None
   gets a fresh tensor (one multi-tensor copy for all of them), one whose ``.grad`` exists gets
   the static buffer, which ``AccumulateGrad`` adds in place: ``.grad`` accumulates g1 + g2 over
   micro-batches as in eager mode and never aliases the graph's memory (torch's returns the
   static buffer itself, which becomes ``.grad``; the next replay overwrites it: pytorch#181723).
   A leaf input gets a copy too; a non-leaf input (the previous layer's output) a tensor over
   the buffer under the output policy (:class:`~torchreplay.training.pair.InputGrads`).

Replay order. Graphs captured into one pool (the callables of one call share one, like torch's)
are captured forward 1..N, then backward N..1. A forward's saved activations live in the pool
from its replay until its backward reads them; a graph captured before that forward or after that
backward may use the same memory as scratch. Each forward replay therefore opens a
:class:`~torchreplay.core.pool.LiveWindow`; a replay at any position outside it marks it clobbered,
and the backward that would read clobbered activations runs the forward again eagerly instead
(training/recompute.py, as for ``create_graph=True`` and a second backward of one forward). A forward
with gradients whose own last replay awaits its backward runs eagerly instead (micro-batches). Backward nodes get sequence numbers in creation order,
enforced per pool, so the engine runs ready graphed backwards newest-first: the reverse of the
capture order.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch

from torchreplay import _compat
from torchreplay.config import RANKS, GraphConfig
from torchreplay.core.args import CallArgs, called_module, fn_name, owning_module
from torchreplay.core.capture import warn_mode_changed
from torchreplay.core.eager_form import EagerForm, own_forward
from torchreplay.core.snapshot import StateSnapshot
from torchreplay.core import modes
from torchreplay.core.modes import HOOKS, TRAIN_MODE, GradFlags, Hooks, warn_hooks_changed
from torchreplay.core.io import Inputs, point_or_off
from torchreplay.core.outputs import Outputs
from torchreplay.core.placed import CHANGES, GONE, Placed
from torchreplay.core.pool import LiveWindow, Pool
from torchreplay.core.threads import Callers, follow_stream, one_at_a_time
from torchreplay.distributed import EAGER, GRAPH, agreement
from torchreplay.errors import ReplayInputError, UnsupportedError
from torchreplay.stats import TrainingStats
from torchreplay.training.pair import InputGrads, Member, Order, Pair, capturing, next_sequence_nr, unreached
from torchreplay.training.recompute import CLOBBERED, CREATE_GRAPH, SECOND, Recomputes, recompute_backward, rng_reader
from torchreplay.training.state import StateKeeper
from torchreplay.training.verify import Tolerance, verified_call, verify_backward

__all__ = ["GraphedCallable", "TrainingStats"]

log = logging.getLogger(__name__)
_Handles = _compat.hook_handles_made  # its next_id counts every hook handle torch made

_Tensor = torch.Tensor
_any_autocast = _compat.any_autocast
_cuda_autocast = _compat.cuda_autocast
_dispatch_modes = _compat.dispatch_modes
_dynamo_tracing = _compat.dynamo_tracing


class GraphedCallable(EagerForm):
    """One callable of :func:`make_graphed_callables`: forward and backward graphs.

    Calling it (or the module whose ``forward`` it replaced) replays the forward graph and
    attaches one autograd node whose backward replays the backward graph.

    Attributes:
        name: the callable's name.
        stats: counters (forward ``replays``, ``backward_replays``, ``fallbacks``, ``verified``).
        pool: the memory pool the graphs live in.
    """

    _eager_attr = "_run_fn"  # (core/eager_form.py: what copies, pickles and inspect see)

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        device: torch.device,
        config: GraphConfig,
        order: Order,
        allow_unused: bool,
        verify: int,
        tol: Tolerance | None,
        name: str | None = None,
    ) -> None:
        self.fn = fn
        self.name = name or fn_name(fn)
        self.device = device
        self._ranks: Any = None  # set at _adopt when the graphs hold collectives
        self.config = config
        self._module = owning_module(fn)
        # Capture and eager fallback run the forward itself: a module's own hooks run around it
        self._run_fn: Callable[..., Any] = own_forward(fn) if isinstance(fn, torch.nn.Module) else fn
        self._training = self._module.training if self._module is not None else False
        self._order = order
        self._allow_unused = allow_unused
        self._verify_left = verify
        self._verify_total = verify
        self._tol = tol
        self._warned: set[str] = set()  # the reasons to run eagerly it warned about
        self._warned_awaiting = False
        self._recompute = Recomputes()  # (training/recompute.py: what it said, what it found)
        self._rng: Callable[[], Any] | None = None  # set if it draws random numbers
        self.pool: Pool | None = None
        self.stats = TrainingStats()

        call = CallArgs(self._run_fn, args, kwargs)
        with torch.no_grad():  # static buffers are fresh leaves, not copies tracked by autograd
            self._inputs = Inputs(call, device)
        sample_leaves = call.leaves
        del call
        slots = self._inputs.slots
        self._tensor_idx = [i for i, s in enumerate(slots) if s.static is not None]
        self._n_in = len(self._tensor_idx)
        self._sample_req = [
            bool(sample_leaves[i].requires_grad)
            and (sample_leaves[i].dtype.is_floating_point or sample_leaves[i].dtype.is_complex)
            for i in self._tensor_idx
        ]
        for i, req in zip(self._tensor_idx, self._sample_req):
            if req:
                slots[i].static.requires_grad_(True)  # type: ignore[union-attr]
        # A tensor argument that does not require grad at capture must not require it at replay.
        self._no_grad_slots = [
            slots[i] for i, req in zip(self._tensor_idx, self._sample_req) if not req
        ]
        self._no_grad_pos = [k for k, req in enumerate(self._sample_req) if not req]
        self._module_params = list(self._module.parameters()) if self._module is not None else []
        self._surface: list[torch.Tensor] | None = None
        self._grad_flags = GradFlags([])
        self._grad_inputs: list[torch.Tensor] = []
        self._grad_pos: list[int] = []  # per _grad_inputs entry: its position among apply inputs
        self._keeper: StateKeeper | None = None
        self._placed: Placed | None = None  # at _adopt
        self._reads: Any = None  # at _adopt: tensors in Python state it reads (StateReads)
        self._values: Any = None  # ... and the plain values (core/frozen.py)
        self._called: list[torch.nn.Module] | None = None  # a function's modules, found at warm-up
        self._callers = Callers()
        self._discovering_done = False
        self._autocast = _compat.cuda_autocast()  # its dtype, None: off

        def warm(*a: Any, **k: Any) -> Any:
            return self._warm(a, k)

        warm.__qualname__ = self.name
        self._warm_fn = warm

    # -- capture ----------------------------------------------------------------------------

    def _warm(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The call that capture() warms up and captures: the forward, plus, when not capturing,
        the backward (so that backward kernels initialise before capture too)."""
        now_capturing = capturing()
        keeper = self._keeper
        discover = keeper is not None and not now_capturing and not self._discovering_done
        probe = next_sequence_nr() if self._surface is None else 0
        # a plain function: the modules it runs, watched as a module is (core/args.py)
        find = self._module is None and self._called is None and not now_capturing
        finder = StateSnapshot(None, self.device, find=True, save=False) if find else None
        rng = rng_reader(self.device) if not now_capturing else None
        before = rng() if rng is not None else None
        with keeper.discovering() if discover else contextlib.nullcontext():  # type: ignore[union-attr]
            with finder.running() if finder is not None else contextlib.nullcontext():
                out = self._run_fn(*args, **kwargs)
        self._rng = rng if rng is not None and rng() != before else self._rng  # it draws (dropout)
        self._called = finder.called if finder is not None else self._called
        self._discovering_done = self._discovering_done or discover
        if self._surface is None:
            self._discover(out, probe)
        if now_capturing:
            return out
        diff = [o for o in _compat.tree_flatten(out)[0] if isinstance(o, _Tensor) and o.requires_grad]
        if diff and self._grad_inputs:
            try:
                torch.autograd.grad(
                    diff,
                    self._grad_inputs,
                    grad_outputs=[torch.zeros_like(o) for o in diff],
                    allow_unused=self._allow_unused,
                )
            except RuntimeError as exc:
                if "not have been used" in str(exc):
                    raise RuntimeError(
                        f"'{self.name}': some of its tensor arguments or parameters are not used "
                        "to compute its outputs, so they get no gradient; pass "
                        "allow_unused_input=True (their gradient is then None), or stop "
                        "passing them / set requires_grad=False on them"
                    ) from exc
                raise
        return out

    def _discover(self, out: Any, probe: int) -> None:
        """Find every tensor the outputs differentiate into: the module's parameters, plus
        leaves reached through the autograd graph (closures over parameters, other modules)."""
        known = {id(s.static) for s in self._inputs.tensor_slots}
        known |= {id(p) for p in self._module_params}
        extra: list[torch.Tensor] = []
        seen: dict[int, Any] = {}
        stack = [o.grad_fn for o in _compat.tree_flatten(out)[0] if isinstance(o, _Tensor)]
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen[id(node)] = node  # keep the object: its id must not be reused meanwhile
            variable = getattr(node, "variable", None)
            if variable is not None:  # AccumulateGrad: a leaf
                if id(variable) not in known:
                    known.add(id(variable))
                    extra.append(variable)
                continue
            if _compat.sequence_nr(node) <= probe:
                raise UnsupportedError(
                    f"'{self.name}' uses a tensor that requires grad but was computed before "
                    f"the call (autograd node {type(node).__name__}); a graph cannot "
                    "backpropagate into work done outside it. Pass that tensor as an argument "
                    "(a sample with requires_grad=True), or .detach() it"
                )
            stack.extend(n for n, _ in node.next_functions)
        self._surface = self._module_params + extra
        # frozen at capture, unfrozen since: the backward graph computes no gradient for it
        self._grad_flags = GradFlags(self._surface, [self._module], only_unfrozen=True)
        n_leaves = len(self._tensor_idx)
        self._grad_inputs = []
        self._grad_pos = []
        for k, req in enumerate(self._sample_req):
            if req:
                self._grad_inputs.append(self._inputs.slots[self._tensor_idx[k]].static)  # type: ignore[arg-type]
                self._grad_pos.append(k)
        for k, t in enumerate(self._surface):
            if t.requires_grad:
                self._grad_inputs.append(t)
                self._grad_pos.append(n_leaves + k)
        self._grad_names = self._names_of_grad_inputs()

    def _names_of_grad_inputs(self) -> list[str]:
        names: dict[int, str] = {}
        if self._module is not None:
            names = {id(p): n for n, p in self._module.named_parameters()}
        out = []
        n_leaves = len(self._tensor_idx)
        assert self._surface is not None
        for pos in self._grad_pos:
            if pos < n_leaves:
                out.append(f"grad of {self._inputs.slots[self._tensor_idx[pos]].path}")
            else:
                t = self._surface[pos - n_leaves]
                label = names.get(id(t))
                out.append(
                    f"grad of parameter '{label}'"
                    if label is not None
                    else f"grad of captured tensor {pos - n_leaves} ({tuple(t.shape)})"
                )
        return out

    def _adopt(self, pair: Pair, pool: Pool) -> None:
        """Take the captured graphs; from here on calls replay."""
        self.pool = pool
        self.stats = TrainingStats(pool.reserved_bytes)
        self.stats.captures = 1 + (pair.bwd_replay is not None)
        self.stats.capture_seconds = pair.seconds
        self._pair = pair
        self._fwd_replay = pair.fwd_replay
        self._bwd_replay = pair.bwd_replay
        self._outputs = Outputs(tuple(pair.leaves), self.config.outputs, self.name, pair.owned, reuse=True)
        # The node's outputs are new tensors over the handed-out memory: a checked output with
        # a grad_fn cannot be handed out again (a new tensor and storage every call).
        self._detach_diff = self._outputs.policy != "clone"
        self._spec = pair.spec
        self._single = _compat.is_leaf_treespec(pair.spec)
        self._rebuild = _compat.unflattener(pair.spec)
        self._diff_idx = pair.diff_idx
        self._has_backward = pair.bwd_replay is not None
        self._static_grad_outputs = pair.static_grad_outputs
        self._bwd_copies = pair.bwd_copies  # (one node per grad-output buffer, or none)
        self._static_grad_inputs = pair.static_grad_inputs
        self._reach = pair.reach  # (which outputs' gradients reach each grad input: pair.py)
        self._unreached: dict[int, frozenset[int]] = {}  # (by which outputs have a gradient)
        self._reads = pair.reads  # tensors in Python state the forward reads (core/effects.py)
        self._values = pair.reads.values if pair.reads is not None else None  # plain values it read
        if pair.generators:  # (registered with it: a recompute draws from where the call did)
            self._rng = rng_reader(self.device, self._rng is not None, pair.generators)
        self._inputs.set_written(pair.written)
        self._inputs.attach(pair.copies)  # (pair.spares: kept by self._pair)
        self.stats.graph_copies = len(pair.copies)
        self.stats.grad_copies = len(pair.bwd_copies)
        self._writes = bool(self._inputs.written or self._inputs.rebound)  # (generators: moved on)
        self.stats.written_inputs = self._inputs.written_paths()
        self.collectives = pair.collectives
        self._ranks = agreement(RANKS, pair.collectives, pair.collective_log, name=self.name, device=self.device)
        self._warned_grad: set[int] = set()
        for s in self._inputs.tensor_slots:
            s.static.requires_grad_(False)  # type: ignore[union-attr]  # copy_in writes into them
        self._surface_t = tuple(self._surface or ())
        self._warm_fn = None  # only capture needs it (and it refers back to self: a cycle)
        # Kept here: the pool refers to its members weakly.
        self.fwd_member = Member(f"{self.name} (forward)", self._outputs.invalidate)
        grads = pair.input_grads = InputGrads(f"{self.name} (backward)")
        self._input_grads = grads
        self.bwd_member = Member(f"{self.name} (backward)", grads.invalidate)
        self._fwd_pos = -1
        self._bwd_pos = -1
        self._device_index = self.device.index
        self._check_device = self.device.type == "cuda" and torch.cuda.device_count() > 1
        own = self._module is None  # a function's modules run their own hooks inside it
        if own and self._called:
            self._module = module = called_module(self._called)
            self._training = module.training  # type: ignore[union-attr]
        self._placed = Placed.of(self._module, self.device, objects=True)  # grads go to them
        # hooks inside the forward (submodules', global) and its backward: none run at replay
        self._hooks = Hooks(self._module, own=own, backward=True)

    # -- replay ----------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _dynamo_tracing():  # called from code torch.compile traces: run outside it
            return _compat.call_untraced(self, args, kwargs)
        module, hooks = self._module, self._hooks
        why = TRAIN_MODE if module is not None and module.training != self._training else None
        if why is None and _dispatch_modes():  # a tracer, FlopCounterMode: they see each op
            why = modes.DISPATCH_MODE  # (before hooks: FlopCounterMode adds global ones)
        if why is None and hooks.at != _Handles.next_id and not hooks.look():
            why = HOOKS  # added or removed since capture: eagerly they would run, or not
        if why is None and self._grad_flags.changed():
            why = modes.REQUIRES_GRAD
        if why is None and _compat.transform_active():  # vmap, grad, jvp: eagerly, as they expect
            why = modes.TRANSFORM  # (functional_call's weights are theirs: not checked)
        values = self._values
        if why is None and values is not None and values.changed():  # a flag the forward read
            why = modes.PY_VALUE
        placed = self._placed if why is not modes.TRANSFORM else None  # moved, weights replaced
        moved = placed is not None and (
            placed.seen != CHANGES[0] or placed.table.get(placed.key, GONE).data_ptr() != placed.at
        ) and placed.moved()
        stale = self._reads.replaced(self.name) if self._reads is not None else None  # replaced
        if self._ranks is not None:  # collectives inside: every rank replays, or all raise
            self._ranks(0, EAGER if why is not None or moved or stale else GRAPH)
        if moved:
            raise placed.error(self.name)  # type: ignore[union-attr]
        if stale is not None:
            raise stale
        if why is not None:
            return self._fallback(args, kwargs, why)
        autocast = self._autocast
        if (autocast is not None or _any_autocast()) and _cuda_autocast() != autocast:
            raise ReplayInputError(modes.autocast_changed(self.name, autocast))
        return one_at_a_time(self, self._dispatch, args, kwargs, self._inside_capture)

    def _dispatch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._verify_left:
            return verified_call(self, args, kwargs)
        return self._run(args, kwargs, None)

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any], verify: Any) -> Any:
        grad_on = torch.is_grad_enabled()
        if grad_on and self.pool.awaits(self._fwd_pos):  # type: ignore[union-attr]
            return self._awaiting_fallback(args, kwargs)
        try:
            leaves = self._inputs.copy_in(args, kwargs)
        except ReplayInputError as e:  # which graph: one of many (a segment of breaks=)
            raise ReplayInputError(f"'{self.name}': {e}") from None
        if grad_on and self._no_grad_slots:
            for k, slot in zip(self._no_grad_pos, self._no_grad_slots):
                if leaves[self._tensor_idx[k]].requires_grad and k not in self._warned_grad:
                    self._warned_grad.add(k)  # (torch's tool is silent; a refusal breaks drop-in)
                    modes.warn_no_sample_grad(self.name, slot.path)
        if self._writes:
            self._inputs.check_aliasing(leaves)
        pool = self.pool
        if pool.shared:  # type: ignore[union-attr]
            pool.before_replay(self._fwd_pos)  # type: ignore[union-attr]
        rng = self._rng() if self._rng is not None and grad_on else None
        self._fwd_replay()
        if self._writes:  # eager semantics: the forward's writes reach the caller's tensors
            self._inputs.copy_back(leaves)
        self.stats.replays += 1
        flat = self._outputs.emit()
        if grad_on and self._has_backward:
            flat = list(flat)
            diff = tuple(
                flat[i].detach() if self._detach_diff else flat[i] for i in self._diff_idx
            )
            tensors = [leaves[i] for i in self._tensor_idx]
            outs = _graphed_apply(self, diff, *tensors, *self._surface_t)
            node = outs[0].grad_fn
            if node is not None:
                self._attach(node, verify)
                if rng is not None:  # where its random ops drew: a recompute draws the same
                    node.tr_rng = rng
                for i, o in zip(self._diff_idx, outs):
                    flat[i] = o
        if self._single:
            return flat[0]
        return self._rebuild(list(flat))

    def _attach(self, node: Any, verify: Any) -> None:
        """Give the new backward node its live window and its place in the backward order."""
        pool = self.pool
        assert pool is not None
        node.tr_window = pool.open_window(self._fwd_pos, self._bwd_pos, self.name)
        if verify is not None:
            node.tr_verify = verify
        order = self._order
        seq = _compat.sequence_nr(node)
        if seq <= order.last:
            # Created out of order (another thread): run it before the older ones anyway.
            seq = order.last + 1
            _compat.set_sequence_nr(node, seq)
        order.last = seq

    def _backward(self, ctx: Any, grads: tuple[torch.Tensor | None, ...]) -> list[Any]:
        with self._callers.lock:  # not during another thread's forward (its copy-in, replay)
            return self._backward_locked(ctx, grads)

    def _backward_locked(self, ctx: Any, grads: tuple[torch.Tensor | None, ...]) -> list[Any]:
        window: LiveWindow | None = getattr(ctx, "tr_window", None)
        why = (
            CREATE_GRAPH if torch.is_grad_enabled()
            else SECOND if getattr(ctx, "tr_done", False)
            else CLOBBERED if window is not None and window.clobbered_by is not None
            else None
        )
        pool = self.pool
        assert pool is not None
        if why is not None:  # as eager computes it: the forward again (training/recompute.py)
            if why is CLOBBERED:
                why = f"{why} ('{window.clobbered_by}')"  # type: ignore[union-attr]
            grads_in = recompute_backward(self, ctx, grads, why)
            if why is not CREATE_GRAPH:  # (after that one, the loss's own backward replays)
                ctx.tr_done = True
                if window is not None:
                    pool.close_window(window)
            return grads_in
        follow_stream(pool)  # ordered after a call on another stream
        if pool.shared:
            pool.before_replay(self._bwd_pos, window)
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        nodes = self._bwd_copies
        for k, (static, g) in enumerate(zip(self._static_grad_outputs, grads)):
            if nodes:  # the graph's first nodes copy the gradients in: pointed, or off
                if g is not None and g is not static and g.shape == static.shape and (
                    g.dtype is static.dtype and point_or_off(nodes[k], g)
                ):
                    continue
                nodes[k].off()
            if g is None:
                static.zero_()
            elif g is not static:
                dsts.append(static)
                srcs.append(g)
        if len(dsts) == 1:
            dsts[0].copy_(srcs[0])
        elif dsts:
            _compat.foreach_copy_(dsts, srcs)
        assert self._bwd_replay is not None
        self._bwd_replay()
        ctx.tr_done = True
        if window is not None:
            pool.close_window(window)
        self.stats.backward_replays += 1
        verify = getattr(ctx, "tr_verify", None)
        if verify is not None:
            ctx.tr_verify = None
            verify_backward(self, verify, grads)

        return self._input_grads.hand(
            ctx, self._static_grad_inputs, self._grad_pos, len(self._tensor_idx),
            self._surface_t, self._outputs.policy, unreached(self._reach, grads, self._unreached),
        )

    # -- eager paths -------------------------------------------------------------------------

    def _awaiting_fallback(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Called again while the last replay's activations await their backward: eagerly."""
        self.stats.fallbacks += 1
        if not self._warned_awaiting:
            self._warned_awaiting = True
            log.warning(
                "torchreplay: '%s' was called again while its last graphed forward's activations "
                "await their backward; this call runs eagerly (stats.fallbacks), as will others "
                "until that backward runs. Call backward once per forward to replay every call; "
                "keep outputs without a backward under torch.no_grad() or .detach()ed", self.name,
            )
        return self._eager_fn()(*args, **kwargs)  # (an nn.DataParallel replica: its own forward)

    def _inside_capture(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Inside another graph's capture (a whole step graphed): run as is, recorded there."""
        self.stats.fallbacks += 1
        return self._eager_fn()(*args, **kwargs)

    def _fallback(self, args: tuple[Any, ...], kwargs: dict[str, Any], why: str) -> Any:
        self.stats.fallbacks += 1
        seen = why if why != modes.PY_VALUE else self._values.last  # (each value changed, once)
        if seen not in self._warned:
            self._warned.add(seen)
            if why == HOOKS:
                warn_hooks_changed(self.name, self._hooks)
            elif why == modes.REQUIRES_GRAD:
                modes.warn_requires_grad(self.name, self._grad_flags.describe())
            elif why in (modes.DISPATCH_MODE, modes.TRANSFORM):  # what the caller asked for
                (modes.note_transform if why == modes.TRANSFORM else modes.note_dispatch_mode)(self.name)
            elif why == modes.REPLICA:
                modes.warn_replica(self.name)
            elif why == modes.PY_VALUE:
                modes.warn_value_changed(self.name, self._values.last)
            else:
                warn_mode_changed(self.name, self._training)
        return self._eager_fn()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"GraphedCallable({self.name}, device={self.device}, {self.stats.explain()})"


class _GraphedFunction(torch.autograd.Function):
    """The autograd node of one graphed call: the forward already replayed, backward replays."""

    @staticmethod
    def forward(ctx: Any, runner: GraphedCallable, outs: tuple[torch.Tensor, ...], *tensors: Any) -> Any:  # type: ignore[override]
        # outs: this call's outputs (just replayed); tensors: the node's inputs (args, params)
        ctx.set_materialize_grads(False)  # an unused output's gradient is None: zero it once
        ctx.runner = runner
        ctx.save_for_backward(*tensors[:runner._n_in])  # the call's own tensors: for recompute.py
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        return (None, None, *ctx.runner._backward(ctx, grads))


_graphed_apply = _compat.direct_apply(_GraphedFunction)  # its apply, without the Python preamble
