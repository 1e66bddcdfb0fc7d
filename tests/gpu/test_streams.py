"""One graph called on two CUDA streams in turn, with no synchronize between the calls.

Eagerly, two calls on two streams use memory of their own, so each result is its own input's,
whatever order the GPU runs them in. A graph's calls share its static buffers and pool: the
second call's copy-in could overwrite the input that the first call's replay is still reading,
and its replay the output that the first call's stream is still copying out. A call on another
stream than the pool's last call therefore waits for that stream first (core/pool.py
``Pool.on_stream``). Each call here is about a millisecond of GPU work, so unordered calls
overlap, and every result is compared with eager's on fresh random inputs.
"""

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
ROUNDS = 8


def slow_model() -> nn.Module:
    """About a millisecond of GPU work per call at 256 rows."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(16):
        layers += [nn.Linear(2048, 2048), nn.Tanh()]
    return nn.Sequential(*layers).to(DEV)


def on(stream: torch.cuda.Stream, f, *xs: torch.Tensor):
    """Run ``f(*xs)`` on ``stream`` (which first waits for the inputs made on the current one)."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        return f(*xs)


def alternate(g, model: nn.Module, rows: int = 256) -> None:
    """``g`` on stream 1 (``rows`` rows), then on stream 2 (256), ROUNDS times, no synchronize
    between; each result against ``model``'s."""
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    for _ in range(ROUNDS):
        x1 = torch.randn(rows, 2048, device=DEV)
        x2 = torch.randn(256, 2048, device=DEV)
        y1 = on(s1, lambda x: g(x).clone(), x1)
        y2 = on(s2, lambda x: g(x).clone(), x2)
        torch.cuda.synchronize()
        torch.testing.assert_close(y1, model(x1), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(y2, model(x2), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sizes", [None, [128, 256]], ids=["one shape", "sizes"])
def test_calls_on_two_streams_each_get_their_own_inputs_result(sizes) -> None:
    model = slow_model().eval()
    with torch.no_grad():
        g = tr.graph(model, torch.randn(256, 2048, device=DEV), sizes=sizes)
        alternate(g, model, rows=256 if sizes is None else 200)


def test_a_graphed_callable_trained_on_two_streams_gets_each_inputs_gradients() -> None:
    """make_graphed_callables: forward and backward of one call on s1, then of the next on
    s2 (a backward runs on its forward's stream), then the gradients, each against eager's."""
    model = slow_model()
    ref = slow_model()
    f = tr.make_graphed_callables(model, (torch.randn(256, 2048, device=DEV),))
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def step(m, x):
        m.zero_grad(set_to_none=True)
        m(x).square().mean().backward()
        return [p.grad.clone() for p in m.parameters()]

    for _ in range(ROUNDS):
        x1 = torch.randn(256, 2048, device=DEV)
        x2 = torch.randn(256, 2048, device=DEV)
        g1 = on(s1, lambda x: step(f, x), x1)
        g2 = on(s2, lambda x: step(f, x), x2)
        torch.cuda.synchronize()
        for got, x in ((g1, x1), (g2, x2)):
            want = step(ref, x)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


class Half(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * 0.5


def test_a_breakable_graph_on_two_streams_gets_each_inputs_result() -> None:
    """breaks= (the piecewise runtime): a break between two halves, called on two streams."""
    model = nn.Sequential(slow_model(), Half(), slow_model()).eval()
    with torch.no_grad():
        g = tr.graph(model, torch.randn(256, 2048, device=DEV), breaks=[Half])
        alternate(g, model)
