"""What capture hands to replay in training: one callable's captured forward/backward
(:class:`Pair`), its entries in the pool's capture order (:class:`Member`), the backward order
shared by callables of one pool (:class:`Order`), and the gradients its backward hands to
autograd (:class:`InputGrads`)."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable

import torch

from torchreplay import _compat
from torchreplay.core.reads import StateReads
from torchreplay.core.outputs import Outputs

__all__ = [
    "InputGrads", "Member", "Order", "Pair", "capturing", "next_sequence_nr", "output_reach", "retire_pair",
    "unreached",
]


class Member:
    """A graph's entry in its pool's capture order (named, for ordering messages)."""

    __slots__ = ("name", "_invalidate", "__weakref__")  # the pool holds its members weakly

    def __init__(self, name: str, invalidate: Callable[[], None] | None = None) -> None:
        self.name = name
        self._invalidate = invalidate

    def invalidate_outputs(self) -> None:
        if self._invalidate is not None:
            self._invalidate()


class Order:
    """The last backward sequence number given out among callables sharing one pool."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last = -1


class InputGrads:
    """The gradients a backward graph hands to autograd, one per input that needs one.

    - A parameter (or other captured leaf) whose ``.grad`` exists gets the static buffer:
      ``AccumulateGrad`` adds it in place, and since we keep a reference it never takes the
      buffer as its own.
    - A parameter whose ``.grad`` is None, and a leaf input, get their own copy (one
      multi-tensor launch for all): ``AccumulateGrad`` would keep the buffer as ``.grad``, and
      ``torch.autograd.grad(loss, x)`` hands a leaf's gradient to the caller as it is; the next
      backward would overwrite either.
    - A non-leaf input (the previous layer's output) gets it under the callable's output
      policy. The layer before reads it within the same backward, so under ``"checked"`` no
      copy is made: a tensor over the buffer, as a forward's output is. If
      ``torch.autograd.grad(loss, h)`` or a hook on ``h`` hands it to the caller, a later replay
      that overwrites it marks it stale (a read raises :class:`~torchreplay.StaleOutputError`)
      instead of leaving the later call's values in it. A tensor nobody kept is handed out
      again. ``"clone"`` gives a copy; ``"static"`` the buffer itself (as torch's tool does).
    """

    __slots__ = ("name", "on_live", "_by_pos")

    def __init__(self, name: str) -> None:
        self.name = name
        self.on_live: Callable[[], None] | None = None  # the pool's, once registered
        self._by_pos: dict[int, Outputs] = {}

    def emit(self, pos: int, static: torch.Tensor, policy: str) -> torch.Tensor:
        """This backward's gradient for input ``pos``, whose buffer is ``static``."""
        if policy == "static":
            return static
        if policy == "clone":
            return static.clone()
        out = self._by_pos.get(pos)
        if out is None:
            out = Outputs(static, "checked", self.name, _owned, reuse=True)
            out.on_live = self.on_live
            self._by_pos[pos] = out
        return out.emit()  # type: ignore[no-any-return]

    def hand(
        self,
        ctx: Any,
        statics: list[torch.Tensor | None],
        grad_pos: list[int],
        n_inputs: int,
        surface: tuple[torch.Tensor, ...],
        policy: str,
        skip: frozenset[int] = frozenset(),
    ) -> list[Any]:
        """The backward's results for autograd: ``statics[k]`` is the gradient buffer of
        position ``grad_pos[k]``, which counts the ``n_inputs`` tensor inputs, then ``surface``
        (the parameters and other leaves the callable differentiates into). Each ``k`` in
        ``skip`` gets None, as eagerly: no output with a gradient reaches it (the graph
        computed zeros)."""
        result: list[Any] = [None] * (n_inputs + len(surface))
        needs = ctx.needs_input_grad  # after the runner and the outputs tuple: pos + 2
        fresh_pos: list[int] = []
        fresh_src: list[torch.Tensor] = []
        edges = None
        if skip:  # (rare: a loss that leaves an output unused; no cost per gradient otherwise)
            statics = [None if k in skip else static for k, static in enumerate(statics)]
        for static, pos in zip(statics, grad_pos):
            if static is None or not needs[pos + 2]:
                continue
            if pos < n_inputs:
                if edges is None:
                    edges = ctx.next_functions  # one per tensor input: no runner, no outputs
                if not _compat.is_accumulate_grad(edges[pos][0]):  # a non-leaf input
                    result[pos] = self.emit(pos, static, policy)
                    continue
            elif surface[pos - n_inputs].grad is not None:
                result[pos] = static
                continue
            fresh_pos.append(pos)
            fresh_src.append(static)
        if fresh_src:
            for pos, t in zip(fresh_pos, _compat.foreach_clone(fresh_src)):
                result[pos] = t
        return result

    def invalidate(self) -> None:
        """Another graph of the pool replayed over this memory: what was handed out is stale."""
        for out in self._by_pos.values():
            out.invalidate()

    def retire(self) -> None:
        """The callable is gone and its memory given back: what was handed out raises."""
        for out in self._by_pos.values():
            out.retire()
        self._by_pos = {}


def _owned(t: torch.Tensor) -> bool:
    return True


