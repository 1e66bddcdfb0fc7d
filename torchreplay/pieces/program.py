"""What the piecewise runtime runs: a :class:`Program` of pieces over numbered value slots.

Slots ``0 .. len(inputs)-1`` hold the call's flat inputs; every piece reads some slots and writes
new ones, in order. A piece is either *graphed* (captured as a CUDA graph per size) or *eager*
(run as is every call, with the :class:`Split` that says why). Pure data: nothing here touches a
device, so the split of a model can be checked on the CPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal, Sequence

__all__ = ["Input", "Split", "Piece", "Constant", "Program", "run_in_order"]

InputKind = Literal["tensor", "static", "pinned", "int", "other", "host"]


@dataclasses.dataclass(frozen=True)
class Input:
    """One flat input of the program.

    Args:
        name: for messages and the explain report (``"x"``, ``"self.fc.weight"``).
        kind: ``"tensor"``: an argument, copied into a static buffer each call;
            ``"static"``: a parameter or buffer, read in place (its address must not change;
            if it does, the runtime captures again);
            ``"pinned"``: read in place where it was at capture (a backward's saved activation,
            left in the forward graph's pool); a call where it is elsewhere runs ungraphed;
            ``"int"``: a Python int (a size); ``"other"``: any other constant (part of the
            key: another value is another capture);
            ``"host"``: a value only eager steps read (a break's host-side sequence lengths),
            taken from each call as it is, never part of the key.
        dim: for a tensor: the dimension padded to a captured size, or ``None``.
        is_size: for an int: it is the padded size itself (replaced by the captured size).
        written: for a tensor: the program writes it in place; the runtime copies the written
            rows back into the caller's tensor after each replay (eager semantics).
        fill: for a tensor with ``dim``: the value of the padding rows.
    """

    name: str
    kind: InputKind
    dim: int | None = None
    is_size: bool = False
    written: bool = False
    fill: int | float | bool = 0


@dataclasses.dataclass(frozen=True)
class Split:
    """Why a piece runs eagerly: the op, the reason, the user's ``file:line`` and the fix."""

    op: str
    reason: str
    where: str = ""
    fix: str = ""

    def __str__(self) -> str:
        at = f" at {self.where}" if self.where else ""
        return f"{self.op}{at}: {self.reason}"


@dataclasses.dataclass
class Piece:
    """One step of a program.

    Args:
        fn: called with the values of ``reads`` (positionally); returns a sequence with one value
            per slot in ``writes``.
        reads, writes: slot numbers.
        graphed: captured as a CUDA graph (else run eagerly every call).
        name: ``"piece 0"``, shown in the report.
        split: for an eager piece, why it is not captured.
        nodes: how many FX nodes (or ops) the piece holds, for the report.
        written: the positions in ``reads`` whose tensors the piece writes in place (a KV
            cache's length counter that an eager step made): put back before each warm-up run,
            and, for a value an eager step made, copied back from the graph's own buffer after
            each replay.
        replay_fn: for an eager piece, what replays call instead of ``fn``, with the same
            results (a custom op's kernel called without the dispatcher: ``pieces/direct.py``);
            capture, warm-up and ungraphed runs call ``fn``.
    """

    fn: Callable[..., Sequence[Any]]
    reads: tuple[int, ...]
    writes: tuple[int, ...]
    graphed: bool
    name: str
    split: Split | None = None
    nodes: int = 0
    written: tuple[int, ...] = ()
    replay_fn: Callable[..., Sequence[Any]] | None = None


@dataclasses.dataclass(frozen=True)
class Constant:
    """A program output that is not a slot: a constant returned as is."""

    value: Any


@dataclasses.dataclass
class Program:
    """Pieces over slots, and which slots (or constants) the call returns.

    Args:
        inputs: the flat inputs, in call order.
        pieces: the steps, in order.
        outputs: per output, a slot number or a :class:`Constant`.
        output_dims: per output, the dimension that has the padded size (sliced back to the
            call's rows), or ``None``.
    """

    inputs: tuple[Input, ...]
    pieces: list[Piece]
    outputs: tuple[int | Constant, ...]
    output_dims: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        if not self.output_dims:
            self.output_dims = (None,) * len(self.outputs)
        defined = set(range(len(self.inputs)))
        for piece in self.pieces:
            missing = [r for r in piece.reads if r not in defined]
            assert not missing, f"{piece.name} reads slots {missing} before they are written"
            defined.update(piece.writes)
        assert all(isinstance(o, Constant) or o in defined for o in self.outputs)

    @property
    def n_slots(self) -> int:
        return len(self.inputs) + sum(len(p.writes) for p in self.pieces)

    def last_reads(self) -> list[tuple[int, ...]]:
        """Per piece, the slots it is the last to read (dropped after it runs, so their memory
        can be used again), outputs and inputs left out."""
        keep = {o for o in self.outputs if isinstance(o, int)} | set(range(len(self.inputs)))
        last: dict[int, int] = {}
        for i, piece in enumerate(self.pieces):
            for r in piece.reads:
                last[r] = i
        per: list[list[int]] = [[] for _ in self.pieces]
        for slot, i in last.items():
            if slot not in keep:
                per[i].append(slot)
        return [tuple(sorted(p)) for p in per]

    def producers(self) -> dict[int, int]:
        """Slot -> index of the piece that writes it (inputs are not in it)."""
        return {w: i for i, p in enumerate(self.pieces) for w in p.writes}


def run_in_order(
    program: Program, args: Sequence[Any], last: Sequence[Sequence[int]] | None = None
) -> tuple[Any, ...]:
    """Run every piece of ``program`` as is on ``args`` (no graph, no copies); return the
    outputs. ``last``: :meth:`Program.last_reads`, to drop each value after its last reader."""
    if last is None:
        last = program.last_reads()
    env: list[Any] = list(args) + [None] * (program.n_slots - len(args))
    for k, piece in enumerate(program.pieces):
        outs = piece.fn(*[env[r] for r in piece.reads])
        for w, t in zip(piece.writes, outs):
            env[w] = t
        for f in last[k]:
            env[f] = None
    return tuple(o.value if isinstance(o, Constant) else env[o] for o in program.outputs)
