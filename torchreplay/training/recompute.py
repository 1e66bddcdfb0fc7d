"""Backward passes the backward graph cannot serve, computed as eager autograd would.

The backward graph of :func:`torchreplay.make_graphed_callables` computes first-order gradients,
once per forward, from the activations that forward's replay left in the pool. Eager autograd
does more, and a drop-in must too:

- ``create_graph=True``: gradient penalties, physics-informed losses (a derivative of the
  output with respect to the input, differentiated again), meta-learning;
- a second backward through one forward (``loss_a.backward(retain_graph=True)``, then
  ``loss_b.backward()``: two losses of one output);
- a backward after another graph of the pool replayed over that forward's saved activations
  (backwards in another order than the capture's).

Torch's tool refuses the first (its node is ``once_differentiable``) and silently reads
overwritten memory in the other two. Here the node runs the callable's forward again, eagerly,
on the caller's tensors it saved at the call (``save_for_backward``: an argument changed in place
since, or a second backward without ``retain_graph``, raises autograd's own error, as eager), under
the call's autocast and at the call's place in the CUDA random stream (dropout draws the same
masks as the replay did), the state it writes put back afterwards (running statistics are not
updated twice), and differentiates that with ``torch.autograd.grad``, ``create_graph`` as
asked. This is what ``torch.utils.checkpoint`` does for a checkpointed segment; it costs one eager
forward and backward, so each graphed callable says it once per reason. A ``create_graph``
backward leaves the replay's activations where they are: the first-order backward that usually
follows (the loss's own, next to the penalty) still replays the backward graph.

What it cannot make equal: a forward that writes one of its tensor arguments, or reads a tensor
it wrote earlier in the same call (a running statistic used after its update, a step counter):
the recompute would start from what the call left there, so it raises, naming it. A forward
with ``torch.distributed`` collectives raises too: run again on one rank, they would hang the
others. Python state the forward changes changes again.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from torchreplay import _compat
from torchreplay._compat.rng import Position, default_generator, position
from torchreplay.errors import UnsupportedError

__all__ = ["CREATE_GRAPH", "SECOND", "CLOBBERED", "Recomputes", "recompute_backward", "rng_reader"]

log = logging.getLogger(__name__)

CREATE_GRAPH = "backward ran with create_graph=True (a higher-order gradient)"
SECOND = "a second backward through one forward (retain_graph=True)"
CLOBBERED = "another graph of its pool replayed over the activations its forward saved"

#: where the generators a forward draws from stood at its call: the device's default one (None:
#: it does not draw from it), then each explicit generator registered with its graph
RngPosition = tuple[Optional[Position], tuple[Position, ...]]


class Recomputes:
    """One graphed callable's recomputes: the reasons it has said (once each), and whether
    the next one runs under the state guard. The first does; when it found no tensor made
    before it written, the later ones (the same ops: the graph replays one path) do not, and
    pay no dispatch mode."""

    __slots__ = ("said", "guard")

    def __init__(self) -> None:
        self.said: set[str] = set()
        self.guard = True


def rng_reader(
    device: torch.device, default: bool = True, generators: Sequence[torch.Generator] = ()
) -> Callable[[], RngPosition] | None:
    """A reader of where the generators a forward draws from stand: ``device``'s default CUDA
    generator (``default``) and ``generators`` (explicit ones, registered with its graph: a
    graph's random ops draw from where each stands when it replays); None where there is
    nothing to read (a CPU build)."""
    gen = default_generator(device) if default else None
    if gen is None and not generators:
        return None
    gens = tuple(generators)

    def read() -> RngPosition:
        return (position(gen) if gen is not None else None), tuple(position(g) for g in gens)

    read.generators = gens  # type: ignore[attr-defined]
    return read


@contextlib.contextmanager
def _at_rng(device: torch.device, at: RngPosition | None, generators: Sequence[torch.Generator]) -> Iterator[None]:
    """Within the block the generators stand where they stood at the call; afterwards where
    they stand now."""
    if at is None:
        yield
        return
    index = device.index or 0
    now = [position(g) for g in generators]
    moved = list(zip(generators, at[1]))
    if at[0] is not None:
        moved.append((torch.cuda.default_generators[index], at[0]))
    with torch.random.fork_rng(devices=[index] if at[0] is not None else [], device_type="cuda"):
        try:
            for gen, (seed, offset) in moved:
                gen.manual_seed(seed)
                gen.set_offset(offset)
            yield
        finally:
            for gen, (seed, offset) in zip(generators, now):
                gen.manual_seed(seed)
                gen.set_offset(offset)


def recompute_backward(runner: Any, ctx: Any, grads: tuple[torch.Tensor | None, ...], why: str) -> list[Any]:
    """The gradients of ``runner``'s node (a GraphedCallable's) for ``grads``, through an eager
    run of its forward on what ``ctx`` saved at the call; ``create_graph`` when grad mode is on
    (autograd turns it on for a backward with ``create_graph=True``)."""
    saved = ctx.saved_tensors  # autograd's errors: freed (no retain_graph), changed in place
    if runner.collectives:  # (torch.distributed: the other ranks would not run them)
        raise UnsupportedError(
            f"'{runner.name}': {why}, which its backward graph cannot compute; the forward would "
            f"run again eagerly, but it holds collectives ({_names(runner.collectives)}), which "
            "this rank alone would call and the others would wait for: a hang. Call backward "
            "once per forward without create_graph on graphs with collectives"
        )
    if runner._inputs.written:
        raise UnsupportedError(
            f"'{runner.name}': {why}, which its backward graph cannot compute; the forward would "
            f"run again eagerly, but it writes its argument(s) {', '.join(runner.stats.written_inputs)}, "
            "so that run would start from the written values. Call backward once per forward "
            "without create_graph, or graph a callable that does not write its arguments"
        )
    if why not in runner._recompute.said:
        runner._recompute.said.add(why)
        log.warning(
            "torchreplay: '%s': %s; its backward graph cannot compute that, so this backward runs "
            "the forward again eagerly and differentiates it (as torch.utils.checkpoint does): "
            "correct, at the cost of an eager forward and backward (counted in stats.recomputed)",
            runner.name, why,
        )
    n = len(runner._tensor_idx)
    surface = runner._surface_t
    # Run again at each such backward, never kept for the next: the graph of a create_graph
    # backward's results leads into this run, and the backward that follows (of the penalty
    # and the loss together) frees it on its way, before or after it reaches this node again.
    runner.stats.recomputed += 1
    flat, ins = _forward_again(runner, saved, getattr(ctx, "tr_rng", None), why)
    pairs = [
        (flat[i], g) for i, g in zip(runner._diff_idx, grads)
        if g is not None and isinstance(flat[i], torch.Tensor) and flat[i].requires_grad
    ]
    needs = ctx.needs_input_grad  # after the runner and the outputs tuple: position + 2
    wanted = [p for p in range(n + len(surface)) if needs[p + 2]]
    result: list[Any] = [None] * (n + len(surface))
    if pairs and wanted:
        got = torch.autograd.grad(
            [o for o, _ in pairs],
            [ins[p] if p < n else surface[p - n] for p in wanted],
            [g for _, g in pairs],
            create_graph=torch.is_grad_enabled(),
            allow_unused=True,
        )
        for p, g in zip(wanted, got):
            result[p] = g
    return result


def _names(collectives: tuple[Any, ...]) -> str:
    names = [c.line() if hasattr(c, "line") else str(c) for c in collectives[:3]]
    return ", ".join(names) + (", ..." if len(collectives) > 3 else "")


def _forward_again(
    runner: Any, saved: tuple[torch.Tensor, ...], rng: RngPosition | None, why: str
) -> tuple[list[Any], list[torch.Tensor]]:
    """The forward's flat outputs, run eagerly, with autograd, as the call ran; and the
    tensors it ran on, one per saved argument, to differentiate with respect to.

    Those are aliases (``view_as``) of the caller's tensors that require grad: a gradient with
    respect to the alias takes only the paths through this call, where one with respect to the
    caller's tensor would also take its other uses (a break's output ``a = attn(h)`` passed
    next to ``h`` itself, whose path the break's own backward already takes), and what is
    computed with ``create_graph`` stays connected to the caller's tensor through the alias."""
    slots = runner._inputs.slots
    leaves = [s.value for s in slots]
    ins: list[torch.Tensor] = []
    with torch.enable_grad():
        for k, i in enumerate(runner._tensor_idx):
            t = saved[k]
            if t.requires_grad:
                t = t.view_as(t)
            ins.append(t)
            leaves[i] = t if t.dtype is slots[i].dtype else t.to(slots[i].dtype)  # widened: as copied in
    args, kwargs = _compat.tree_unflatten(leaves, runner._inputs.spec)
    autocast = runner._autocast
    state = runner._recompute
    guard = _StateGuard() if state.guard else None
    try:
        gens = getattr(runner._rng, "generators", ())
        with torch.enable_grad(), _at_rng(runner.device, rng, gens), torch.autocast(
            runner.device.type, dtype=autocast, enabled=autocast is not None
        ), guard if guard is not None else contextlib.nullcontext():
            out = runner._run_fn(*args, **kwargs)
    finally:
        if guard is not None:
            guard.restore()
    if guard is None:
        return _compat.tree_flatten(out)[0], ins
    state.guard = bool(guard.kept)
    if guard.read_back is not None:
        raise UnsupportedError(
            f"'{runner.name}': {why}, which its backward graph cannot compute, and its forward "
            f"cannot run again as the call ran it: it reads a tensor it wrote itself "
            f"({guard.read_back}), which holds what the call left there, not what the call "
            "read. Call backward once per forward without create_graph, or keep that state "
            "outside the graphed callable (update it after the call)"
        )
    return _compat.tree_flatten(out)[0], ins


