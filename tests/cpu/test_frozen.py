"""The plain Python values a graph froze (core/frozen.py), on the CPU: what the first capture
finds its code read (a module's attribute, a config object's, a property's, a global, a small
dict or list), and that calls while one of them differs from the capture's run eagerly, with a
warning naming it, until it is set back. The capture protocol is emulated as in test_effects.py; the fronts run on the
emulated CPU graphs of test_buckets.py. The GPU test is in tests/gpu/test_effects.py."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn as nn

import torchreplay as tr
from adapters import Lora
from test_effects import built_on
from torchreplay.core.effects import PyState
from torchreplay.core.frozen import FrozenWatch, chains_of

CPU = torch.device("cpu")
DEBUG = False  # a global the model below reads bare


class Config:
    def __init__(self) -> None:
        self.use_bias = True
        self.mode = "mul"


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = Config()
        self.scale = 2.0
        self.adapter = Lora(4, 2)
        self.drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(self.adapter(x)) * self.scale
        if self.config.mode == "add":
            y = y + 1
        if DEBUG:
            y = y * 0
        if self.training:
            y = y - 1
        return y


def _built(m: nn.Module, x: torch.Tensor):
    err, ps = built_on(CPU, m, x, reads=True)
    assert err is None, err
    reads = ps.reads()
    assert reads is not None and reads.values is not None
    return reads


def test_chains_name_what_the_code_loads_from_its_locals_and_globals_by_line() -> None:
    by_line = chains_of(Model.forward.__code__)
    chains = [c for line in by_line.values() for c in line]
    assert ("local", "self", ("scale",)) in chains
    assert ("local", "self", ("config", "mode")) in chains
    assert ("global", "DEBUG", ()) in chains
    first = Model.forward.__code__.co_firstlineno
    assert ("local", "self", ("config", "mode")) in by_line[first + 2]  # `if self.config.mode == "add":`
    assert chains_of(nn.Linear.forward.__code__) == {}  # torch's own code is not watched
    assert chains_of(tr.graph.__code__) == {}  # nor ours


def test_a_branch_the_call_does_not_take_reads_nothing() -> None:
    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = types.SimpleNamespace(is_decoder=False, use_cache=True)

        def forward(self, x):
            if self.config.is_decoder:
                use_cache = self.config.use_cache
            else:
                use_cache = False
            return x * 2 if not use_cache else x

    m = Encoder()
    reads = _built(m, torch.randn(2, 4))
    assert reads.values.paths() == ["Encoder.config.is_decoder"]
    m.config.use_cache = False  # (HF's Trainer does this): nothing the graph read
    assert not reads.values.changed()


def test_the_first_capture_finds_the_values_the_models_code_read() -> None:
    m = Model().eval()
    reads = _built(m, torch.randn(2, 4))
    paths = set(reads.values.paths())
    assert {"Model.scale", "Model.adapter._disable_adapters", "Model.adapter.scaling",
            "Model.adapter.active"} <= paths, paths
    assert any(p.endswith("config.mode") for p in paths), paths
    assert "global 'DEBUG' of test_frozen" in paths, paths
    assert "Model.drop.training" in paths, paths  # (torch's Dropout reads its mode: watched)
    assert "Model.drop.p" not in paths, paths  # (its rate, in eval: nothing reads it)


@pytest.mark.parametrize("change", ["scale", "flag", "property", "dict", "list", "global"])
def test_a_value_changed_after_capture_is_found_until_it_is_set_back(change: str) -> None:
    global DEBUG
    m = Model().eval()
    reads = _built(m, torch.randn(2, 4))
    values = reads.values
    assert not values.changed()
    where = {
        "scale": (m, "scale", 3.0), "flag": (m.config, "mode", "add"),
        "property": (m.adapter, "_disable_adapters", True), "global": (None, "DEBUG", True),
    }
    if change == "dict":
        m.adapter.scaling["default"] = 1.0
    elif change == "list":
        m.adapter.active.append("other")
    elif change == "global":
        DEBUG = True
    else:
        obj, attr, value = where[change]
        setattr(obj, attr, value)
    try:
        assert values.changed(), change
        assert "(at capture: " in values.last, values.last
        assert values.changed()  # (each call, while it differs)
    finally:
        DEBUG = False
        m.adapter.scaling["default"] = 0.5
        del m.adapter.active[1:]
        m.scale, m.config.mode, m.adapter._disable_adapters = 2.0, "mul", False
    assert not values.changed()  # set back: replays again


def test_a_value_written_again_unchanged_replays() -> None:
    m = Model().eval()
    reads = _built(m, torch.randn(2, 4))
    m.scale = 2  # (another object, equal: eagerly the same result)
    m.adapter.scaling = dict(m.adapter.scaling)  # (another dict, equal)
    m.unrelated = object()
    values = reads.values
    assert not values.changed()
    m.adapter.scaling["default"] = 1.0  # the new dict, changed
    assert values.changed() and values.last.startswith("Model.adapter.scaling is"), values.last
    m.adapter.scaling["default"] = 0.5
    assert not values.changed()
    del m.adapter._disable_adapters
    assert values.changed() and "is (absent)" in values.last, values.last


def test_a_submodule_switched_alone_is_seen_where_the_models_code_reads_its_mode() -> None:
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Model()

        def forward(self, x):
            return self.inner(x)

    m = Outer().eval()
    reads = _built(m, torch.randn(2, 4))
    assert "Outer.inner.training" in reads.values.paths()  # (Model's forward reads it)
    m.inner.training = True  # Outer stays in eval: no mode change of the graphed module
    assert reads.values.changed() and reads.values.last == "Outer.inner.training is True (at capture: False)"


def test_torch_layers_are_watched_for_their_mode_and_while_training_their_rates() -> None:
    from torchreplay.core.frozen import layer_reads

    assert {"p", "training", "inplace"} <= set(layer_reads(nn.Dropout.forward.__code__))
    assert layer_reads(nn.Module.__call__.__code__) == ()  # (nn.Module's own: every module's state)
    assert layer_reads(Model.forward.__code__) == ()  # (the user's code: traced line by line)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 3, padding=1)
            self.bn = nn.BatchNorm2d(2)
            self.drop = nn.Dropout(0.25)
            self.norm = nn.LayerNorm(8)

        def forward(self, x):
            return self.norm(self.drop(torch.relu(self.bn(self.conv(x)))))

    x = torch.randn(2, 2, 8, 8)
    paths = set(_built(Net().eval(), x).values.paths())
    assert paths == {"Net.bn.training", "Net.drop.training"}, paths  # (the rates matter in training only)
    mc = Net().eval()
    reads = _built(mc, x)
    mc.drop.train()  # MC dropout: the model in eval, its dropout sampling
    assert reads.values.changed() and reads.values.last == "Net.drop.training is True (at capture: False)"
    trained = Net().train()
    reads = _built(trained, x)
    paths = set(reads.values.paths())
    assert {"Net.bn.training", "Net.bn.momentum", "Net.bn.eps", "Net.drop.training", "Net.drop.p"} == paths, paths
    for where, name, value in ((trained.drop, "p", 0.5), (trained.bn, "momentum", 0.2), (trained.bn, "training", False)):
        before = getattr(where, name)
        setattr(where, name, value)
        assert reads.values.changed() and reads.values.last.startswith(f"Net.{'drop' if where is trained.drop else 'bn'}.{name} is")
        setattr(where, name, before)
        assert not reads.values.changed()
    trained.conv.stride = (2, 2)  # (a shape: not watched)
    assert not reads.values.changed()


def test_values_read_inside_an_eager_part_are_not_the_graphs() -> None:
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Model()
            self.scale = 2.0

        def forward(self, x):
            return self.inner(x) * self.scale

    m = Outer().eval()
    ps = PyState("m", m, (torch.randn(2, 4),), {}, reads=True)
    ps.start()
    ps.before_capture()
    inner_forward = m.inner.forward

    def in_part(x):
        with ps.eager_part("inner"):
            return inner_forward(x)

    m.inner.forward = in_part
    with ps.captured(CPU):
        m(torch.randn(2, 4))
    assert ps.verdict() is None
    del m.inner.forward
    paths = ps.reads().values.paths()
    assert paths == ["Outer.scale"], paths


def test_a_debugger_running_leaves_the_values_unwatched_and_its_trace_in_place() -> None:
    import sys

    def debugger(frame, event, arg):
        return None

    before = sys.gettrace()
    sys.settrace(debugger)
    try:
        with FrozenWatch() as watch:
            Model()(torch.randn(2, 4))
        assert sys.gettrace() is debugger and not watch.found
    finally:
        sys.settrace(before)


def test_a_frame_whose_locals_cannot_be_followed_is_skipped() -> None:
    class Odd:
        __slots__ = ("flag",)

        def __init__(self) -> None:
            self.flag = True

    def f(o):
        return 1 if o.flag else 0

    watch = FrozenWatch()
    with watch:
        f(Odd())
        f(types.SimpleNamespace(flag=True))
    assert [k for (_, k) in watch.found] == ["flag"]  # the namespace's, not the slot's


@pytest.fixture
def graphs(monkeypatch):
    import test_buckets

    test_buckets.install_cpu_graphs(monkeypatch.setattr)


@pytest.mark.parametrize("front", ["graph", "sizes"])
def test_a_graph_runs_calls_eagerly_while_a_value_its_model_read_differs(graphs, front, caplog) -> None:
    m = Model().eval()
    x = torch.randn(4, 4)
    g = tr.graph(m, x, **({"sizes": [2, 4]} if front == "sizes" else {}))
    with torch.no_grad():
        torch.testing.assert_close(g(x), m.forward(x))
        replays, fallbacks = g.stats.replays, g.stats.fallbacks
        m.adapter._disable_adapters = True
        for _ in range(2):
            torch.testing.assert_close(g(x), m.adapter.base(x) * 2.0)  # eagerly: the base alone
        assert (g.stats.replays, g.stats.fallbacks) == (replays, fallbacks + 2)
        assert caplog.text.count("Model.adapter._disable_adapters is True (at capture: False)") == 1
        m.adapter._disable_adapters = False
        torch.testing.assert_close(g(x), m.forward(x))
        assert (g.stats.replays, g.stats.fallbacks) == (replays + 1, fallbacks + 2)
    report = tr.explain(g)
    assert "watches " in report and "Model.adapter._disable_adapters" in report, report


@pytest.fixture
def training_graphs(monkeypatch):
    import test_buckets
    import test_training
    from torchreplay.training import callables as training

    test_buckets.install_cpu_graphs(monkeypatch.setattr)
    monkeypatch.setattr(training, "_capture_pairs", test_training._emulated_capture_pairs)
    monkeypatch.setattr(training, "infer_device", lambda fn, call, device=None: torch.device("cpu"))


def test_a_model_graphed_for_training_runs_eagerly_while_a_value_differs(training_graphs, caplog) -> None:
    torch.manual_seed(0)
    m = Model().train()
    ref = Model().train()
    ref.load_state_dict(m.state_dict())
    tr.make_graphed_callables(m, (torch.randn(4, 4, requires_grad=True),))
    stats = m.forward.stats
    assert "Model.adapter._disable_adapters" in m.forward._values.paths()
    for flag in (False, True, True, False):
        m.adapter._disable_adapters = ref.adapter._disable_adapters = flag
        x = torch.randn(4, 4)
        out, want = m(x), ref(x)
        torch.testing.assert_close(out, want)
        out.sum().backward()
        want.sum().backward()
        for p, q in zip(m.parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None)
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad)
    assert stats.fallbacks == 2
    assert caplog.text.count("Model.adapter._disable_adapters is True (at capture: False)") == 1


def test_a_capture_that_raises_leaves_no_trace_function_behind() -> None:
    import sys

    before = sys.gettrace()

    def failing(x):
        if DEBUG is False:
            raise RuntimeError("operation not permitted when stream is capturing")
        return x

    with pytest.raises(RuntimeError, match="not permitted"):
        with FrozenWatch() as watch:
            failing(torch.randn(2))
    assert sys.gettrace() is before
    assert [k for (_, k) in watch.found] == (["DEBUG"] if before is None else [])


def test_a_modules_values_are_compared_after_a_write_to_a_module_and_others_at_every_call() -> None:
    """Python >= 3.12 counts the calls of ``nn.Module.__setattr__`` and ``__delattr__``
    (``sys.monitoring``): a module's plain values are compared only after one, any module's.
    A write around them (``m.__dict__[k] = v``) is seen at the next counted write, not before.
    A plain object's values, a global and a dict's items are compared at every call. On older
    Pythons every value is compared at every call."""
    import sys

    from torchreplay.core.frozen import counted_writes

    m = Model().eval()
    values = _built(m, torch.randn(2, 4)).values
    counted = hasattr(sys, "monitoring")
    assert counted_writes(Model) is counted and counted_writes(nn.Dropout) is counted
    assert not counted_writes(Config) and not counted_writes(types.SimpleNamespace)
    assert not values.changed()
    m.__dict__["scale"] = 3.0  # (around __setattr__)
    assert values.changed() is not counted
    m.drop.unrelated = 1  # any module's write: compared again
    assert values.changed() and values.last == "Model.scale is 3.0 (at capture: 2.0)", values.last
    m.scale = 2.0
    assert not values.changed()
    for change, back in ((lambda: setattr(m.config, "mode", "add"), lambda: setattr(m.config, "mode", "mul")),
                         (lambda: m.adapter.scaling.update(default=2.0), lambda: m.adapter.scaling.update(default=0.5))):
        change()  # (no module written)
        assert values.changed()
        back()
        assert not values.changed()


def test_writes_made_while_the_events_are_off_are_seen_by_every_graph() -> None:
    """The first module write after a check turns the write events off until the next check
    (a burst such as ``model.train()`` costs one event). Two graphs watching one module, checks
    interleaved with writes: a value written while the events were off is seen by both."""
    import sys

    from torchreplay.core import frozen

    m = Model().eval()
    a = _built(m, torch.randn(2, 4)).values
    b = _built(m, torch.randn(2, 4)).values
    assert not a.changed() and not b.changed()
    m.unrelated = 1  # (events off, where counted)
    assert bool(frozen._DISARMED) is hasattr(sys, "monitoring")
    assert not a.changed() and not frozen._DISARMED  # (back on)
    m.unrelated = 2
    assert not b.changed()
    m.unrelated = 3
    m.scale = 3.0  # (made while the events are off)
    assert a.changed() and b.changed() and b.last == "Model.scale is 3.0 (at capture: 2.0)", b.last
    m.train()  # a burst: one write a module
    m.eval()
    m.scale = 2.0
    assert not a.changed() and not b.changed()
    for _ in range(3):  # nothing written: no comparison needed, none made
        assert not a.changed() and not frozen._DISARMED


def test_a_write_made_by_torch_compiled_code_is_seen() -> None:
    """Dynamo replays a compiled frame's attribute writes after its graph, by code it
    generates (not always through the class's ``__setattr__``): the write to a watched module
    value, from a compiled function and from a compiled module's forward, is seen at the next
    check (counted on Python >= 3.12, compared on older ones)."""
    m = Model().eval()
    values = _built(m, torch.randn(2, 4)).values
    assert not values.changed()

    def write(mod: nn.Module, y: torch.Tensor) -> torch.Tensor:
        mod.scale = 3.0
        return y * 2

    class Holder(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, y: torch.Tensor) -> torch.Tensor:
            self.inner.scale = 5.0
            return y + 1

    torch.compile(write, backend="eager")(m, torch.randn(2))
    assert values.changed() and values.last == "Model.scale is 3.0 (at capture: 2.0)", values.last
    m.scale = 2.0
    assert not values.changed()
    torch.compile(Holder(m), backend="eager")(torch.randn(2))
    assert values.changed() and values.last == "Model.scale is 5.0 (at capture: 2.0)", values.last
