"""What training with breaks records of a model's run (:mod:`.program`): values by number
(:class:`Ref`), the caller's leaves taken at each call (:class:`Rebound`), the ops between two
breaks (:class:`Op`, :class:`Segment`, which runs them again as a function), the break calls
(:class:`Call`) and the whole run (:class:`Program`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from torchreplay import _compat
from torchreplay.breaks.plan import Break

__all__ = ["Ref", "Rebound", "Op", "Segment", "Call", "Program"]


@dataclasses.dataclass(frozen=True)
class Ref:
    """A value of the recorded run, by its number."""

    i: int


@dataclasses.dataclass(frozen=True)
class Rebound:
    """A caller's non-tensor argument leaf, taken from each call (a break's host lengths)."""

    leaf: int


@dataclasses.dataclass
class Op:
    """One aten op: its flat arguments (values as :class:`Ref`), their structure, the grad
    mode it ran under, and the numbers of the tensors it returned (None for other leaves, and
    for a constant it wrote in place and returned)."""

    func: Any
    flat: list[Any]
    spec: Any
    grad: bool
    outs: list[int | None]
    where: str = ""  # the user's line, kept for ops run with autograd off (for errors)
    effect: bool = True  # writes a tensor or draws random numbers: kept even if nothing reads it
    writes: tuple[int, ...] = ()  # the values it writes in place


@dataclasses.dataclass
class Segment:
    """The ops between two breaks; ``inputs``: the values they read from outside, ``outputs``:
    the values they make that later steps read."""

    index: int
    ops: list[Op] = dataclasses.field(default_factory=list)
    inputs: list[int] = dataclasses.field(default_factory=list)
    outputs: list[int] = dataclasses.field(default_factory=list)
    name: str = ""
    #: inputs it writes in place, made by an earlier step: written on a copy (a graph's input
    #: is a leaf, which autograd does not let an in-place op change), which it then returns
    copied: list[int] = dataclasses.field(default_factory=list)

    def function(self) -> Callable[..., tuple[Any, ...]]:
        """The segment as a function of its inputs: its ops run again, through autograd."""
        ops, inputs, outputs, copied = self.ops, self.inputs, self.outputs, self.copied

        def segment(*xs: Any) -> tuple[Any, ...]:
            env = dict(zip(inputs, xs))
            for v in copied:
                env[v] = env[v].clone()
            grad = torch.is_grad_enabled()
            try:
                for op in ops:
                    flat = [env[x.i] if type(x) is Ref else x for x in op.flat]
                    a, k = _compat.tree_unflatten(flat, op.spec)
                    if op.grad != torch.is_grad_enabled():
                        torch.set_grad_enabled(op.grad and grad)
                    out = op.func(*a, **k)
                    for vid, o in zip(op.outs, _compat.tree_flatten(out)[0]):
                        if vid is not None:
                            env[vid] = o
            finally:
                torch.set_grad_enabled(grad)
            return tuple(env[i] for i in outputs)

        segment.__qualname__ = self.name
        return segment


@dataclasses.dataclass
class Call:
    """One break call: what runs it, its argument leaves (:class:`Ref`, :class:`Rebound` or a
    constant), and the values it returned, with their shape, dtype and device then."""

    brk: Break
    call: Callable[..., Any]
    flat: list[Any]
    spec: Any
    outs: list[int | None]
    out_spec: Any
    meta: list[tuple[Any, ...]]  # (shape, dtype, device) of a tensor, ("value", v) of another leaf
    where: str


@dataclasses.dataclass
class Program:
    """The recorded run: its steps in order, how the caller's leaves map to values, which
    non-tensor leaves must equal the sample's, and the model's output."""

    steps: list[Segment | Call]
    inputs: dict[int, int]  # caller leaf -> value
    guarded: dict[int, Any]  # caller leaf -> the sample's non-tensor value
    paths: list[str]
    spec: Any
    out_flat: list[Any]
    out_spec: Any
    n_values: int
    samples: dict[int, Any]  # value -> the run's tensor (the segments' sample inputs)
    branches: list[str] = dataclasses.field(default_factory=list)  # host bools read between breaks
    #: saved-tensor hooks active between breaks (checkpointing, offloading): (pack hook, line)
    saved_hooks: tuple[str, str] | None = None
    #: caller leaf -> the sample's CUDA generator there (an input, taken from each call)
    generators: dict[int, torch.Generator] = dataclasses.field(default_factory=dict)

    @property
    def segments(self) -> list[Segment]:
        return [s for s in self.steps if isinstance(s, Segment)]
