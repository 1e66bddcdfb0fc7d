"""The CUDA generators a callable draws random numbers from: registered with its graphs, put back
after a build, and a call that re-seeds one inside itself refused.

Eagerly ``torch.randn(..., generator=g)`` draws from where ``g`` stands and moves it on, at every
call. A replay does the same only for a generator registered with the graph before its capture
(``CUDAGraph.register_generator_state``): at each replay torch reads its seed and offset, and
moves it on by what the capture drew. Torch registers the device's default generator by itself;
any other one (a sampler's per-request generator, diffusers' ``generator=``, an RNG tracker's)
made the capture fail ("Attempt to increase offset for a CUDA generator not in capture mode").

A graph's draws are placed relative to where the generator stands at the replay. So it replays
what eager does only if every call draws from where the generator stands, the same amounts in the
same order. A call that seeds the generator inside itself (``torch.manual_seed(0)`` or
``g.manual_seed(0)`` in the callable, a generator made at every call) draws the same numbers at
every eager call, but different ones at every replay, silently. The warm-ups show it: such a
call draws from another place, relative to where it started, than the call before it did.

:class:`Draws` watches the build's eager calls with a dispatch mode (it sees the generator each op
is given, and reads where the default generator stands before each op), and keeps where each
generator stood when the build first drew from it. Which generators a callable draws from is
remembered by callable (:func:`remembered`), for its captures without a warm-up (later sizes).
"""

from __future__ import annotations

import contextlib
import random
import sys
import weakref
from typing import Any, Iterator, Sequence

import torch

from torchreplay import _compat
from torchreplay._compat.rng import (
    Position, can_register_generators, default_generator, is_default, position, same_device, same_generator,
)
from torchreplay.errors import CaptureError, ReplayInputError

__all__ = [
    "Draws", "HOST_GENERATORS", "HostDraws", "bind", "check_pairs", "fits", "hand_back", "host_draws_warning",
    "not_fitting", "pairs", "per_call", "remember",
    "remembered", "stand_in", "stand_ins",
]

#: The fix that every message here gives.
SEED_OUTSIDE = (
    "Seed it outside the graphed call (torch.manual_seed(...) or g.manual_seed(...) before a call, "
    "or g.set_state(...)): a graph reads the generator's seed and offset at every replay, and its "
    "replays then draw what eager calls draw"
)


#: How far :meth:`Draws._shift` moves a generator (philox offsets move in steps of four)
SHIFT = 1 << 20


class _Call:
    """What one watched call drew: where the default generator stood before each op at which it
    had moved (op index, position), and each op given an explicit CUDA generator (the generator,
    where it stood before the op, the op)."""

    __slots__ = ("ops", "start", "last", "moves", "explicit", "end", "groups", "starts")

    def __init__(self, start: Position | None, starts: list[tuple[torch.Generator, Position]] | None = None) -> None:
        self.ops = 0
        self.start = self.last = start
        #: the explicit generators known before the call (found by an earlier one), where each stood
        self.starts = starts or []
        self.moves: list[tuple[int, Position]] = []
        self.explicit: list[tuple[torch.Generator, Position, Any]] = []
        self.end: Position | None = None
        #: the explicit generators, each once, in the order first drawn from, with their draws
        self.groups: list[tuple[torch.Generator, list[tuple[Position, Any]], Position]] = []


class _Watch(_compat.LightDispatchMode):
    """Notes, per op, where the default generator stands (when it moved) and the generator the
    op is given; changes nothing."""

    def __init__(self, call: _Call, default: torch.Generator | None) -> None:
        super().__init__()
        self.call = call
        self.default = default

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        call = self.call
        if self.default is not None:
            pos = position(self.default)
            if pos != call.last:
                call.moves.append((call.ops, pos))
                call.last = pos
        gen = kwargs.get("generator")
        if isinstance(gen, torch.Generator) and gen.device.type == "cuda":
            call.explicit.append((gen, position(gen), func))
        call.ops += 1
        return func(*args, **kwargs)


