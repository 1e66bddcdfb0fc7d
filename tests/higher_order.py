"""Training steps that take more from autograd than one first-order backward per forward, for the
recompute tests (training/recompute.py), on the CPU and the GPU: each runs model ``m`` on ``x``
and leaves the gradients in the parameters' ``.grad``."""

from __future__ import annotations

import torch
import torch.nn as nn


def penalty(m: nn.Module, x: torch.Tensor) -> None:
    """A gradient penalty: the parameters' gradients (``create_graph=True``), squared, added to
    the loss."""
    loss = m(x).pow(2).mean()
    gs = torch.autograd.grad(loss, list(m.parameters()), create_graph=True)
    (loss + sum(g.pow(2).sum() for g in gs)).backward()


def pinn(m: nn.Module, x: torch.Tensor) -> None:
    """A physics-informed loss: the derivative of the output with respect to the input, in the
    loss with the output."""
    x = x.clone().requires_grad_(True)
    u = m(x)
    (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
    (du.pow(2).mean() + (u - 1).pow(2).mean()).backward()


def two_losses(m: nn.Module, x: torch.Tensor) -> None:
    """Two losses of one output, one backward each (``retain_graph=True`` on the first)."""
    y = m(x)
    y.pow(2).mean().backward(retain_graph=True)
    y.sin().mean().backward()


STEPS = (penalty, pinn, two_losses)
