"""``tr.make_graphed_callables``: forward and backward as CUDA graphs inside one autograd node,
a drop-in superset of ``torch.cuda.make_graphed_callables``.

A call ``y = f(x)`` of a graphed callable:

1. checks the arguments against the capture and copies tensors into static buffers (io.Inputs);
2. replays the forward graph and hands the outputs out under the output policy (io.Outputs);
3. attaches one ``torch.autograd.Function`` node to the differentiable outputs, whose inputs are
   the caller's tensors and every tensor the callable differentiates into (its module's
   parameters, and any other leaf found in its autograd graph at capture);
4. when autograd reaches that node: copies the incoming gradients into static buffers, replays
   the backward graph and hands the gradients to autograd. A parameter whose ``.grad`` is None
   gets a fresh tensor (one multi-tensor copy for all of them), one whose ``.grad`` exists gets
   the static buffer, which ``AccumulateGrad`` adds in place: ``.grad`` accumulates g1 + g2 over
   micro-batches as in eager mode and never aliases the graph's memory (torch's returns the
   static buffer itself, which becomes ``.grad``; the next replay overwrites it: pytorch#181723).

Replay order. Graphs captured into one pool (the callables of one call share one, like torch's)
are captured forward 1..N, then backward N..1. A forward's saved activations live in the pool
from its replay until its backward reads them; a graph captured before that forward or after that
backward may use the same memory as scratch. Each forward replay therefore opens a
:class:`~torchreplay.pool.LiveWindow`; a replay at any position outside it marks it clobbered,
and the backward that would read clobbered activations raises
:class:`~torchreplay.StaleOutputError` naming both graphs instead of computing wrong gradients.
The replay that clobbers is not itself an error: the pending backward may never run (its outputs
dropped, a forward under evaluation). Backward nodes get sequence numbers in creation order,
enforced per pool, so the engine runs ready graphed backwards newest-first: the reverse of the
capture order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any, Callable, Sequence, overload

import torch

from torchreplay import _compat
from torchreplay.capture import capture, fn_name, owning_module, side_stream
from torchreplay.config import GraphConfig
from torchreplay.errors import ReplayInputError, StaleOutputError, UnsupportedError
from torchreplay.graphed import _owned_by, infer_device, resolve_config, resolve_pool
from torchreplay.io import Inputs, Outputs
from torchreplay.pool import LiveWindow, Pool
from torchreplay.state import StateKeeper
from torchreplay.stats import GraphStats
from torchreplay.verify import Tolerance, check_close, check_tree, resolve_tolerance

__all__ = ["make_graphed_callables", "GraphedCallable", "TrainingStats"]

log = logging.getLogger(__name__)

_Tensor = torch.Tensor


class TrainingStats(GraphStats):
    """:class:`~torchreplay.GraphStats` plus training counters.

    Attributes:
        backward_replays: backward graph replays.
        verified: calls compared against eager (``verify=K``).
    """

    __slots__ = ("backward_replays", "verified")

    def __init__(self, pool_bytes: Callable[[], int] | None = None) -> None:
        super().__init__(pool_bytes)
        self.backward_replays = 0
        self.verified = 0

    def as_dict(self) -> dict[str, object]:
        d = super().as_dict()
        d["backward_replays"] = self.backward_replays
        d["verified"] = self.verified
        return d


class _Member:
    """A graph's entry in its pool's capture order (named, for ordering messages)."""

    __slots__ = ("name", "_invalidate")

    def __init__(self, name: str, invalidate: Callable[[], None] | None = None) -> None:
        self.name = name
        self._invalidate = invalidate

    def invalidate_outputs(self) -> None:
        if self._invalidate is not None:
            self._invalidate()


class _Order:
    """The last backward sequence number given out among callables sharing one pool."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last = -1


