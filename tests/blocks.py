"""The pre-norm transformer block the GPU tests of breakable graphs build their models from, and
small models the CPU and GPU tests of training share."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn


class Block(nn.Module):
    """``x + attn(n1(x), lengths)``, then ``x + mlp(n2(x))``; ``attention()`` makes the
    attention (the break, in those tests), ``width`` is the hidden size."""

    def __init__(self, attention: Callable[[], nn.Module], width: int) -> None:
        super().__init__()
        self.n1 = nn.LayerNorm(width)
        self.attn = attention()
        self.n2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x, lengths):
        x = x + self.attn(self.n1(x), lengths)
        return x + self.mlp(self.n2(x))


class TwoOutputs(nn.Module):
    """``h = tanh(a(x))`` and ``y = b(h)``, both returned: a loss may use either or both, and
    what only ``y`` reaches (``b``) gets no gradient, eagerly, from a loss over ``h`` alone."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x).tanh()
        return h, self.b(h)