class _StateGuard(_compat.LightDispatchMode):
    """Around a recompute: keeps the value of each tensor made before it that an op writes (a
    running statistic, a counter; a module's buffer or a tensor a segment of ``breaks=`` holds)
    and puts it back afterwards through ``.data``, so that the version autograd saved stays
    (the recompute's own backward may read it). :attr:`read_back` names a tensor that an op
    read (without writing it) after an earlier op wrote it: the recompute read the call's
    result there, not what the call read. Tensors made inside are the recompute's own."""

    def __init__(self) -> None:
        super().__init__()
        self._made: set[int] = set()
        self._dirty: set[int] = set()
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = set()
        self.read_back: str | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        written = _compat.written_tensors(func, args, kwargs)
        if self._dirty and self.read_back is None:
            writes = {_storage(t) for t in written}
            for a in _compat.tree_flatten((args, kwargs))[0]:
                if isinstance(a, torch.Tensor):
                    ptr = _storage(a)
                    if ptr in self._dirty and ptr not in writes:
                        self.read_back = f"{tuple(a.shape)} {a.dtype}, read by {func}"
        for t in written:
            ptr = _storage(t)
            if ptr is None:  # (no storage of its own to keep: a sparse or a wrapper tensor)
                continue
            key = (ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()))
            if ptr not in self._made and key not in self._seen:
                self._seen.add(key)
                self._dirty.add(ptr)
                self.kept.append((t, t.detach().clone()))
        out = func(*args, **kwargs)
        if _compat.returns_fresh(func):
            for o in _compat.tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor) and (ptr := _storage(o)) is not None:
                    self._made.add(ptr)
        return out

    def restore(self) -> None:
        with torch.no_grad():
            for t, value in reversed(self.kept):
                t.data.copy_(value)


def _storage(t: torch.Tensor) -> int | None:
    """Where a dense tensor's storage starts; None for one without a plain storage."""
    if t.layout is not torch.strided or t.device.type == "meta":
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