@dataclasses.dataclass
class _Pair:
    """The captured forward and backward of one callable (what replay needs from capture).

    Attributes:
        fwd_replay / bwd_replay: replay the forward / backward graph (bwd None: nothing to
            differentiate).
        leaves, spec: the forward's outputs, flattened; tensors the graph owns are detached.
        diff_idx: positions in ``leaves`` of the differentiable outputs.
        owned: does the graph own this tensor's memory (pool or static inputs)?
        static_grad_outputs: one buffer per differentiable output, outside the pool.
        static_grad_inputs: the backward's results, one per ``GraphedCallable._grad_inputs``.
        graphs: keeps the graph objects alive.
        seconds: warm-up and capture time.
    """

    fwd_replay: Callable[[], Any]
    bwd_replay: Callable[[], Any] | None
    leaves: list[Any]
    spec: Any
    diff_idx: list[int]
    owned: Callable[[torch.Tensor], bool]
    static_grad_outputs: list[torch.Tensor]
    static_grad_inputs: list[torch.Tensor | None]
    graphs: tuple[Any, ...] = ()
    seconds: float = 0.0


class GraphedCallable:
    """One callable of :func:`make_graphed_callables`: forward and backward graphs.

    Calling it (or the module whose ``forward`` it replaced) replays the forward graph and
    attaches one autograd node whose backward replays the backward graph.

    Attributes:
        name: the callable's name.
        stats: counters (forward ``replays``, ``backward_replays``, ``fallbacks``, ``verified``).
        pool: the memory pool the graphs live in.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        device: torch.device,
        config: GraphConfig,
        order: _Order,
        allow_unused: bool,
        verify: int,
        tol: Tolerance | None,
    ) -> None:
        self.fn = fn
        self.name = fn_name(fn)
        self.device = device
        self.config = config
        self._module = owning_module(fn)
        # Capture and eager fallback run the forward itself: a module's own hooks stay outside
        # the graph and run eagerly around every call, as they do for an eager module.
        self._run_fn: Callable[..., Any] = _original_forward(fn)
        self._training = self._module.training if self._module is not None else False
        self._order = order
        self._allow_unused = allow_unused
        self._verify_left = verify
        self._verify_total = verify
        self._tol = tol
        self._warned_fallback = False
        self.pool: Pool | None = None
        self.stats = TrainingStats()

        with torch.no_grad():  # static buffers are fresh leaves, not copies tracked by autograd
            self._inputs = Inputs(self._run_fn, args, kwargs, device)
        sample_leaves = _compat.tree_flatten((tuple(args), dict(kwargs)))[0]
        slots = self._inputs.slots
        self._tensor_idx = [i for i, s in enumerate(slots) if s.static is not None]
        self._sample_req = [
            bool(sample_leaves[i].requires_grad) and _differentiable(sample_leaves[i])
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
        self._grad_inputs: list[torch.Tensor] = []
        self._grad_pos: list[int] = []  # per _grad_inputs entry: its position among apply inputs
        self._keeper: StateKeeper | None = None
        self._discovering_done = False
        self._autocast = (
            torch.is_autocast_enabled("cuda"),
            torch.get_autocast_dtype("cuda"),
        )

        def warm(*a: Any, **k: Any) -> Any:
            return self._warm(a, k)

        warm.__qualname__ = self.name
        self._warm_fn = warm

    # -- capture ----------------------------------------------------------------------------

    def _warm(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The call that capture() warms up and captures: the forward, plus, when not
        capturing, the backward (so that backward kernels initialise before capture too)."""
        capturing = _capturing()
        keeper = self._keeper
        discover = keeper is not None and not capturing and not self._discovering_done
        probe = _next_sequence_nr() if self._surface is None else 0
        with keeper.discovering() if discover else contextlib.nullcontext():  # type: ignore[union-attr]
            out = self._run_fn(*args, **kwargs)
        self._discovering_done = self._discovering_done or discover
        if self._surface is None:
            self._discover(out, probe)
        if capturing:
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

    def _adopt(self, pair: _Pair, pool: Pool) -> None:
        """Take the captured graphs; from here on calls replay."""
        self.pool = pool
        self.stats = TrainingStats(pool.reserved_bytes)
        self.stats.captures = 1 + (pair.bwd_replay is not None)
        self.stats.capture_seconds = pair.seconds
        self._pair = pair
        self._fwd_replay = pair.fwd_replay
        self._bwd_replay = pair.bwd_replay
        self._outputs = Outputs(tuple(pair.leaves), self.config.outputs, self.name, pair.owned)
        self._detach_diff = self._outputs.policy == "static"
        self._spec = pair.spec
        self._single = _compat.is_leaf_treespec(pair.spec)
        self._diff_idx = pair.diff_idx
        self._has_backward = pair.bwd_replay is not None
        self._static_grad_outputs = pair.static_grad_outputs
        self._static_grad_inputs = pair.static_grad_inputs
        for s in self._inputs.tensor_slots:
            s.static.requires_grad_(False)  # type: ignore[union-attr]  # copy_in writes into them
        self._surface_t = tuple(self._surface or ())
        self.fwd_member = _Member(f"{self.name} (forward)", self._outputs.invalidate)
        self.bwd_member = _Member(f"{self.name} (backward)")
        self._fwd_pos = -1
        self._bwd_pos = -1
        self._device_index = self.device.index
        self._check_device = self.device.type == "cuda" and torch.cuda.device_count() > 1

    # -- replay ----------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module
        if module is not None and module.training != self._training:
            return self._fallback(args, kwargs)
        enabled, dtype = self._autocast
        if torch.is_autocast_enabled("cuda") != enabled or (
            enabled and torch.get_autocast_dtype("cuda") != dtype
        ):
            raise ReplayInputError(self._autocast_message())
        if self._check_device and torch.cuda.current_device() != self._device_index:
            with torch.cuda.device(self._device_index):
                return self._dispatch(args, kwargs)
        return self._dispatch(args, kwargs)

    def _dispatch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._verify_left:
            return self._verified_call(args, kwargs)
        return self._run(args, kwargs, None)

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any], verify: Any) -> Any:
        leaves = self._inputs.copy_in(args, kwargs)
        grad_on = torch.is_grad_enabled()
        if grad_on and self._no_grad_slots:
            for k, slot in zip(self._no_grad_pos, self._no_grad_slots):
                if leaves[self._tensor_idx[k]].requires_grad:
                    raise ReplayInputError(
                        f"{slot.path}: requires grad, but its sample argument did not, so the "
                        "backward graph computes no gradient for it; graph with a sample that "
                        "has requires_grad=True, or pass it .detach()ed"
                    )
        pool = self.pool
        if pool.shared:  # type: ignore[union-attr]
            pool.before_replay(self._fwd_pos)  # type: ignore[union-attr]
        self._fwd_replay()
        self.stats.replays += 1
        flat = self._outputs.emit()
        if grad_on and self._has_backward:
            flat = list(flat)
            diff = tuple(
                flat[i].detach() if self._detach_diff else flat[i] for i in self._diff_idx
            )
            tensors = [leaves[i] for i in self._tensor_idx]
            outs = _GraphedFunction.apply(self, diff, *tensors, *self._surface_t)
            node = outs[0].grad_fn
            if node is not None:
                self._attach(node, verify)
                for i, o in zip(self._diff_idx, outs):
                    flat[i] = o
        if self._single:
            return flat[0]
        return _compat.tree_unflatten(list(flat), self._spec)

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
        if torch.is_grad_enabled():
            raise UnsupportedError(
                f"double backward through graphed '{self.name}' is not supported (backward ran "
                "with create_graph=True): its backward is a CUDA graph replay, which autograd "
                "cannot differentiate. Compute higher-order terms (gradient penalties) with the "
                "eager callable, or call backward without create_graph"
            )
        if getattr(ctx, "tr_done", False):
            raise UnsupportedError(
                f"backward of graphed '{self.name}' ran a second time for one forward "
                "(retain_graph=True): its backward graph reuses the memory of the activations "
                "it reads, so a second replay would read overwritten data. Run the forward "
                "again before each backward"
            )
        window: LiveWindow | None = getattr(ctx, "tr_window", None)
        if window is not None and window.clobbered_by is not None:
            raise StaleOutputError(
                f"backward of graphed '{self.name}' cannot run: after its forward, a replay of "
                f"'{window.clobbered_by}' may have overwritten the activations that forward "
                "saved (graphs that share a memory pool reuse each other's scratch memory). "
                "Graphs sharing a pool must run forward 1..N, then backward N..1, the order "
                f"they were captured in: run this backward before replaying '{window.clobbered_by}',"
                " call backward once per forward (one micro-batch at a time), or graph the "
                "callables in separate make_graphed_callables calls (separate pools)"
            )
        pool = self.pool
        assert pool is not None
        if pool.shared:
            pool.before_replay(self._bwd_pos, window)
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for static, g in zip(self._static_grad_outputs, grads):
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
            self._verify_backward(verify, grads)

        result: list[Any] = [None] * (len(self._tensor_idx) + len(self._surface_t))
        needs = ctx.needs_input_grad
        n_leaves = len(self._tensor_idx)
        fresh_pos: list[int] = []
        fresh_src: list[torch.Tensor] = []
        for static, pos in zip(self._static_grad_inputs, self._grad_pos):
            if static is None or not needs[pos + 2]:
                continue
            if pos >= n_leaves and self._surface_t[pos - n_leaves].grad is None:
                # AccumulateGrad would keep the returned tensor as .grad: give it its own copy.
                fresh_pos.append(pos)
                fresh_src.append(static)
            else:
                # We keep a reference, so autograd never takes this buffer as its own: a leaf's
                # existing .grad adds it in place, anything else copies or reads it.
                result[pos] = static
        if fresh_src:
            for pos, t in zip(fresh_pos, _compat.foreach_clone(fresh_src)):
                result[pos] = t
        return result

    # -- verify ----------------------------------------------------------------------------

    def _verified_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # The first K calls are compared, whatever their outcome: count this one now.
        self._verify_left -= 1
        call = self._verify_total - self._verify_left
        grad_on = torch.is_grad_enabled()
        module = self._module
        keeper = StateKeeper(self.device, modules=[module] if module is not None else [], params=False)
        leaves, spec = _compat.tree_flatten((tuple(args), dict(kwargs)))
        ref_leaves = list(leaves)
        for k, i in enumerate(self._tensor_idx):
            t = leaves[i]
            if isinstance(t, _Tensor):
                c = t.detach().clone()
                if grad_on and self._sample_req[k]:
                    c.requires_grad_(True)
                ref_leaves[i] = c
        ref_args, ref_kwargs = _compat.tree_unflatten(ref_leaves, spec)
        with keeper.discovering():
            ref_out = self._run_fn(*ref_args, **ref_kwargs)
        eager_buffers = [(label, b, b.detach().clone()) for label, b in _named_buffers(keeper, module)]
        keeper.restore()  # the graph replays from the state eager started from (buffers, RNG)

        verify = None
        if grad_on and self._has_backward:
            ref_flat = _compat.tree_flatten(ref_out)[0]
            if len(ref_flat) == len(self._pair.leaves):
                ref_diff = [ref_flat[i] for i in self._diff_idx]
                n_leaves = len(self._tensor_idx)
                ref_ins: list[Any] = []
                for pos in self._grad_pos:
                    if pos < n_leaves:
                        ref_ins.append(ref_leaves[self._tensor_idx[pos]])
                    else:
                        ref_ins.append(self._surface_t[pos - n_leaves])
                verify = (ref_diff, ref_ins, call)
        out = self._run(args, kwargs, verify)
        check_tree("output", out, _detached(ref_out), call=call, name=self.name, tol=self._tol)
        for label, b, want in eager_buffers:
            check_close(f"buffer {label}", b, want, call=call, name=self.name, tol=self._tol)
        self.stats.verified += 1
        return out

    def _verify_backward(self, verify: Any, grads: tuple[torch.Tensor | None, ...]) -> None:
        ref_diff, ref_ins, call = verify
        usable = [
            (o, g) for o, g in zip(ref_diff, grads) if isinstance(o, _Tensor) and o.requires_grad
        ]
        if not usable:
            return
        wanted = [i for i, t in enumerate(ref_ins) if isinstance(t, _Tensor) and t.requires_grad]
        ref_grads = torch.autograd.grad(
            [o for o, _ in usable],
            [ref_ins[i] for i in wanted],
            grad_outputs=[g if g is not None else torch.zeros_like(o) for o, g in usable],
            allow_unused=True,
        )
        for i, want in zip(wanted, ref_grads):
            got = self._static_grad_inputs[i]
            if want is None and got is not None:
                want = torch.zeros_like(got)
            if got is None and want is not None:
                got = torch.zeros_like(want)
            check_close(self._grad_names[i], got, want, call=call, name=self.name, tol=self._tol)

    # -- eager paths -------------------------------------------------------------------------

    def _fallback(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.stats.fallbacks += 1
        if not self._warned_fallback:
            self._warned_fallback = True
            mode = "training" if self._training else "eval"
            log.warning(
                "torchreplay: '%s' was graphed in %s mode but the module is now in %s mode; "
                "running its forward eagerly (counted in stats.fallbacks)",
                self.name,
                mode,
                "eval" if self._training else "training",
            )
        return self._run_fn(*args, **kwargs)

    def _autocast_message(self) -> str:
        enabled, dtype = self._autocast
        now = torch.is_autocast_enabled("cuda")
        captured = f"autocast({str(dtype).removeprefix('torch.')})" if enabled else "no autocast"
        current = (
            f"autocast({str(torch.get_autocast_dtype('cuda')).removeprefix('torch.')})"
            if now
            else "no autocast"
        )
        return (
            f"'{self.name}' was graphed under {captured} but is called under {current}; the graph "
            "always computes in the precision it was captured in. Call it under the same "
            "autocast setting, or graph it again under this one"
        )

    def __repr__(self) -> str:
        return f"GraphedCallable({self.name}, device={self.device}, {self.stats.explain()})"


class _GraphedFunction(torch.autograd.Function):
    """The autograd node of one graphed call: the forward already replayed, backward replays."""

    @staticmethod
    def forward(ctx: Any, runner: GraphedCallable, outs: tuple[torch.Tensor, ...], *tensors: Any) -> Any:  # type: ignore[override]
        # ``outs`` are this call's outputs, handed out by the replay that just ran; ``tensors``
        # are the node's inputs (the caller's tensors and the differentiated parameters).
        ctx.set_materialize_grads(False)  # an unused output's gradient is None: zero it once
        ctx.runner = runner
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        return (None, None, *ctx.runner._backward(ctx, grads))


def _original_forward(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The callable to capture: a module's forward (its own, if it was graphed before)."""
    if not isinstance(fn, torch.nn.Module):
        return fn
    forward = fn.forward
    return forward._run_fn if isinstance(forward, GraphedCallable) else forward


def _capturing() -> bool:
    """Is the current CUDA stream capturing? (False without CUDA, where torch's check raises.)"""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _differentiable(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


def _next_sequence_nr() -> int:
    """The sequence number that autograd's next node on this thread will exceed."""
    probe = torch.empty((), device="cpu", requires_grad=True).clone()
    return _compat.sequence_nr(probe.grad_fn)


def _detached(tree: Any) -> Any:
    leaves, spec = _compat.tree_flatten(tree)
    return _compat.tree_unflatten(
        [t.detach() if isinstance(t, _Tensor) else t for t in leaves], spec
    )


def _named_buffers(keeper: StateKeeper, module: torch.nn.Module | None) -> list[tuple[str, torch.Tensor]]:
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    if module is not None:
        for name, b in module.named_buffers():
            out.append((f"'{name}'", b))
            seen.add(id(b))
    for m in keeper.modules:
        for name, b in m.named_buffers(recurse=False):
            if id(b) not in seen:
                seen.add(id(b))
                out.append((f"'{name}' of {type(m).__name__}", b))
    return out


# -- capture ---------------------------------------------------------------------------------


def _capture_pairs(
    runners: Sequence[GraphedCallable], *, device: torch.device, pool: Pool, config: GraphConfig
) -> list[_Pair]:
    """Warm up and capture forward 1..N, then backward N..1, into ``pool``."""
    stream = side_stream(device)
    forwards = []
    for r in runners:
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
            )
        )
    pairs: list[_Pair | None] = [None] * len(runners)
    for i in reversed(range(len(runners))):
        r, fwd = runners[i], forwards[i]
        leaves, spec = _compat.tree_flatten(fwd.out)
        owned = _owned_by(pool, r._inputs)
        diff_idx = [
            j
            for j, o in enumerate(leaves)
            if isinstance(o, _Tensor) and o.requires_grad and owned(o)
        ]
        bwd = None
        grads: list[torch.Tensor | None] = []
        grad_outputs: list[torch.Tensor] = []
        seconds = fwd.seconds
        if diff_idx and r._grad_inputs:
            # Outside the pool: they must outlive every later capture into it.
            grad_outputs = [torch.empty_like(leaves[j]) for j in diff_idx]
            outputs = [leaves[j] for j in diff_idx]
            inputs, allow_unused = r._grad_inputs, r._allow_unused

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
            )
            grads = list(bwd.out)
            seconds += bwd.seconds
            del outputs, backward
        # Keep the outputs' memory, drop their autograd history (freed by the backward capture).
        kept = [o.detach() if isinstance(o, _Tensor) and owned(o) else o for o in leaves]
        pairs[i] = _Pair(
            fwd_replay=fwd.graph.replay,
            bwd_replay=bwd.graph.replay if bwd is not None else None,
            leaves=kept,
            spec=spec,
            diff_idx=diff_idx,
            owned=owned,
            static_grad_outputs=grad_outputs,
            static_grad_inputs=grads,
            graphs=(fwd.graph, bwd.graph if bwd is not None else None),
            seconds=seconds,
        )
        forwards[i] = None  # type: ignore[call-overload]
        del leaves, fwd, bwd
    return [p for p in pairs if p is not None]


