"""What capture hands to replay in training: one callable's captured forward/backward
(:class:`Pair`), its entries in the pool's capture order (:class:`Member`), and the backward order
shared by callables of one pool (:class:`Order`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from torchreplay import _compat
from torchreplay.core.outputs import Outputs

__all__ = ["Member", "Order", "Pair", "capturing", "next_sequence_nr", "retire_pair"]


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


def capturing() -> bool:
    """Is the current CUDA stream capturing? (False without CUDA, where torch's check raises.)"""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def retire_pair(outputs: Outputs, pair: Pair) -> Callable[[], None]:
    """What runs when a graphed callable is destroyed: handed-out outputs raise when read, and
    the capture's tensors in the pool are dropped so its memory can go back. A closure over
    these two objects only: a bound method would keep the callable alive forever."""

    def retire() -> None:
        outputs.retire()
        pair.leaves = []
        pair.static_grad_inputs = []

    return retire


def next_sequence_nr() -> int:
    """The sequence number that autograd's next node on this thread will exceed."""
    probe = torch.empty((), device="cpu", requires_grad=True).clone()
    return _compat.sequence_nr(probe.grad_fn)
