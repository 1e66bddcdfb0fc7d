"""The Python state a captured call changes (core/effects.py ``PyState``, core/pystate.py), on the CPU.

Each case runs the protocol capture() runs (start, warm-ups, the captured call, the verdict,
undo on failure) with the callable run eagerly in place of the capture, and checks exactly
what is reported and what is put back. End to end through ``tr.graph(sizes=)`` with
test_buckets' eager stand-in for CUDA graphs, and through graph_step's emulated capture in
test_training.py. The GPU tests (tests/gpu/test_effects.py) compare the graphs with eager.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import re
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

import test_buckets
import torchreplay as tr
from torchreplay.core.effects import PyState
from torchreplay.core.pystate import MAX_VALUES
from torchreplay.errors import CaptureError

LOG = "torchreplay.core.effects"


def capture_like(fn: Callable[..., Any], *args: Any, modules=(), warmups: int = 3, **kwargs: Any):
    """Run ``fn`` as capture() does around PyState; return (error or None, the PyState)."""
    ps = PyState("fn", fn, args, kwargs, modules=lambda: modules)
    ps.start()
    for i in range(warmups):
        if i:  # (from_the_start: each warm-up after the first and the capture start from the
            ps.put_back_tensors()  # caller's state)
        with ps.warmup(last=i == warmups - 1):
            fn(*args, **kwargs)
    ps.put_back_tensors()
    ps.before_capture()
    with ps.captured():
        fn(*args, **kwargs)
    err = ps.verdict()
    if err is not None:
        ps.undo()
    else:
        ps.put_back_tensors()
    return err, ps


class Cache:
    """DynamicCache's shape: a tensor attribute replaced by a longer one at every call."""

    def __init__(self) -> None:
        self.keys = torch.randn(1, 4)

    def update(self, k: torch.Tensor) -> torch.Tensor:
        self.keys = torch.cat([self.keys, k])
        return self.keys


def test_a_cache_grown_by_replacing_its_tensor_raises_and_is_put_back() -> None:
    cache = Cache()
    first = cache.keys
    err, _ = capture_like(lambda k, c: c.update(k).sum(0), torch.randn(1, 4), cache)
    assert isinstance(err, CaptureError)
    assert "args[1].keys: tensor(4, 4)" in str(err) and "-> tensor(5, 4)" in str(err)
    assert "StaticCache" in str(err)  # the fix for HF users
    assert cache.keys is first  # the warm-ups' and the capture's steps were undone


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x)


def test_a_counter_on_a_module_raises_with_its_path_and_both_values() -> None:
    m = Counter()
    err, _ = capture_like(m, torch.randn(2, 4))
    assert isinstance(err, CaptureError) and "Counter.calls: 3 -> 4" in str(err)
    assert m.calls == 0


def test_a_recurrent_state_on_an_object_raises() -> None:
    class State:
        pass

    state = State()
    state.h = torch.zeros(4)
    h0 = state.h
    err, _ = capture_like(lambda x, s: setattr(s, "h", s.h * 0.5 + x) or s.h, torch.randn(4), state)
    assert isinstance(err, CaptureError) and "args[1].h" in str(err)
    assert state.h is h0


def test_a_list_appended_to_raises_and_is_put_back() -> None:
    seen: list[torch.Tensor] = [torch.ones(1)]
    err, _ = capture_like(lambda x, acc: acc.append(x * 2) or x + 1, torch.randn(4), seen)
    assert isinstance(err, CaptureError) and "args[1]: 4 items -> 5 items" in str(err)
    assert len(seen) == 1


def test_a_closure_rebound_with_nonlocal_raises_and_is_put_back() -> None:
    h = torch.zeros(4)
    h0 = h

    def step(x: torch.Tensor) -> torch.Tensor:
        nonlocal h
        h = h + x
        return h

    err, _ = capture_like(step, torch.randn(4))
    assert isinstance(err, CaptureError) and "closure h: tensor(4,)" in str(err)
    assert h is h0


CALLS = 0


def _counted(x: torch.Tensor) -> torch.Tensor:
    global CALLS
    CALLS += 1
    return x * 2


