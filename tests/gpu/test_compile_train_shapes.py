"""Training through the compile backend when the shapes a compiled block sees change from layer
to layer and step to step (a mixture of experts: each layer's experts get their own token counts),
with an eager autograd op after each block that saves the block's output. Compared with eager on
fresh random inputs: the loss and every gradient at each step."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.usefixtures("fresh_dynamo"),
]

DEV = "cuda"


class _SaveInput(torch.autograd.Function):
    """An eager op that saves its input for its backward (as transformers' grouped-mm fallback
    does in HF Mixtral, after a graph break)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 2 + x.cos() * g  # reads the saved input


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        return torch.nn.functional.gelu(self.lin(x))


def test_an_eager_op_saving_a_blocks_output_at_a_new_shape_trains_like_eager() -> None:
    """Step 2: layer 0 at 5 rows is captured at a later pool position than layer 1's 8-row
    entry; layer 1's replay may write where layer 0's output lies, which the eager op saved.
    That replay must not overwrite it (a copy of the graph replays), nor mark it stale. (This small
    model does not reproduce HF Mixtral's stale read without that wait: it passed on an H200
    with the wait turned off; ``test_mixtral_trains_like_eager`` does.)"""
    from torchreplay.compile.backend import torchreplay_backend

    torch.manual_seed(0)
    layers = [_Block().to(DEV) for _ in range(2)]
    ref = [_Block().to(DEV) for _ in range(2)]
    for r, m in zip(ref, layers):
        r.load_state_dict(m.state_dict())
        m.compile(backend=torchreplay_backend)
    for step, rows in enumerate([(8, 8), (8, 8), (5, 8), (8, 5), (3, 8), (8, 8), (5, 8)]):
        x = torch.randn(8, 64, device=DEV)
        losses = []
        for blocks in (layers, ref):
            h = x
            for block, r in zip(blocks, rows):
                h = _SaveInput.apply(block(h[:r]))
            loss = h.square().mean()
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=2e-3, atol=2e-3)
        for k, (m, r) in enumerate(zip(layers, ref)):
            torch.testing.assert_close(m.lin.weight.grad, r.lin.weight.grad, rtol=2e-3, atol=2e-3,
                                       msg=lambda msg, k=k: f"step {step} layer {k}: {msg}")
            m.zero_grad()
            r.zero_grad()
