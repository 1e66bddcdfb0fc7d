"""What core/generators.py concludes from the draws of two warm-up calls: which generators to
register, where to put them back, and which calls seed a generator inside themselves (refused).

The calls are written down as the dispatch mode would record them (a CPU build has no CUDA
generator); a stand-in generator has the four methods the module uses. On the GPU the same runs
on real calls (tests/gpu/test_generators.py).
"""

from __future__ import annotations

import pytest
import torch

from torchreplay.core import generators
from torchreplay.core.generators import Draws, _Call, remember, remembered
from torchreplay.errors import CaptureError

CUDA = torch.device("cuda")
RANDN = "aten.randn.generator"


class Gen:
    """A philox generator as the module sees one: a seed and an offset, moved by four per
    draw here."""

    device = CUDA

    def __init__(self, seed: int, offset: int = 0) -> None:
        self.seed, self.offset = seed, offset

    def initial_seed(self) -> int:
        return self.seed

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        self.offset = offset

    def manual_seed(self, seed: int) -> None:
        self.seed, self.offset = seed, 0


@pytest.fixture(autouse=True)
def registering_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU build's CUDAGraph cannot register generators; a CUDA build of torch >= 2.4 can."""
    monkeypatch.setattr(generators, "can_register_generators", lambda: True)


def run(d: Draws, draws: list[tuple[Gen, str]], seed_first: dict[int, int] | None = None, compare: bool = True) -> None:
    """A watched call that draws ``draws`` in order, each moving its generator by 4, recorded
    as :meth:`Draws.watch` does; ``seed_first``: generators (by id) seeded to that seed at the
    call's start, as ``g.manual_seed`` in the callable does."""
    c = d.begin(compare)
    for gen in {id(g): g for g, _ in draws}.values():
        if seed_first and id(gen) in seed_first:
            gen.manual_seed(seed_first[id(gen)])
    for gen, op in draws:
        c.explicit.append((gen, (gen.seed, gen.offset), op))
        gen.offset += 4
        c.ops += 1
    d.record(c, compare)


def test_a_generator_drawn_from_where_it_stands_is_registered_and_put_back() -> None:
    g = Gen(5, 40)
    d = Draws(CUDA)
    run(d, [(g, RANDN), (g, RANDN)])
    run(d, [(g, RANDN), (g, RANDN)])
    assert d.verdict("f") is None
    assert d.generators == [g] and d.explicit
    d.put_back()
    assert (g.seed, g.offset) == (5, 40)  # where the build first drew from it


def test_two_generators_each_once_and_another_object_of_the_same_generator() -> None:
    a, b = Gen(1), Gen(1)  # same seed and offset, two generators
    d = Draws(CUDA)
    run(d, [(a, RANDN), (b, RANDN), (a, RANDN)])
    run(d, [(a, RANDN), (b, RANDN), (a, RANDN)])
    assert d.verdict("f") is None
    assert d.generators == [a, b]


def test_a_generator_seeded_inside_the_call_is_refused() -> None:
    g = Gen(2)
    d = Draws(CUDA)
    run(d, [(g, RANDN)], seed_first={id(g): 0})
    run(d, [(g, RANDN)], seed_first={id(g): 0})
    err = d.verdict("sample")
    assert isinstance(err, CaptureError)
    assert "'sample' sets the state of a torch.Generator it draws from inside the call (at randn.generator)" in str(err)
    assert "Seed it outside the graphed call" in str(err)


def test_a_seed_set_between_two_draws_of_one_call_is_refused() -> None:
    g = Gen(2)

    def reseeding_call() -> _Call:
        c = _Call(None)
        for k in range(2):
            if k:
                g.manual_seed(0)
            c.explicit.append((g, (g.seed, g.offset), RANDN))
            g.offset += 4
        return c

    d = Draws(CUDA)
    d.record(reseeding_call())
    d.record(reseeding_call())
    assert isinstance(d.verdict("f"), CaptureError)


def test_a_generator_made_at_every_call_is_refused() -> None:
    d = Draws(CUDA)
    run(d, [(Gen(0), RANDN)])
    run(d, [(Gen(0), RANDN)])
    err = d.verdict("f")
    assert isinstance(err, CaptureError) and "makes at every call" in str(err)