def test_a_global_assigned_raises_and_is_put_back() -> None:
    err, _ = capture_like(_counted, torch.randn(4))
    assert isinstance(err, CaptureError) and "global CALLS: 3 -> 4" in str(err)
    assert CALLS == 0


MODEL = Counter()


def _script_step(x: torch.Tensor) -> torch.Tensor:
    return MODEL(x)  # a module a script keeps in a global


def test_a_module_read_from_a_global_is_walked() -> None:
    err, _ = capture_like(_script_step, torch.randn(2, 4))
    assert isinstance(err, CaptureError) and "MODEL.calls: 3 -> 4" in str(err)


def test_a_tensor_set_but_not_read_warns_once_and_keeps_the_graph(caplog) -> None:
    class Keeps(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            self.last = y * 2  # for the caller to read: a replay rewrites it in place
            return y

    m = Keeps()
    with caplog.at_level(logging.WARNING, logger=LOG):
        err, ps = capture_like(m, torch.randn(2, 4))
        assert err is None
        with ps.captured():  # a second capture (another size) says it no more
            m(torch.randn(2, 4))
        assert ps.verdict() is None
    warned = [r.getMessage() for r in caplog.records if r.name == LOG]
    assert len(warned) == 1 and "Keeps.last" in warned[0] and "without reading" in warned[0]


def test_torch_reparametrizations_and_in_place_state_are_silent(caplog) -> None:
    norm = nn.utils.spectral_norm(nn.Linear(4, 4)).eval()  # `weight` recomputed at each call

    class Static(nn.Module):  # a static cache written in place
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("kv", torch.zeros(8, 4))

        def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            self.kv.index_copy_(0, pos, x)
            return self.kv.sum(0)

    class Lazy(nn.Module):  # made at the first call only: the warm-ups' business
        def __init__(self) -> None:
            super().__init__()
            self.table = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.table is None:
                self.table = torch.ones(4)
            return x * self.table

    class Scaler:  # GradScaler's shape: a fresh, empty dict of per-step state after each call
        def __init__(self) -> None:
            self.states: dict = collections.defaultdict(dict)

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            self.states[0]["stage"] = 1
            self.states = collections.defaultdict(dict)
            return x * 2

    with caplog.at_level(logging.WARNING, logger=LOG):
        assert capture_like(norm, torch.randn(2, 4))[0] is None
        assert capture_like(Static(), torch.randn(1, 4), torch.tensor([3]))[0] is None
        assert capture_like(Lazy(), torch.randn(4))[0] is None
        assert capture_like(Scaler(), torch.randn(4))[0] is None
    assert not [r for r in caplog.records if r.name == LOG]


@pytest.mark.parametrize("made", ["normal", "inference_mode"])
def test_a_position_counter_advanced_in_place_is_put_back_after_the_build(made: str) -> None:
    # An inference tensor (a cache made and graphed under torch.inference_mode) has no version
    # counter: reading it raised at the build.
    mode = torch.inference_mode() if made == "inference_mode" else contextlib.nullcontext()

    class Positions:  # transformers' StaticLayer: `cumulative_length.add_(n)` at each call
        def __init__(self) -> None:
            self.length = torch.zeros((), dtype=torch.long)
            self.kv = torch.zeros(16, 4)

        def update(self, k: torch.Tensor) -> torch.Tensor:
            self.kv.index_copy_(0, self.length.view(1), k)
            self.length.add_(1)
            return self.kv

    with mode:
        cache = Positions()
        err, _ = capture_like(lambda k, c: c.update(k).sum(0), torch.randn(1, 4), cache)
    assert err is None
    assert int(cache.length) == 0  # as the caller left it: the first replay writes row 0
    assert cache.length.is_inference() == (made == "inference_mode")


def test_without_warm_ups_a_replaced_tensor_counts_as_read() -> None:
    # no warm-up showed which tensors each call replaces, so none was watched for reads

    class Keeps(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.last = x * 2
            return x

    err, _ = capture_like(Keeps(), torch.randn(4), warmups=0)
    assert isinstance(err, CaptureError) and "last" in str(err)


def test_where_the_walk_starts() -> None:
    class Runner:  # a callable object, a bound method, a partial
        def __init__(self) -> None:
            self.pos = 0

        def step(self, x: torch.Tensor) -> torch.Tensor:
            self.pos += 1
            return x + self.pos

        __call__ = step

    for make in (lambda r: r.step, lambda r: r, lambda r: functools.partial(Runner.step, r)):
        runner = Runner()
        err, _ = capture_like(make(runner), torch.randn(4))
        assert isinstance(err, CaptureError) and ".pos: 3 -> 4" in str(err), make
        assert runner.pos == 0


def test_a_large_global_is_walked_within_bounds() -> None:
    big = list(range(3 * MAX_VALUES))
    err, ps = capture_like(lambda x: x * len(big), torch.randn(4))
    assert err is None
    nodes = ps.take()
    assert len(nodes["big"].items) == 512 and nodes["big"].size == len(big)


def test_tr_graph_with_sizes_refuses_a_counter_and_leaves_the_module_as_it_was(monkeypatch) -> None:
    test_buckets.install_cpu_graphs(monkeypatch.setattr)
    m = Counter()
    with pytest.raises(CaptureError, match=r"Counter.calls: \d+ -> \d+"):
        tr.graph(m, torch.randn(4, 4), sizes=[2, 4])
    assert m.calls == 0  # the probe's, the warm-ups' and the capture's counts put back
    g = tr.graph(m.lin, torch.randn(4, 4), sizes=[2, 4])  # the same weights without it graph
    x = torch.randn(3, 4)
    torch.testing.assert_close(g(x), m.lin(x))


def test_a_lazily_captured_size_puts_back_what_its_capture_advanced_in_place(monkeypatch) -> None:
    # A size captured at its first call (capture="lazy") ran no warm-ups, so nothing was put
    # back after it. This stand-in's capture runs the call, as a breakable graph's does (its
    # segments are replayed once, its breaks run): `length.add_(1)` was kept, and every later
    # call read one position ahead.
    test_buckets.install_cpu_graphs(monkeypatch.setattr)

    class Pos:
        def __init__(self) -> None:
            self.length = torch.zeros((), dtype=torch.long)

    def step(x: torch.Tensor, c: Pos) -> torch.Tensor:
        c.length.add_(1)
        return x + c.length

    for capture in ("ahead", "lazy"):
        cache, ref = Pos(), Pos()
        g = tr.graph(step, torch.randn(4, 3), cache, sizes=[1, 2, 4], capture=capture)
        assert int(cache.length) == 0, capture
        for n in (1, 2, 3, 1, 4, 2):
            x = torch.randn(n, 3)
            torch.testing.assert_close(g(x, cache), step(x, ref))
            assert int(cache.length) == int(ref.length), (capture, n)


class Parts:
    """A model of a breakable graph's run: ``brk`` runs inside PyState.eager_part, as a
    break's call in the captured run does (breaks/graph.py); the rest is 'graph segments'."""

    def __init__(self, brk: Callable[..., Any], segment: Callable[..., Any] = lambda s, x: x) -> None:
        self.ps: PyState | None = None
        self.brk, self.segment = brk, segment
        self.seen = 0
        self.log: list[int] = []
        self.h = torch.zeros(4)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = self.segment(self, x * 2)
        with self.ps.eager_part("break b"):
            x = self.brk(self, x)
        return self.segment(self, x + 1)


def capture_parts(model: Parts, warmups: int = 3, device: torch.device | None = None):
    ps = model.ps = PyState("model", model, (torch.randn(4),), {})  # (parts outside the
    ps.start()  # captured call are not compared: warm-ups)
    for i in range(warmups):
        if i:  # (each warm-up after the first and the capture start from the caller's state,
            ps.put_back_tensors()  # as core/capture.py's from_the_start)
        with ps.warmup(last=i == warmups - 1):
            model(torch.randn(4))
    ps.put_back_tensors()
    with ps.captured(device):
        model(torch.randn(4))
    err = ps.verdict()
    if err is not None:
        ps.undo()
    return err


def _count(s: Parts, x: torch.Tensor) -> torch.Tensor:
    s.seen += 1
    s.log.append(s.seen)
    return x


def test_what_a_break_changes_in_python_is_not_an_error() -> None:
    # a break runs eagerly at every replay: its counter, its log and a tensor it keeps are real
    def keeps(s: Parts, x: torch.Tensor) -> torch.Tensor:
        s.h = x * 3  # read by no segment
        return _count(s, x)

    model = Parts(keeps)
    assert capture_parts(model) is None
    assert model.seen == 4 and len(model.log) == 4  # 3 warm-ups, the capture: left as they ran


def test_what_a_segment_changes_around_breaks_raises_with_the_breaks_hint() -> None:
    model = Parts(lambda s, x: x, segment=_count)
    err = capture_parts(model)
    assert isinstance(err, CaptureError) and "in a graph segment" in str(err) and "breaks=" in str(err)
    assert "Parts.seen: " in str(err) and model.seen == 0 and model.log == []  # put back


def test_a_list_a_break_and_a_segment_both_append_to_raises() -> None:
    def seg(s: Parts, x: torch.Tensor) -> torch.Tensor:
        s.log.append(0)
        return x

    err = capture_parts(Parts(_count, segment=seg))
    assert isinstance(err, CaptureError) and "Parts.log" in str(err)


def test_a_tensor_a_break_sets_that_a_segment_reads_raises() -> None:
    def sets(s: Parts, x: torch.Tensor) -> torch.Tensor:
        s.h = x * 3
        return x

    def reads(s: Parts, x: torch.Tensor) -> torch.Tensor:
        return x + s.h  # reads the break's tensor: frozen at the capture's in a graph

    err = capture_parts(Parts(sets, segment=reads))
    assert isinstance(err, CaptureError)
    assert re.search(r"Parts.h: tensor\(4,\) at \w+ -> tensor\(4,\) at \w+ \(by break b\)", str(err))
    assert "copy_" in str(err)
    # written in place instead: the segments read the same tensor at every call
    def copies(s: Parts, x: torch.Tensor) -> torch.Tensor:
        s.h.copy_(x * 3)
        return x

    assert capture_parts(Parts(copies, segment=reads)) is None


def test_a_cache_a_break_grows_raises_even_if_no_segment_reads_its_values() -> None:
    # HF's DynamicCache updated inside a break (the attention module): the model's own code
    # before it read the cache's length for the positions, in Python, once: unseen, refused
    def grows(s: Parts, x: torch.Tensor) -> torch.Tensor:
        s.h = torch.cat([s.h, x])
        return x

    model = Parts(grows)
    err = capture_parts(model)
    assert isinstance(err, CaptureError) and "grows" in str(err)
    assert re.search(r"Parts.h: tensor\(16,\) at \w+ -> tensor\(20,\) at \w+ \(by break b\)", str(err))
    assert model.h.shape == (4,)  # put back


def test_the_tensors_a_capture_reads_in_python_state_are_checked_by_identity() -> None:
    class KV:
        def __init__(self) -> None:
            self.k = torch.randn(3, 4)
            self.unused = torch.randn(2)
            self.lengths = [torch.ones(1)]

    kv = KV()

    def step(x: torch.Tensor, kv: KV) -> torch.Tensor:
        return x @ kv.k.T * kv.lengths[0]

    ps = PyState("step", step, (torch.randn(2, 4), kv), {}, reads=True)
    ps.start()
    for i in range(2):
        with ps.warmup(last=i == 1):
            step(torch.randn(2, 4), kv)
    ps.before_capture()
    with ps.captured():
        step(torch.randn(2, 4), kv)
    assert ps.verdict() is None
    reads = ps.reads()
    assert reads is not None and reads.replaced("step") is None
    kv.k.mul_(2)  # in place: the graph reads the same memory
    kv.unused = torch.randn(2)  # not read by the call
    assert reads.replaced("step") is None
    old = kv.k
    kv.k = torch.randn(3, 4)
    err = reads.replaced("step")
    assert isinstance(err, tr.ReplayInputError) and "args[1].k is tensor(3, 4)" in str(err)
    assert "copy_" in str(err)
    kv.k = old
    kv.lengths[0] = torch.ones(1)
    assert "args[1].lengths[0]" in str(reads.replaced("step"))
    assert PyState("f", step, (torch.randn(2, 4), kv), {}).reads() is None  # off by default


def test_tr_graph_with_sizes_raises_when_a_cache_tensor_is_replaced(monkeypatch) -> None:
    test_buckets.install_cpu_graphs(monkeypatch.setattr)

    class Rope(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.freqs = torch.randn(4)  # a plain attribute, not a buffer: Python state

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.freqs

    m = Rope()
    g = tr.graph(m, torch.randn(4, 4), sizes=[2, 4])
    x = torch.randn(3, 4)
    torch.testing.assert_close(g(x), m(x))
    m.freqs = torch.randn(4)
    with pytest.raises(tr.ReplayInputError, match=r"Rope\.freqs is tensor\(4,\).*graph again"):
        g(x)


def test_the_walk_meets_every_module_once_in_named_modules_order() -> None:
    """The walk's own loop over ``_modules`` (core/pystate.py ``_submodules``) gives the paths
    and order of ``named_modules``; a module shared by two parents is walked once, at its first
    path, and a module already walked is skipped with what is below it."""
    from torchreplay.core.pystate import _submodules

    shared = nn.Linear(2, 2)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(2, 2), shared), nn.ModuleDict({"a": shared, "b": nn.ReLU()}), shared,
    )
    model.add_module("none", None)
    done: set[int] = set()
    walked = []
    for path, m in _submodules(model, done):
        done.add(id(m))
        walked.append((path, m))
    want = list(model.named_modules())  # (torch's, duplicates removed: first path kept)
    assert [p for p, _ in walked] == [p for p, _ in want]
    assert all(a is b for (_, a), (_, b) in zip(walked, want))
    assert list(_submodules(model[0], done)) == []  # walked already: it and what is below it


class _Appending(nn.Module):
    """A cache with room for two calls of four rows, written where a position kept as Python
    state says; each call advances the position (as transformers' ``StaticCache`` does)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(8, 4))
        self.pos = torch.zeros((), dtype=torch.long)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(0, self.pos + torch.arange(x.shape[0]), x)
        self.pos.add_(x.shape[0])
        return self.cache.sum(0) * x


@pytest.mark.parametrize("front", ["graph", "sizes"])
def test_every_warm_up_starts_from_the_callers_state(front, monkeypatch) -> None:
    """The warm-ups ran on from each other's writes into the module's buffers and Python state:
    the third warm-up wrote past the end of a cache that eager could call twice more (on a GPU,
    a device-side assert that ends the process). Each warm-up, and the capture, now starts from
    the caller's state."""
    test_buckets.install_cpu_graphs(monkeypatch.setattr)
    m = _Appending()
    ref = _Appending()
    kw = {"sizes": [2, 4]} if front == "sizes" else {}
    g = tr.graph(m, torch.randn(4, 4), **kw)
    assert int(m.pos) == 0 and not m.cache.any()  # the build's writes put back
    for _ in range(2):
        x = torch.randn(4, 4)
        torch.testing.assert_close(g(x), ref(x))
        assert torch.equal(m.cache, ref.cache) and int(m.pos) == int(ref.pos)


# A graph on another device than the tensors below (nothing runs there: PyState only compares).
GRAPH_DEVICE = torch.device("cuda")


def capture_on(device: torch.device, fn: Callable[..., Any], *args: Any, warmups: int = 3):
    """capture_like, with the graph on ``device``: the tensors the state holds elsewhere (the
    CPU here) are ones no replay writes. As ``core/capture.py`` does, each warm-up after the
    first and the capture start from the caller's state (``from_the_start``)."""
    return built_on(device, fn, *args, warmups=warmups)[0]


def built_on(device: torch.device, fn: Callable[..., Any], *args: Any, warmups: int = 3, reads: bool = False):
    """:func:`capture_on`; return (error or None, the PyState), which with ``reads`` finds the
    state's tensors the capture reads (``PyState.reads()``)."""
    ps = PyState("fn", fn, args, {}, reads=reads)
    ps.start()
    for i in range(warmups):
        if i:
            ps.put_back_tensors()
        with ps.warmup(last=i == warmups - 1):
            fn(*args)
    ps.put_back_tensors()
    ps.before_capture()
    with ps.captured(device):
        fn(*args)
    err = ps.verdict()
    if err is not None:
        ps.undo()
    else:
        ps.put_back_tensors()
    return err, ps


class HostCounter(nn.Module):
    """Counts its calls in a CPU tensor kept as a plain attribute (``.to("cuda")`` leaves it)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = torch.zeros((), dtype=torch.long)
        self.scratch = torch.zeros(3)

    def forward(self, x: torch.Tensor, count: bool = True) -> torch.Tensor:
        if count:
            self.calls += 1
        torch.mul(torch.arange(3.0), 2, out=self.scratch)  # (the same values at every call)
        return x * 2


def test_a_tensor_off_the_graphs_device_written_at_every_call_is_refused_and_put_back() -> None:
    """A replay runs only the graph's device work: a counter kept on the CPU would stop
    counting, silently. The capture is refused, naming it, and the counter is put back; a
    scratch buffer the call fills with the values it already holds, and a graph on the CPU
    itself (the tensors' own device: its writes replay), are fine."""
    model = HostCounter()
    err = capture_on(GRAPH_DEVICE, model, torch.randn(2))
    assert err is not None and "calls (a torch.int64 tensor() on cpu)" in str(err), err
    assert "not on the graph's device" in str(err)
    assert int(model.calls) == 0  # (what the warm-ups and the capture counted, put back)
    # A scratch the first call fills: eagerly the call leaves it filled, a replay would not
    # (the build puts it back as the caller left it). Refused, saying how it can be graphed.
    err = capture_on(GRAPH_DEVICE, lambda x: model(x, count=False), torch.randn(2))
    assert err is not None and "scratch (a torch.float32 tensor(3,) on cpu)" in str(err), err
    assert "model.calls" not in str(err) and "once eagerly" in str(err)
    assert model.scratch.tolist() == [0.0, 0.0, 0.0]
    model(torch.randn(2), count=False)  # one eager call fills it: a replay's not writing is eager's
    assert capture_on(GRAPH_DEVICE, lambda x: model(x, count=False), torch.randn(2)) is None
    assert model.scratch.tolist() == [0.0, 2.0, 4.0]
    assert capture_on(torch.device("cpu"), model, torch.randn(2)) is None


class BufferCounter(nn.Module):
    """Counts its calls in a registered buffer off the graph's device (a second GPU's, in
    small: its kernels run on that device's own stream, which no capture records)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("seen", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(1)
        return self.lin(x)


def test_a_buffer_or_parameter_off_the_graphs_device_written_at_every_call_is_refused_and_put_back() -> None:
    model = BufferCounter()
    err = capture_on(GRAPH_DEVICE, model, torch.randn(2))
    assert err is not None and "seen (a torch.float32 tensor(1,) on cpu)" in str(err), err
    # (the fronts put back what the warm-ups and the capture counted: StateSnapshot, GPU-tested)

    def step(x: torch.Tensor) -> torch.Tensor:  # an optimizer's update of a weight off the device
        with torch.no_grad():
            model.lin.weight.mul_(0.5)
        return x

    err = capture_on(GRAPH_DEVICE, step, torch.randn(2))
    assert err is not None and "lin.weight (a torch.float32 tensor(2, 2) on cpu)" in str(err), err
    assert capture_on(torch.device("cpu"), model, torch.randn(2)) is None  # (on its own device: replayed)


def test_a_write_off_the_graphs_device_inside_a_break_is_real_and_one_in_a_segment_is_refused() -> None:
    def bump(s: Parts, x: torch.Tensor) -> torch.Tensor:
        s.h.add_(1)
        return x

    assert capture_parts(Parts(bump), device=GRAPH_DEVICE) is None  # (the break runs at every call)
    err = capture_parts(Parts(lambda s, x: x, segment=bump), device=GRAPH_DEVICE)
    assert err is not None and "in a graph segment" in str(err) and "breaks=" in str(err), err
