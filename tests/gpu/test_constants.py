"""Constants a model makes from Python values on the device (core/constants.py):
``torch.tensor(0.0, device=...)``, a list index, ``new_tensor``, a list written through an
index. Each copies from pageable host memory, which failed the capture ("Cannot copy between CPU
and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned"); fill kernels now
make them inside the graph. Each test compares with eager over many calls with fresh inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchreplay as tr

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.usefixtures("full_fp32_matmul"),  # (tests/conftest.py)
]

DEV = "cuda"
CLOSE = {"rtol": 1e-5, "atol": 1e-5}


class HostConstants(nn.Module):
    """Falcon's split of a fused projection (a list index), transformers' eager mask
    (``torch.tensor(0.0, device=...)`` in a ``torch.where``), a per-channel scale from a list, and
    a list written through an index."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 3 * 16)
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        qkv = self.qkv(x).view(x.shape[0], 3, 16)
        q, k = qkv[:, [0], :], qkv[:, [-2], :]
        mask = q.sum(-1, keepdim=True) > 0
        zero = torch.tensor(0.0, device=x.device, dtype=x.dtype)
        h = torch.where(mask, zero, q * k).squeeze(1)
        h = h * x.new_tensor([0.5, 2.0] * 8)
        h[:, [1, 3]] = x.new_tensor([1.0, -1.0]).expand(x.shape[0], 2)
        return self.out(h)


@pytest.mark.parametrize("sizes", [None, [2, 4, 8]])
def test_host_constants_are_made_inside_the_graph_and_match_eager(sizes) -> None:
    torch.manual_seed(0)
    model = HostConstants().to(DEV).eval()
    g = tr.graph(model, torch.randn(8, 16, device=DEV), sizes=sizes)
    for i in range(30):
        x = torch.randn([8, 3, 5, 8][i % 4] if sizes else 8, 16, device=DEV)
        with torch.no_grad():
            want = model(x)
        torch.testing.assert_close(g(x), want, **CLOSE)
    assert g.stats.fallbacks == 0


def test_a_model_without_host_constants_captures_without_the_mode() -> None:
    """The mode is only for a callable whose warm-up made one (its cost, and a function mode
    is part of what a compiled region is guarded on)."""
    from torchreplay.core import constants

    model = nn.Linear(16, 16).to(DEV)
    tr.graph(model, torch.randn(4, 16, device=DEV))
    assert not constants.remembered(model)
    host = HostConstants().to(DEV).eval()
    tr.graph(host, torch.randn(4, 16, device=DEV))
    assert constants.remembered(host)


def test_training_with_host_constants_matches_eager() -> None:
    import copy

    torch.manual_seed(0)
    model = HostConstants().to(DEV)
    ref = copy.deepcopy(model)
    graphed = tr.make_graphed_callables(model, (torch.randn(8, 16, device=DEV),))
    for _ in range(5):
        x = torch.randn(8, 16, device=DEV)
        graphed(x).square().mean().backward()
        ref(x).square().mean().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **CLOSE)
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