def test_one_call_or_calls_at_other_sizes_are_not_compared() -> None:
    g = Gen(3)
    d = Draws(CUDA)
    run(d, [(g, RANDN)], seed_first={id(g): 0}, compare=False)  # a probe at another size
    run(d, [(g, RANDN)], seed_first={id(g): 0})
    assert d.verdict("f") is None  # one compared call: nothing to compare with
    assert d.generators == [g]


def test_the_default_generator_moved_back_or_reseeded_inside_the_call() -> None:
    def default_call(start: tuple[int, int], moves: list[tuple[int, tuple[int, int]]], end: tuple[int, int]) -> _Call:
        c = _Call(start)
        c.moves, c.ops, c.end = moves, 10, end
        return c

    # drawing on: (0, 100) -> 108 -> 116, then (0, 116) -> 124 -> 132: relative the same
    d = Draws(CUDA)
    d.record(default_call((0, 100), [(3, (0, 108))], (0, 116)))
    d.record(default_call((0, 116), [(3, (0, 124))], (0, 132)))
    assert d.verdict("f") is None
    # torch.manual_seed(0) at the start of each call: it draws from 0 whatever the start
    d = Draws(CUDA)
    d.record(default_call((0, 100), [(0, (0, 0)), (3, (0, 8))], (0, 16)))
    d.record(default_call((0, 16), [(0, (0, 0)), (3, (0, 8))], (0, 16)))
    assert "sets the state of the default CUDA generator" in str(d.verdict("f"))
    # a seed other than the one the call started with
    d = Draws(CUDA)
    d.record(default_call((7, 100), [(0, (0, 0))], (0, 8)))
    assert isinstance(d.verdict("f"), CaptureError)
    # checkpoint's fork_rng: back to where the forward drew, then on again: relative the same
    d = Draws(CUDA)
    d.record(default_call((0, 100), [(2, (0, 108)), (5, (0, 100)), (6, (0, 108))], (0, 108)))
    d.record(default_call((0, 108), [(2, (0, 116)), (5, (0, 108)), (6, (0, 116))], (0, 116)))
    assert d.verdict("f") is None


def test_remembered_by_callable_for_captures_without_a_warm_up() -> None:
    class Model(torch.nn.Module):
        def forward(self, x):
            return x

    m, g = Model(), Gen(1)
    assert remembered(m.forward) is None
    remember(m.forward, [g])  # (a bound method: by its module)
    assert remembered(m) == (g,) and remembered(m.forward) == (g,)


def test_a_torch_that_cannot_register_generators_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(generators, "can_register_generators", lambda: False)
    g = Gen(1)
    d = Draws(CUDA)
    run(d, [(g, RANDN)])
    err = d.verdict("f")
    assert isinstance(err, CaptureError) and "this torch cannot register one with a graph" in str(err)
    assert "(randn.generator)" in str(err)


def test_put_back_before_each_warm_up_a_draw_passes_and_a_seed_to_the_same_state_is_refused() -> None:
    """A breakable graph's build puts the generators back before each warm-up. A generator
    seeded 0 and never drawn from stands where a call that seeds it 0 inside itself draws: the
    second compared call starts elsewhere (``Draws._shift``), so only the seeding call draws
    from another place than where it started."""
    g = Gen(0)
    d = Draws(CUDA)
    run(d, [(g, RANDN), (g, RANDN)])
    d.put_back()
    run(d, [(g, RANDN), (g, RANDN)])
    assert d.verdict("f") is None
    g = Gen(0)
    d = Draws(CUDA)
    run(d, [(g, RANDN)], seed_first={id(g): 0})
    d.put_back()
    run(d, [(g, RANDN)], seed_first={id(g): 0})
    assert isinstance(d.verdict("f"), CaptureError)


def test_a_first_call_that_draws_more_to_set_itself_up_is_not_refused() -> None:
    """A lazy initialisation draws from the generator at the first call only: the two compared
    warm-ups draw different amounts. Told only by where the second starts drawing: where the
    generator stood (moved on), not a seed's place."""
    g = Gen(4)
    d = Draws(CUDA)
    run(d, [(g, RANDN), (g, RANDN)])  # the set-up draw, then the call's own
    run(d, [(g, RANDN)])
    assert d.verdict("f") is None
    g = Gen(4)
    d = Draws(CUDA)
    run(d, [(g, RANDN), (g, RANDN)], seed_first={id(g): 0})
    run(d, [(g, RANDN)], seed_first={id(g): 0})
    assert isinstance(d.verdict("f"), CaptureError)