def _build(runners: list[GraphedCallable], device: torch.device, pool: Pool, config: GraphConfig) -> None:
    """Capture every runner's graphs into ``pool``, leave module state and RNG as they were,
    and register the graphs in capture order."""
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
    for r, pair in zip(runners, pairs):
        r._adopt(pair, pool)
    for r in runners:
        r._fwd_pos = pool.register(r.fwd_member)
    for r in reversed(runners):
        r._bwd_pos = pool.register(r.bwd_member) if r._has_backward else -1
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
        if sub is not module
        and (sub._forward_hooks or sub._forward_pre_hooks or sub._backward_hooks
             or getattr(sub, "_backward_pre_hooks", None))
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
    replay order for callables that share a pool; ``verify=K``.

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

    .. warning::
        Call graphed callables that share a pool in the order they were given, and run their
        backwards in reverse (as one ``backward()`` over all of them does). A backward that
        would read activations another replay overwrote raises
        :class:`~torchreplay.StaleOutputError`.

    .. warning::
        Double backward (``create_graph=True``) and a second backward of one forward
        (``retain_graph=True``) raise :class:`~torchreplay.UnsupportedError`.

    .. warning::
        Hooks on the module itself run eagerly around every call. Hooks on its submodules run
        inside the graph: their tensor work replays, their Python side effects happened once,
        at capture (a warning says so).

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
    devices = [infer_device(fn, a, k) for fn, a, k in zip(fns, args_list, kwargs_list)]
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
    order = _Order()
    runners = [
        GraphedCallable(
            fn,
            a,
            k,
            device=device,
            config=cfg,
            order=order,
            allow_unused=allow_unused_input,
            verify=verify,
            tol=tol,
        )
        for fn, a, k in zip(fns, args_list, kwargs_list)
    ]
    _build(runners, device, the_pool, cfg)
    results: list[Any] = []
    for fn, r in zip(fns, runners):
        if isinstance(fn, torch.nn.Module):
            fn.forward = r  # type: ignore[method-assign]  # as torch's does
            results.append(fn)
        else:
            results.append(r)
    return results[0] if single else tuple(results)


def check_verify(verify: Any) -> int:
    """Validate ``verify=`` (an int >= 0) and return it."""
    if isinstance(verify, bool) or not isinstance(verify, int) or verify < 0:
        raise ValueError(
            f"verify must be an int >= 0 (how many first calls to compare with eager), got {verify!r}"
        )
    return verify


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
