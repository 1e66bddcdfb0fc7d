"""Graphed callables called from code that ``torch.compile`` traces (Inductor): each call is one
graph break and runs as it does outside (Dynamo traced our replay path before, broke in it and
compiled it again at every call). Each result against eager over many calls with fresh random
inputs; Dynamo compiles no frame after the first calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchreplay as tr

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEV = "cuda"
CLOSE = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(autouse=True)
def dynamo_counted(fresh_dynamo, full_fp32_matmul):
    """Dynamo's counters, cleared (with its caches: fresh_dynamo)."""
    from torch._dynamo.utils import counters

    counters.clear()
    return counters


def _frames(counters) -> int:
    return counters["frames"]["total"]


def _breaks_elsewhere(counters) -> list[str]:
    return [r for r in counters["graph_break"] if "torchreplay_call_outside_torch_compile" not in r]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).to(DEV).eval()


@pytest.mark.parametrize("sizes", [None, [4, 8, 16]], ids=["one_shape", "sizes"])
def test_a_graph_called_from_compiled_code_equals_eager_without_recompiles(dynamo_counted, sizes) -> None:
    model = mlp()
    g = tr.graph(model, torch.randn(8, 64, device=DEV), sizes=sizes)

    def outer(x):
        return torch.sigmoid(g(x * 2 - 1)) + x.mean()

    compiled = torch.compile(outer)
    rows = [8] * 20 if sizes is None else [3, 8, 16, 5, 1, 12, 8, 7, 2, 16] * 2
    kept = []
    with torch.no_grad():
        for i, n in enumerate(rows):
            x = torch.randn(n, 64, device=DEV)
            y = compiled(x)
            torch.testing.assert_close(y, torch.sigmoid(model(x * 2 - 1)) + x.mean(), **CLOSE)
            kept.append((x, y))
            if i == 9:  # every row count seen: Dynamo compiles the caller for new shapes
                frames = _frames(dynamo_counted)
        for x, y in kept:  # outputs kept across calls hold their own values
            torch.testing.assert_close(y, torch.sigmoid(model(x * 2 - 1)) + x.mean(), **CLOSE)
    assert _frames(dynamo_counted) == frames, "Dynamo compiled frames again for shapes it had seen"
    assert g.stats.replays == len(rows) and g.stats.fallbacks == 0
    assert not _breaks_elsewhere(dynamo_counted)


def host_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Reads ``gate`` (a CPU tensor) on the host: a break."""
    return x * float(gate.sum())


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x, gate):
        return self.b(host_gate(torch.relu(self.a(x)), gate))


def test_a_breakable_graph_called_from_compiled_code_equals_eager(dynamo_counted) -> None:
    torch.manual_seed(0)
    model = Gated().to(DEV).eval()
    g = tr.graph(model, torch.randn(4, 32, device=DEV), torch.rand(3), breaks=[host_gate])
    assert isinstance(g, tr.BreakableGraph)
    compiled = torch.compile(lambda x, gate: g(x, gate).tanh() * 3)
    with torch.no_grad():
        for i in range(15):
            x, gate = torch.randn(4, 32, device=DEV), torch.rand(3)
            torch.testing.assert_close(compiled(x, gate), model(x, gate).tanh() * 3, **CLOSE)
            if i == 3:
                frames = _frames(dynamo_counted)
    assert _frames(dynamo_counted) == frames
    assert g.stats.replays == 15 and g.stats.fallbacks == 0
    assert not _breaks_elsewhere(dynamo_counted)


def test_a_model_graphed_for_training_called_from_compiled_code_trains_as_eager(dynamo_counted) -> None:
    model, ref = mlp().train(), mlp().train()
    tr.make_graphed_callables(model, (torch.randn(8, 64, device=DEV, requires_grad=True),))

    def loss_of(m, x):
        return (m(x).tanh() * 3).pow(2).mean()

    compiled = torch.compile(loss_of)
    for i in range(10):
        x = torch.randn(8, 64, device=DEV, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        loss = compiled(model, x)
        loss.backward()
        want = loss_of(ref, x_ref)
        want.backward()
        torch.testing.assert_close(loss, want, **CLOSE)
        torch.testing.assert_close(x.grad, x_ref.grad, **CLOSE)
        for (n, a), b in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, msg=n, **CLOSE)
        if i == 3:
            frames = _frames(dynamo_counted)
    assert _frames(dynamo_counted) == frames
    assert model.forward.stats.replays == 10 and model.forward.stats.backward_replays == 10
    assert not _breaks_elsewhere(dynamo_counted)
