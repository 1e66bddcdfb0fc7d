"""A graphed callable called from code that ``torch.compile`` traces: Dynamo does not trace into
our replay path (it broke there several times and compiled it again at every call); the call is
one graph break and runs as it does outside, its result equal to eager. Through the emulated
captures of test_buckets and test_training (tests/gpu/test_under_compile.py runs the real ones)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchreplay as tr
from torchreplay.training import callables as training

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters  # noqa: E402


@pytest.fixture
def fresh_dynamo():
    dynamo.reset()
    counters.clear()
    yield
    dynamo.reset()


def _frames() -> int:
    return counters["frames"]["total"]


def _breaks_outside_us() -> list[str]:
    """The graph breaks Dynamo made that are not at the call of a graphed callable."""
    return [r for r in counters["graph_break"] if "torchreplay_call_outside_torch_compile" not in r]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).eval()


@pytest.mark.parametrize("sizes", [None, [4, 8]], ids=["one_shape", "sizes"])
def test_a_graph_called_from_compiled_code_is_one_graph_break_and_equals_eager(
    monkeypatch, fresh_dynamo, sizes
) -> None:
    import test_buckets

    test_buckets.install_cpu_graphs(monkeypatch.setattr)
    model = _mlp()
    g = tr.graph(model, torch.randn(4, 8), sizes=sizes)

    def outer(x):
        return g(x * 2) + 1

    compiled = torch.compile(outer, backend="eager")
    with torch.no_grad():
        for i in range(12):
            x = torch.randn(4 if i % 2 or sizes is None else 3, 8)
            torch.testing.assert_close(compiled(x), model(x * 2) + 1)
            if i == 2:
                frames = _frames()
    assert _frames() == frames, "Dynamo compiled frames again after the third call"
    assert g.stats.replays == 12 and g.stats.fallbacks == 0
    assert not _breaks_outside_us(), _breaks_outside_us()


def test_a_model_graphed_for_training_called_from_compiled_code_trains_as_eager(
    monkeypatch, fresh_dynamo
) -> None:
    import test_buckets
    import test_training

    monkeypatch.setattr(training, "_capture_pairs", test_training._emulated_capture_pairs)
    monkeypatch.setattr(training, "infer_device", lambda fn, call, device=None: torch.device("cpu"))
    test_buckets.as_cpu_build(monkeypatch.setattr)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    ref = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    ref.load_state_dict(model.state_dict())
    tr.make_graphed_callables(model, (torch.randn(3, 6),))

    def loss_of(m, x):
        return (m(x).tanh() * 3).pow(2).sum()

    compiled = torch.compile(loss_of, backend="eager")
    for i in range(6):
        x = torch.randn(3, 6)
        compiled(model, x).backward()
        loss_of(ref, x).backward()
        for (n, a), b in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, msg=n)
        if i == 2:
            frames = _frames()
    assert _frames() == frames, "Dynamo compiled frames again after the third call"
    assert model.forward.stats.replays == 6 and model.forward.stats.backward_replays == 6
    assert not _breaks_outside_us(), _breaks_outside_us()


def test_a_graphed_step_called_from_compiled_code_steps_as_eager(monkeypatch, fresh_dynamo) -> None:
    import test_buckets
    import test_training

    monkeypatch.setattr(test_training.step_mod, "capture", test_training._emulated_step_capture)
    monkeypatch.setattr(test_training.step_parts_mod, "infer_device", lambda fn, call, device=None: torch.device("cpu"))
    monkeypatch.setattr(test_training.step_mod, "side_stream", lambda device: None)
    test_buckets.as_cpu_build(monkeypatch.setattr)
    model, opt = test_training._make_training()
    ref_model, ref_opt = test_training._make_training()
    step = tr.graph_step(test_training._sgd_step(model, opt), torch.randn(5, 6), torch.randn(5, 3))
    ref_step = test_training._sgd_step(ref_model, ref_opt)

    def logged(x, y):
        return step(x * 1.0, y).detach() * 2

    compiled = torch.compile(logged, backend="eager")
    for i in range(6):
        x, y = torch.randn(5, 6), torch.randn(5, 3)
        torch.testing.assert_close(compiled(x, y), ref_step(x, y).detach() * 2)
        if i == 2:
            frames = _frames()
    for (n, a), b in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, msg=n)
    assert _frames() == frames, "Dynamo compiled frames again after the third call"
    assert step.stats.replays == 6
    assert not _breaks_outside_us(), _breaks_outside_us()
