"""Inputs laid out otherwise than contiguously through the torch.compile backend: Inductor's code
asserts the strides of each input it was compiled for, so every copy the runtime makes of one (a
static input buffer, a graph's own buffer of what an eager step made, a put-back after the first
call) keeps them. Each test compares with eager on fresh random inputs over many calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchreplay as tr

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.usefixtures("fresh_dynamo"),
]

DEV = "cuda"
CALLS = 8
B, S, D, H = 4, 16, 32, 2


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3, msg=lambda m: f"{what}: {m}")


@torch.library.custom_op("trlayout::spread_rows", mutates_args=())
def _spread_rows(x: torch.Tensor) -> torch.Tensor:
    """An eager step (a splitting op) returning an expanded tensor: each row's mean, over the
    columns (stride 0)."""
    return x.mean(-1, keepdim=True).expand(x.shape)


@_spread_rows.register_fake
def _(x):
    return x.new_empty(*x.shape[:-1], 1).expand(x.shape)


def _spread_rows_backward(ctx, grad: torch.Tensor) -> torch.Tensor:
    return grad.sum(-1, keepdim=True).expand(grad.shape) / grad.shape[-1]


_spread_rows.register_autograd(_spread_rows_backward)


class _Attention(nn.Module):
    """Reads a transposed input and an additive mask expanded over heads and queries (as HF
    BART's and DeBERTa's are), and, after an eager step, the expanded value it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x_t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x_t.transpose(1, 2)  # (B, S, D) from (B, D, S)
        q, k, v = self.qkv(x).view(x.shape[0], S, 3, H, D // H).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = self.out(a.transpose(1, 2).reshape(x.shape[0], S, D))
        return h * torch.ops.trlayout.spread_rows(h).sigmoid()


def _inputs(b: int = B) -> tuple[torch.Tensor, torch.Tensor]:
    x_t = torch.randn(b, D, S, device=DEV)  # passed as (B, D, S): the model transposes it
    mask = torch.randn(b, 1, 1, S, device=DEV).expand(b, H, S, S)  # stride 0 over heads, queries
    return x_t, mask


def _strided_inputs(b: int = B) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's inputs as views: ``x_t`` transposed in memory, ``mask`` expanded."""
    x_t = torch.randn(b, S, D, device=DEV).transpose(1, 2)
    mask = torch.randn(b, 1, 1, S, device=DEV).expand(b, H, S, S)
    return x_t, mask


def _runtimes(c: tr.Compiled) -> list:
    return c.backend.runtimes


def test_transposed_and_expanded_inputs_keep_their_strides_in_inference() -> None:
    model = _Attention().to(DEV).eval()
    c = tr.compile(model, splitting_ops=["trlayout.spread_rows"])
    with torch.no_grad():
        for i in range(CALLS):
            x_t, mask = _strided_inputs()
            _close(c(x_t, mask), model(x_t, mask), f"call {i}")
    rts = _runtimes(c)
    assert rts and all(r.stats.fallbacks == 0 for r in rts), tr.explain(c)
    assert sum(r.stats.replays for r in rts) >= CALLS - 1, tr.explain(c)


def test_transposed_and_expanded_inputs_keep_their_strides_in_training() -> None:
    """HF BART and DeBERTa-v2 trained through the backend: the forward graph's input was an
    expanded mask and a transposed activation; the runtime copied them into contiguous buffers
    and Inductor's code refused them ("expected size 16==16, stride 16==1")."""
    torch.manual_seed(0)
    model = _Attention().to(DEV).train()
    ref = _Attention().to(DEV).train()
    ref.load_state_dict(model.state_dict())
    c = tr.compile(model, splitting_ops=["trlayout.spread_rows"])
    for step in range(CALLS):
        x_t, mask = _strided_inputs()
        x_t.requires_grad_(True)
        x_ref = x_t.detach().clone().requires_grad_(True)  # (the same values and layout)
        loss = c(x_t, mask).square().mean()
        loss_ref = ref(x_ref, mask).square().mean()
        loss.backward()
        loss_ref.backward()
        _close(loss, loss_ref, f"loss at step {step}")
        _close(x_t.grad, x_ref.grad, f"input grad at step {step}")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            _close(p.grad, q.grad, f"{name}.grad at step {step}")
        model.zero_grad()
        ref.zero_grad()
    rts = _runtimes(c)
    assert any(r.name.endswith("backward") for r in rts), [r.name for r in rts]
    for r in rts:
        assert r.stats.captures >= 1 and r.stats.fallbacks == 0, (r.name, r.fallback_reasons)


def test_sizes_pad_a_transposed_input_and_keep_an_expanded_mask_expanded() -> None:
    """With ``sizes=`` the buffers are padded along the rows: a transposed input's buffer is
    laid out as the input (its rows outermost: every size shares it), and the mask's expanded
    dimensions stay expanded (its padding rows are the rows' own)."""
    model = _Attention().to(DEV).eval()
    c = tr.compile(model, sizes=[2, 4, 8], splitting_ops=["trlayout.spread_rows"])
    with torch.no_grad():
        for i, b in enumerate([3, 8, 2, 5, 4, 7, 1, 6]):
            x_t, mask = _strided_inputs(b)
            _close(c(x_t, mask), model(x_t, mask), f"call {i}, {b} rows")
    rts = _runtimes(c)
    assert all(r.stats.fallbacks == 0 for r in rts), tr.explain(c)
    assert any(r.stats.padded_rows > 0 for r in rts), tr.explain(c)
