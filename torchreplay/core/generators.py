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
import weakref
from typing import Any, Iterator

import torch

from torchreplay import _compat
from torchreplay._compat.rng import Position, can_register_generators, default_generator, position, same_generator
from torchreplay.errors import CaptureError

__all__ = ["Draws", "bind", "hand_back", "remember", "remembered", "stand_in"]

#: The fix that every message here gives.
SEED_OUTSIDE = (
    "Seed it outside the graphed call (torch.manual_seed(...) or g.manual_seed(...) before a call, "
    "or g.set_state(...)): a graph reads the generator's seed and offset at every replay, and its "
    "replays then draw what eager calls draw"
)


#: How far :meth:`Draws._shift` moves a generator (philox offsets move in steps of four)
SHIFT = 1 << 20


class _Call:
    """What one watched call did to the generators: where the default generator and the
    explicit ones known before the call stood at its start and at its end; for the call the
    dispatch mode watched, each op given an explicit CUDA generator (the generator, where it
    stood before the op, the op), grouped by generator (each with where it stood at the end)."""

    __slots__ = ("start", "end", "starts", "ends", "explicit", "groups")

    def __init__(self, start: Position | None, starts: list[tuple[torch.Generator, Position]] | None = None) -> None:
        self.start = start
        self.end: Position | None = None
        self.starts = starts or []
        self.ends: list[Position] = []
        self.explicit: list[tuple[torch.Generator, Position, Any]] = []
        self.groups: list[tuple[torch.Generator, list[tuple[Position, Any]], Position]] = []


class _Watch(_compat.LightDispatchMode):
    """Notes the CUDA generator each op is given, and where it stood; changes nothing."""

    def __init__(self, call: _Call) -> None:
        super().__init__()
        self.call = call

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        gen = kwargs.get("generator")
        if isinstance(gen, torch.Generator) and gen.device.type == "cuda":
            self.call.explicit.append((gen, position(gen), func))
        return func(*args, **kwargs)