class Draws:
    """The generators the watched calls of one build drew from (:meth:`watch`), where each stood
    when the build first drew from it (:meth:`put_back`), and whether the compared calls drew as
    a graph can replay (:meth:`verdict`)."""

    def __init__(self, device: torch.device) -> None:
        self._default = default_generator(device)
        self._calls: list[_Call] = []  # the compared calls (warm-ups of the same arguments)
        self._first: list[tuple[torch.Generator, Position]] = []
        #: the explicit CUDA generators drawn from (not a default one), each once
        self.generators: list[torch.Generator] = []

    @property
    def explicit(self) -> bool:
        """Did a watched call draw from an explicit generator?"""
        return bool(self._first)

    @contextlib.contextmanager
    def watch(self, compare: bool = True) -> Iterator[None]:
        """Watch one eager call; ``compare``: it is one of the calls :meth:`verdict` compares
        (the warm-ups: the same arguments each time; not a call at another size)."""
        call = self.begin(compare)
        with _Watch(call, self._default):
            yield
        self.record(call, compare)

    def begin(self, compare: bool = True) -> _Call:
        """The record of a call about to run (:meth:`watch` makes it, before the call)."""
        default = self._default
        if compare and self._calls:  # (see _shift)
            self._shift()
        return _Call(position(default) if default is not None else None, [(g, position(g)) for g in self.generators])

    def record(self, call: _Call, compare: bool = True) -> None:
        """Take in what a watched call drew (:meth:`watch` does, after the call)."""
        if self._default is not None:
            call.end = position(self._default)
        self._group(call)
        if compare:
            self._calls = [*self._calls[-1:], call]

    def _group(self, call: _Call) -> None:
        groups: dict[int, int] = {}  # entry's generator, by id, to its group
        for gen, pos, func in call.explicit:
            k = groups.get(id(gen))
            if k is None:
                k = next((j for j, g in enumerate(call.groups) if same_generator(gen, g[0])), None)
                if k is None:
                    call.groups.append((gen, [], position(gen)))
                    k = len(call.groups) - 1
                groups[id(gen)] = k
            call.groups[k][1].append((pos, func))
        default = self._default
        for gen, draws, _ in call.groups:
            if default is not None and same_generator(gen, default):
                continue  # (``generator=torch.cuda.default_generators[i]``: torch registers it)
            if not any(same_generator(gen, g) for g, _ in self._first):
                self._first.append((gen, draws[0][0]))
            if not any(same_generator(gen, g) for g in self.generators):
                self.generators.append(gen)

    def _shift(self) -> None:
        """Move every generator known on by :data:`SHIFT` before the second compared call. A
        build may put the generators back before each warm-up (a breakable graph's does), so
        that a call which seeds one inside itself would draw from the same place relative to
        its start as a call that draws from where the generator stands; from another start,
        the first draws from the same place as before, the second from another one."""
        for gen in ([self._default] if self._default is not None else []) + self.generators:
            seed, offset = position(gen)
            gen.set_offset(offset + SHIFT)

    def keep(self, gens: Sequence[Any]) -> None:
        """Put ``gens`` back too, where they stand now, though no watched call finds them: the
        generators an earlier build found, for a capture without warm-ups (a breakable one
        replays its segments for real: a size captured at its first call, which then draws
        from where it began), and generator arguments, for runs that are not watched."""
        for gen in gens:  # (any leaves: the CUDA generators among them)
            if per_call(gen) and not any(same_generator(gen, g) for g, _ in self._first):
                self._first.append((gen, position(gen)))

    def put_back(self) -> None:
        """Put each explicit generator back where the build first drew from it."""
        for gen, (seed, offset) in self._first:
            gen.manual_seed(seed)
            gen.set_offset(offset)

    def verdict(self, name: str) -> CaptureError | None:
        """The error for the last two compared calls, if they drew from a generator other than
        as a replay would: seeded inside the call, or made at every call."""
        if self.generators and not can_register_generators():
            return CaptureError(
                f"'{name}' draws from a torch.Generator of its own ({_op(self._calls, 0)}); this "
                "torch cannot register one with a graph (torch >= 2.4 can). Use the default "
                "generator inside the graphed function, or upgrade torch"
            )
        calls = self._calls
        for call in calls:
            for _, pos in call.moves:
                if call.start is not None and pos[0] != call.start[0]:
                    return _reseeded(name, "the default CUDA generator", None)
        if len(calls) < 2:
            return None
        a, b = calls
        if a.ops == b.ops and a.start is not None and b.start is not None and a.end is not None and b.end is not None:
            if _relative(a.moves, a.start) != _relative(b.moves, b.start) or (
                a.end[1] - a.start[1] != b.end[1] - b.start[1]
            ):
                return _reseeded(name, "the default CUDA generator", None)
        if len(a.groups) != len(b.groups):
            return None  # (drawn from on one call only: nothing to compare)
        for (ga, da, ea), (gb, db, _) in zip(a.groups, b.groups):
            op = da[0][1]
            if not same_generator(ga, gb):
                return CaptureError(
                    f"'{name}' draws from a torch.Generator that it makes at every call (at "
                    f"{_opname(op)}): a graph can only draw from a generator that outlives the "
                    "call, registered with it at capture. Make the generator once, outside the "
                    "call, and pass it in or keep it on the module. " + SEED_OUTSIDE
                )
            # Only its own draws move an explicit generator: a call drawing as a replay does
            # draws first from where it stood at the call (known for the second: found by the
            # first), and on from there, the same amounts as the call before.
            start = next((pos for g, pos in b.starts if same_generator(g, gb)), None)
            seeds = {p[0] for p, _ in da} | {p[0] for p, _ in db}
            # (a call that draws more than the next, a first call's set-up: only its start told)
            same = len(da) != len(db) or [p[1] - da[0][0][1] for p, _ in da] == [p[1] - db[0][0][1] for p, _ in db]
            if not (same and len(seeds) == 1 and (start is None or db[0][0] == start)):
                return _reseeded(name, "a torch.Generator it draws from", op)
        return None


