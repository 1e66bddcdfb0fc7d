"""PEFT's LoRA layer in small, for the tests of the plain values a graph froze (core/frozen.py):
a flag read through a property (``disable_adapters``), a dict of scales, a list of active
adapters, all plain Python values its forward reads."""

from __future__ import annotations

import torch
import torch.nn as nn


class Lora(nn.Module):
    def __init__(self, width: int = 16, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(width, width)
        self.a = nn.Linear(width, rank, bias=False)
        self.b = nn.Linear(rank, width, bias=False)
        self._disable_adapters = False
        self.scaling = {"default": 0.5}
        self.active = ["default"]

    @property
    def disable_adapters(self) -> bool:
        return self._disable_adapters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.disable_adapters:
            return y
        for name in self.active:
            y = y + self.b(self.a(x)) * self.scaling[name]
        return y