class Draws:
    """The explicit generators a build's calls draw from, found by the first call it watches
    (a dispatch mode: each op's ``generator=``), with where each stood then (:meth:`put_back`);
    and whether two warm-ups moved the generators as replays would (:meth:`verdict`), from where
    each stood at their start and end: the later calls cost four reads a generator, no mode."""

    def __init__(self, device: torch.device) -> None:
        self._default = default_generator(device)
        self._calls: list[_Call] = []  # the compared calls (warm-ups of the same arguments)
        self._first: list[tuple[torch.Generator, Position]] = []
        self._found: set[int] = set()  # the callables (by id) a call of which the mode watched
        #: the explicit CUDA generators drawn from (not a default one), each once
        self.generators: list[torch.Generator] = []

    @property
    def explicit(self) -> bool:
        """Did a watched call draw from an explicit generator?"""
        return bool(self._first)

    @contextlib.contextmanager
    def watch(self, compare: bool = True, key: Any = None) -> Iterator[None]:
        """Watch one eager call of ``key`` (the callable; its first call is watched by the
        mode); ``compare``: it is one of the calls :meth:`verdict` compares (the warm-ups: the
        same arguments each time; not a call at another size)."""
        found = id(key) in self._found
        if found and not compare:
            yield
            return
        call = self.begin(compare)
        with _Watch(call) if not found else contextlib.nullcontext():
            yield
        self.record(call, compare, None if found else key)

    def begin(self, compare: bool = True) -> _Call:
        """The record of a call about to run (:meth:`watch` makes it, before the call)."""
        default = self._default
        if compare and self._calls:  # (see _shift)
            self._shift()
        return _Call(position(default) if default is not None else None, [(g, position(g)) for g in self.generators])

    def record(self, call: _Call, compare: bool = True, found: Any = None) -> None:
        """Take in what a watched call did (:meth:`watch` does, after the call); ``found``: the
        callable whose call the mode watched (``call.explicit`` is filled)."""
        if self._default is not None:
            call.end = position(self._default)
        call.ends = [position(g) for g, _ in call.starts]
        if found is not None:
            self._found.add(id(found))
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
            if not any(same_generator(gen, g) for g in self.generators):
                self._first.append((gen, draws[0][0]))
                self.generators.append(gen)

    def _shift(self) -> None:
        """Move every generator known on by :data:`SHIFT` before the second compared call. A
        call that seeds a generator inside itself draws from the same place, and ends at the
        same place, whatever the place it started from; a call that draws from where the
        generator stands ends as far on from its start as the call before. (A build may put
        the generators back before each warm-up, as a breakable graph's does: without the
        shift both calls would start at one place, and the two would look the same.)"""
        for gen in ([self._default] if self._default is not None else []) + self.generators:
            seed, offset = position(gen)
            gen.set_offset(offset + SHIFT)

    def put_back(self) -> None:
        """Put each explicit generator back where the build first drew from it."""
        for gen, (seed, offset) in self._first:
            gen.manual_seed(seed)
            gen.set_offset(offset)

    def verdict(self, name: str) -> CaptureError | None:
        """The error for the last two compared calls, if they moved a generator other than as
        replays would: seeded inside the call, or a generator made at every call."""
        if self.generators and not can_register_generators():
            return CaptureError(
                f"'{name}' draws from a torch.Generator of its own ({self._op(self.generators[0])}); "
                "this torch cannot register one with a graph (torch >= 2.4 can). Use the default "
                "generator inside the graphed function, or upgrade torch"
            )
        calls = self._calls
        for call in calls:
            if call.start is not None and call.end is not None and call.start[0] != call.end[0]:
                return _reseeded(name, "the default CUDA generator")
        if len(calls) < 2:
            return None
        a, b = calls
        if None not in (a.start, a.end, b.start, b.end):
            if a.end[1] - a.start[1] != b.end[1] - b.start[1]:  # type: ignore[index]
                return _reseeded(name, "the default CUDA generator")
        for (gen, start_b), end_b in zip(b.starts, b.ends):
            span_a = self._span(a, gen)
            moved_b = (start_b[0] == end_b[0], end_b[1] - start_b[1])
            if span_a is not None and moved_b != (span_a[0][0] == span_a[1][0], span_a[1][1] - span_a[0][1]):
                return _reseeded(f"{name}", f"a torch.Generator it draws from ({self._op(gen)})", made=True)
        return None

    def _span(self, call: _Call, gen: torch.Generator) -> tuple[Position, Position] | None:
        """Where ``gen`` stood at the start of ``call`` (or at its first draw there, for the call
        that found it) and at its end; None if the call did not know it."""
        for (g, start), end in zip(call.starts, call.ends):
            if g is gen:
                return start, end
        for g, draws, end in call.groups:
            if g is gen:
                return draws[0][0], end
        return None

    def _op(self, gen: torch.Generator) -> str:
        for call in self._calls:
            for g, draws, _ in call.groups:
                if g is gen:
                    return f"at {_opname(draws[0][1])}"
        return "at an op"


def _opname(func: Any) -> str:
    return str(func).removeprefix("aten.") if func is not None else "an op"


def _reseeded(name: str, what: str, made: bool = False) -> CaptureError:
    how = ", or makes a new one at every call" if made else ""
    return CaptureError(
        f"'{name}' sets the state of {what} inside the call{how}: two warm-up calls started "
        "from different places and did not move it on by the same amount. Eagerly every call "
        "then draws the same numbers; a graph's replays would draw on from where the last one "
        "stopped, silently different. Make the generator once, outside the call. "
        + SEED_OUTSIDE
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


# -- a generator passed as an argument ---------------------------------------------------------
#
# A graph draws from the generator state registered at its capture, so a generator argument
# cannot be swapped for another one at a call (a sampler's per-request generator). Instead the
# graph is built around a stand-in of its own, and each call puts the stand-in where the call's
# generator stands (its seed and offset) and, after the replay, moves the call's generator on to
# where the stand-in got: what the eager call would have drawn and left.


def stand_in(gen: torch.Generator) -> torch.Generator:
    """The graph's own generator for the argument ``gen``, where ``gen`` stands (the build's
    warm-ups draw from it: ``gen`` is left as it is)."""
    own = torch.Generator(device=gen.device)
    own.set_state(gen.get_state())
    return own


def bind(own: torch.Generator, gen: Any) -> bool:
    """Put ``own`` where the call's generator ``gen`` stands; False if ``gen`` is not a
    generator on ``own``'s device."""
    if gen is own:
        return True
    if not isinstance(gen, torch.Generator) or gen.device != own.device:
        return False
    seed, offset = position(gen)
    own.manual_seed(seed)
    own.set_offset(offset)
    return True


def hand_back(own: torch.Generator, gen: torch.Generator) -> None:
    """After the replay: the call's generator moves on as far as the replay moved ``own``."""
    if gen is not own:
        gen.set_offset(own.get_offset())
