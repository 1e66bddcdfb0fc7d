"""A small training step and its eager twin, for the GPU tests of ``graph_step``'s eager calls."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


def twin_steps(device: str) -> tuple[nn.Module, nn.Module, Callable[..., Any], Callable[..., Any]]:
    """Two equal MLPs, each with its AdamW (capturable), and a step for each: zero the grads,
    an MSE loss (computed in float32, whatever the autocast), backward, step; it returns the loss.
    The first step is the one to graph."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).to(device)
    ref = copy.deepcopy(model)

    def make(m: nn.Module) -> Callable[..., Any]:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, capturable=True)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(m(x).float(), y)
            loss.backward()
            opt.step()
            return loss

        return step

    return model, ref, make(model), make(ref)


def history_step(model: nn.Module, opt: torch.optim.Optimizer, hist: torch.Tensor,
                 pos: torch.Tensor) -> Callable[..., Any]:
    """A training step that also writes its loss into ``hist`` at the position counter ``pos``
    and advances it in place (Python state the build's warm-ups write: core/rewind.py)."""

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        hist.index_copy_(0, pos, loss.detach().view(1))
        pos.add_(1)
        return loss

    return train_step