def _relative(moves: list[tuple[int, Position]], start: Position) -> list[tuple[int, int]]:
    return [(i, pos[1] - start[1]) for i, pos in moves]


def _opname(func: Any) -> str:
    return str(func).removeprefix("aten.") if func is not None else "an op"


def _op(calls: list[_Call], k: int) -> str:
    for call in calls:
        if len(call.groups) > k:
            return _opname(call.groups[k][1][0][1])
    return "an op"


def _reseeded(name: str, what: str, op: Any) -> CaptureError:
    at = f" (at {_opname(op)})" if op is not None else ""
    return CaptureError(
        f"'{name}' sets the state of {what} inside the call{at}: its warm-up calls drew from "
        "the same place, whatever the place the generator stood at the call. Eagerly every call "
        "then draws the same numbers; a graph's replays would draw on from where the last one "
        "stopped, silently different. " + SEED_OUTSIDE
    )


# Which explicit generators each callable's last watched build drew from, for its captures that
# have no warm-up (later sizes, pieces); by the callable, weakly (its owner for a bound method).
_REMEMBERED: weakref.WeakKeyDictionary[Any, tuple[torch.Generator, ...]] = weakref.WeakKeyDictionary()


def _key(fn: Any) -> Any:
    owner = getattr(fn, "__self__", None)
    return fn if owner is None else owner


def remember(fn: Any, generators: list[torch.Generator]) -> None:
    with contextlib.suppress(TypeError):  # (not weakly referable: its later captures find none)
        _REMEMBERED[_key(fn)] = tuple(generators)