@dataclasses.dataclass
class Pair:
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
        collectives, collective_log: the ``torch.distributed`` collectives of the forward and
            then the backward, and the forward's log (it holds their groups).
        input_grads: the gradients the backward hands to autograd (retired with the pair).
        reads: the tensors in Python state the forward reads (core/effects.py), checked by
            identity at every call; None: none.
        copies, spares: the forward graph's own copies of the tensor arguments (its first
            nodes, pointed at a call's tensors: _compat/copy_nodes.py), and what they need kept.
        bwd_copies, bwd_spares: the same for the backward graph's incoming gradients.
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
    written: tuple[int, ...] = ()
    collectives: tuple[Any, ...] = ()
    collective_log: Any = None
    input_grads: InputGrads | None = None  # set when the callable adopts the pair
    reads: StateReads | None = None
    generators: tuple[torch.Generator, ...] = ()  # explicit ones the forward draws from
    # The forward's own copies into its static inputs (core/capture.py ``copy_in``), and the
    # buffers a copy not found writes at every replay (kept as long as the graph).
    copies: tuple[Any, ...] = ()
    spares: tuple[torch.Tensor, ...] = ()
    # The backward's own copies of the incoming gradients into ``static_grad_outputs`` (one per
    # buffer, or none), and what a copy not found needs kept.
    bwd_copies: tuple[Any, ...] = ()
    bwd_spares: tuple[torch.Tensor, ...] = ()
    # Per static_grad_inputs entry, the outputs whose autograd graph reaches it (a bit mask,
    # output_reach); empty with one differentiable output.
    reach: tuple[int, ...] = ()


def capturing() -> bool:
    """Is the current CUDA stream capturing? (False without CUDA, where torch's check raises.)"""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def retire_pair(outputs: Outputs, pair: Pair) -> Callable[[], None]:
    """What runs when a graphed callable is destroyed: handed-out outputs raise when read, and
    the capture's tensors in the pool are dropped so its memory can go back. A closure over
    the outputs and a weak reference to the pair only (the pool's finalizer holds it): a bound
    method would keep the callable alive forever, and so did the pair, whose record of the
    Python state the forward reads can hold the model's ``__dict__`` (a plain tensor
    attribute), which holds the callable as its ``forward``. (A pair already gone, freed in
    one collection with its callable, holds nothing any more.)"""
    held = weakref.ref(pair)

    def retire() -> None:
        outputs.retire()
        pair = held()
        if pair is None:
            return
        if pair.input_grads is not None:
            pair.input_grads.retire()
        pair.leaves = []
        pair.static_grad_inputs = []

    return retire


def output_reach(outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> tuple[int, ...]:
    """For each of ``inputs`` (the leaves a backward differentiates into), the bit mask of the
    ``outputs`` whose autograd graph reaches it (bit ``j``: ``outputs[j]``), read from the
    graph the capture recorded. Eagerly a backward whose loss leaves an output unused gives no
    gradient (``.grad`` stays None) to what only that output reaches; the backward graph
    computes zeros for it, which :func:`unreached` tells apart. Empty with one output."""
    if len(outputs) < 2:
        return ()
    roots: dict[int, int] = {}  # id(node) -> outputs starting there
    nodes: dict[int, Any] = {}
    for j, o in enumerate(outputs):
        if o.grad_fn is not None:
            roots[id(o.grad_fn)] = roots.get(id(o.grad_fn), 0) | (1 << j)
            nodes[id(o.grad_fn)] = o.grad_fn
    # Every node reached, and how many reached nodes point at each (Kahn's order below).
    indegree: dict[int, int] = dict.fromkeys(nodes, 0)
    stack = list(nodes.values())
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if id(nxt) not in nodes:
                nodes[id(nxt)] = nxt
                indegree[id(nxt)] = 0
                stack.append(nxt)
            indegree[id(nxt)] += 1
    mask = dict(roots)
    ready = [n for k, n in nodes.items() if not indegree[k]]
    leaves: dict[int, int] = {}  # id(leaf tensor) -> mask
    while ready:
        node = ready.pop()
        m = mask.get(id(node), 0)
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if variable is not None:
            leaves[id(variable)] = leaves.get(id(variable), 0) | m
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            mask[id(nxt)] = mask.get(id(nxt), 0) | m
            indegree[id(nxt)] -= 1
            if not indegree[id(nxt)]:
                ready.append(nxt)
    return tuple(leaves.get(id(t), 0) for t in inputs)


def unreached(
    reach: tuple[int, ...], grads: tuple[Any, ...], seen: dict[int, frozenset[int]]
) -> frozenset[int]:
    """The indices into ``reach`` (:func:`output_reach`) that none of the outputs with a
    gradient in ``grads`` (None: unused by the loss) reaches: eagerly they get no gradient.
    ``seen``: the caller's answers so far, by which outputs have a gradient (a backward of
    many parameters asks again at every step)."""
    if not reach:
        return _NONE
    present = 0
    for j, g in enumerate(grads):
        if g is not None:
            present |= 1 << j
    known = seen.get(present)
    if known is None:
        known = seen[present] = frozenset(k for k, m in enumerate(reach) if not m & present)
    return known


_NONE: frozenset[int] = frozenset()


def next_sequence_nr() -> int:
    """The sequence number that autograd's next node on this thread will exceed."""
    probe = torch.empty((), device="cpu", requires_grad=True).clone()
    return _compat.sequence_nr(probe.grad_fn)
