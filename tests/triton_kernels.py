"""Triton kernels for the GPU tests (imported only where Triton is; CI has none): a SiLU whose
forward and backward are Triton launches, wrapped in a ``torch.autograd.Function`` whose
backward is twice SiLU's derivative (so gradients tell whether it ran), and a raw launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def silu_forward(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(x_ptr + i, mask=m).to(tl.float32)
    tl.store(y_ptr + i, x * tl.sigmoid(x), mask=m)


@triton.jit
def silu_backward(x_ptr, g_ptr, d_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(x_ptr + i, mask=m).to(tl.float32)
    g = tl.load(g_ptr + i, mask=m).to(tl.float32)
    s = tl.sigmoid(x)
    tl.store(d_ptr + i, 2.0 * g * (s + x * s * (1.0 - s)), mask=m)


def silu(x: torch.Tensor) -> torch.Tensor:
    """A raw launch: no op of it reaches torch's dispatcher."""
    x = x.contiguous()
    y = torch.empty_like(x)
    silu_forward[(triton.cdiv(x.numel(), BLOCK),)](x, y, x.numel(), BLOCK=BLOCK)
    return y


class TritonSiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return silu(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        grad = grad.contiguous()
        d = torch.empty_like(x)
        silu_backward[(triton.cdiv(x.numel(), BLOCK),)](x, grad, d, x.numel(), BLOCK=BLOCK)
        return d