def remembered(fn: Any) -> tuple[torch.Generator, ...] | None:
    """The generators ``fn``'s last watched warm-ups drew from; None if it was never watched."""
    try:
        return _REMEMBERED.get(_key(fn))
    except TypeError:
        return None


# -- the host's generators, drawn from inside a capture ----------------------------------------
#
# A graph replays device work only. A number drawn on the host while the call is captured (HF's
# LayerDrop: ``if torch.rand([]) < self.layerdrop: skip``; ``random.random()``) is drawn once,
# and what the call made of it, a branch or a value copied to the device, is replayed at every
# call; eagerly each call draws anew, and the host's generator moves on.

#: the host's generators :class:`HostDraws` watches, by the name its warning gives
HOST_GENERATORS = ("torch's CPU generator", "Python's random module", "NumPy's global generator")


def _host_states(python: bool) -> tuple[Any, ...]:
    if not python:
        return (torch.get_rng_state(),)
    numpy = sys.modules.get("numpy")  # (only when imported: never imported for this)
    state = numpy.random.get_state() if numpy is not None else None
    return (
        torch.get_rng_state(),
        random.getstate(),
        None if state is None else (state[1].tobytes(), state[2:]),
    )


class HostDraws:
    """Which host generators the captured stretches drew from (:attr:`moved`, names from
    :data:`HOST_GENERATORS`): :meth:`start` before a stretch, :meth:`stop` after it (a
    breakable graph's breaks run between stretches, eagerly at every call: theirs do not count).

    Torch's CPU generator costs about 6 us a stretch (host, measured on this project's CPU
    machine); Python's and NumPy's about 25 and 65 us more (``random.getstate()`` builds a
    625-tuple, NumPy's ``get_state()`` copies its key), so ``python=False`` leaves them out:
    a breakable graph's captures, hundreds of stretches a build."""

    __slots__ = ("_at", "_python", "moved")

    def __init__(self, python: bool = True) -> None:
        self._at: tuple[Any, ...] | None = None
        self._python = python
        self.moved: list[str] = []

    def start(self) -> None:
        self._at = _host_states(self._python)

    def stop(self) -> None:
        if self._at is None:
            return
        for name, before, now in zip(HOST_GENERATORS, self._at, _host_states(self._python)):
            same = torch.equal(before, now) if isinstance(before, torch.Tensor) else before == now
            if not same and name not in self.moved:
                self.moved.append(name)
        self._at = None


def host_draws_warning(name: str, moved: Sequence[str]) -> str:
    """What a graph of ``name`` does with the host's numbers its capture drew."""
    return (
        f"torchreplay: '{name}' drew random numbers on the host while it was captured (from "
        f"{' and '.join(moved)}): a graph replays only the device's work, so every replay reuses "
        "the numbers the capture drew, and whatever the call made of them (a branch, as Hugging "
        "Face's LayerDrop `if self.training and torch.rand([]) < self.layerdrop: skip the layer`; "
        "a value moved to the device) is the same at every call, where eagerly each call draws "
        "anew. Harmless if nothing depends on them (layerdrop=0.0, or a draw only training mode "
        "uses, in eval mode). Otherwise draw on the device (torch.rand(..., device='cuda')), or "
        "make that code a break (breaks=[...]: it runs eagerly at every call; breaks=\"auto\" "
        "finds a torch draw that decides something)"
    )


# -- a generator passed as an argument ---------------------------------------------------------
#
# A graph draws from the generator state registered at its capture, so a generator argument
# cannot be swapped for another one at a call (a sampler's per-request generator). Instead the
# graph is built around a stand-in of its own, and each call puts the stand-in where the call's
# generator stands (its seed and offset) and, after the replay, moves the call's generator on to
# where the stand-in got: what the eager call would have drawn and left.