def test_keep_puts_back_a_generator_a_capture_without_warm_ups_drew_from(monkeypatch: pytest.MonkeyPatch) -> None:
    """A breakable size captured at its first call replays its segments for real: the
    generators it draws from (remembered from the build) are put back with the snapshot, to
    where they stood when the capture began, not where the build first drew from them."""
    g, h = Gen(3, 12), Gen(4, 0)
    d = Draws(CUDA)
    run(d, [(h, RANDN)])  # the build drew from h at offset 0
    monkeypatch.setattr(generators, "per_call", lambda leaf: isinstance(leaf, Gen))  # (a CUDA one)
    d.keep([g, torch.zeros(2), 3, h])  # (a call's leaves: only its generators are kept)
    g.offset, h.offset = 20, 8  # the capture's real replays
    d.put_back()
    assert (g.seed, g.offset) == (3, 12) and (h.seed, h.offset) == (4, 0)


def test_generator_pairs_hold_each_call_to_the_samples_pattern() -> None:
    a, b = Gen(1), Gen(2)
    owns = {0: a, 2: a, 3: b}  # the sample passed one generator at 0 and 2, another at 3
    found = generators.pairs(owns)
    assert sorted(found) == [(2, 0, True), (3, 0, False), (3, 2, False)]
    assert generators.pairs({1: a}) == ()  # one generator argument: nothing to hold
    paths = ["args[0]", "args[1]", "args[2]", "args[3]"]
    x, y = Gen(7), Gen(8)
    generators.check_pairs(found, [x, None, x, y], paths)  # as the sample: no error
    one = r"args\[0\] and args\[2\]: the graph was captured with one generator there, called with two"
    with pytest.raises(generators.ReplayInputError, match=one):
        generators.check_pairs(found, [x, None, y, y], paths)
    with pytest.raises(generators.ReplayInputError, match=r"two different generators there, called with one in both"):
        generators.check_pairs(found, [x, None, x, x], paths)


# -- the host's generators, drawn from inside a capture (HostDraws) ----------------------------


def test_host_draws_names_each_host_generator_a_stretch_drew_from() -> None:
    """Each of torch's CPU generator, Python's random and NumPy's (imported) is named once when
    a stretch drew from it; what runs between stretches (a break) does not count."""
    import random

    np = pytest.importorskip("numpy")
    h = generators.HostDraws()
    h.start()
    h.stop()
    assert h.moved == []
    torch.rand([])  # between stretches: a break's draw, at every call
    random.random()
    h.start()
    torch.rand([])
    h.stop()
    assert h.moved == ["torch's CPU generator"]
    h.start()
    random.random()
    np.random.rand()
    torch.rand([])
    h.stop()
    assert h.moved == ["torch's CPU generator", "Python's random module", "NumPy's global generator"]


def test_host_draws_without_python_watches_torchs_cpu_generator_alone() -> None:
    import random

    h = generators.HostDraws(python=False)
    h.start()
    random.random()
    h.stop()
    assert h.moved == []
    h.start()
    torch.randn(3)
    h.stop()
    assert h.moved == ["torch's CPU generator"]
    h.stop()  # (a stop without a start: nothing)
    assert h.moved == ["torch's CPU generator"]


def test_host_draws_warning_names_the_graph_the_generators_and_the_fixes() -> None:
    text = generators.host_draws_warning("Encoder", ["torch's CPU generator"])
    assert "'Encoder' drew random numbers on the host" in text and "torch's CPU generator" in text
    assert "layerdrop=0.0" in text and "device='cuda'" in text and "breaks=" in text


def test_a_cpu_generator_is_not_taken_from_each_call_nor_a_default_one() -> None:
    """``per_call``: a CUDA generator only (a CPU one stays a constant), never a device's
    default one; ``is_default`` and ``same_device`` on what a CPU build has."""
    from torchreplay._compat.rng import is_default, same_device

    cpu = torch.Generator()
    assert not generators.per_call(cpu) and not is_default(cpu)
    assert not generators.per_call(torch.default_generator)
    assert same_device(cpu, torch.default_generator)