def per_call(leaf: Any) -> bool:
    """Is the argument ``leaf`` a generator taken from every call (a CUDA one), not a constant?
    A device's default generator is a constant: torch registers it with every graph, so the
    graph's draws from it as an argument follow its draws from it by default (dropout), as
    eagerly; a stand-in's would start where those start, and draw the same numbers."""
    return isinstance(leaf, torch.Generator) and leaf.device.type == "cuda" and not is_default(leaf)


def stand_in(gen: torch.Generator) -> torch.Generator:
    """The graph's own generator for the argument ``gen``, where ``gen`` stands (the build's
    warm-ups draw from it: ``gen`` is left as it is)."""
    own = torch.Generator(device=gen.device)
    own.set_state(gen.get_state())
    return own


def stand_ins(leaves: Sequence[Any]) -> dict[int, torch.Generator]:
    """The graph's own generator for each generator argument among ``leaves`` (:func:`per_call`),
    by leaf: one generator passed in two places gets one stand-in (its draws follow each other)."""
    own: dict[int, torch.Generator] = {}
    return {i: own[id(g)] if id(g) in own else own.setdefault(id(g), stand_in(g))
            for i, g in enumerate(leaves) if per_call(g)}


def pairs(owns: dict[int, torch.Generator]) -> tuple[tuple[int, int, bool], ...]:
    """With two or more generator arguments: each pair of their places, and whether the sample
    passed one generator in both (:func:`check_pairs` holds each call to that)."""
    places = sorted(owns)
    return tuple((a, b, owns[a] is owns[b]) for k, a in enumerate(places) for b in places[:k])


def check_pairs(found: tuple[tuple[int, int, bool], ...], leaves: Sequence[Any], paths: Sequence[str]) -> None:
    """Refuse a call that passes generators otherwise than the sample did: one where it passed
    two (the graph's draws from them were captured apart: they would draw the same numbers), or
    two where it passed one (captured as one sequence)."""
    for a, b, one in found:
        if (leaves[a] is leaves[b]) is not one:
            raise ReplayInputError(
                f"{paths[b]} and {paths[a]}: the graph was captured with "
                f"{'one generator' if one else 'two different generators'} there, called with "
                f"{'two' if one else 'one in both'}; pass generators as the sample did (draws from "
                "one generator follow each other, from two they do not), or graph again"
            )


def fits(own: torch.Generator, gen: Any) -> bool:
    """May the call pass ``gen`` where the graph draws from ``own``: a generator on its device,
    not its default one (see :func:`per_call`)?"""
    return isinstance(gen, torch.Generator) and same_device(gen, own) and not is_default(gen)


def bind(own: torch.Generator, gen: Any) -> bool:
    """Put ``own`` where the call's generator ``gen`` stands; False if it does not :func:`fits`."""
    if gen is own:
        return True
    if not fits(own, gen):
        return False
    seed, offset = position(gen)
    own.manual_seed(seed)
    own.set_offset(offset)
    return True


def not_fitting(path: str, gen: Any, own: torch.Generator) -> ReplayInputError:
    """The error for a call that passes ``gen`` at ``path`` where the graph draws from ``own``
    (a CPU generator, one on another device, or no generator at all)."""
    if isinstance(gen, torch.Generator) and same_device(gen, own):  # (its default one)
        return ReplayInputError(
            f"{path}: the default CUDA generator of {gen.device}, but the graph was captured with "
            "a generator of your own there, which it draws from apart from the default one (torch "
            "registers that with every graph, for dropout and the like): from the default one its "
            "draws there would start where those start, and repeat their numbers. Pass a "
            "torch.Generator(device=...) of your own, or graph with the default one passed"
        )
    return ReplayInputError(
        f"{path}: {gen!r} but the graph was captured with a torch.Generator on {own.device}; "
        "pass a generator on that device (any one: the graph draws from where it stands, and "
        "moves it on)"
    )


def hand_back(own: torch.Generator, gen: torch.Generator) -> None:
    """After the replay: the call's generator moves on as far as the replay moved ``own``."""
    if gen is not own:
        gen.set_offset(own.get_offset())
