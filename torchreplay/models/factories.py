"""Factories for ``torchreplay check`` and ``torchreplay bench --factory``: each returns
``(fn, args)`` or ``(fn, args, kwargs)`` ready to call, on CUDA when it is available, else the CPU.

Usage::

    torchreplay check torchreplay.models.factories:mlp_factory
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from torchreplay.models.cnn import resnet50
from torchreplay.models.llama import TINY, LlamaConfig, build_llama
from torchreplay.models.mlp import MLPConfig, build_mlp

__all__ = ["default_device", "mlp_factory", "resnet50_factory", "llama_factory", "tiny_llama_factory"]

Factory = Callable[[], tuple[Any, ...]]


def default_device() -> torch.device:
    """Return ``cuda`` when it is available, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def mlp_factory(batch: int = 8) -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    """The benchmark MLP (24 x Linear(512, 512) + ReLU, fp32) and an input ``[batch, 512]``."""
    device = default_device()
    model = build_mlp(MLPConfig(), device)
    x = torch.randn(batch, model.config.width, device=device)
    return model, (x,)


def resnet50_factory(batch: int = 1) -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    """ResNet-50 (eval mode, fp32) and an image batch ``[batch, 3, 224, 224]``."""
    device = default_device()
    model = resnet50(device).eval()
    return model, (torch.randn(batch, 3, 224, 224, device=device),)


def llama_factory(
    batch: int = 1, config: LlamaConfig | None = None
) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The built-in Llama and one decode step's ``(input_ids [B, 1], positions [B])``.

    The default config on CUDA, :data:`~torchreplay.models.llama.TINY` on the CPU.
    """
    device = default_device()
    if config is None:
        config = LlamaConfig() if device.type == "cuda" else TINY
    model = build_llama(config, device)
    input_ids = torch.randint(0, config.vocab_size, (batch, 1), device=device)
    positions = torch.full((batch,), config.max_seq_len // 2, dtype=torch.long, device=device)
    return model, (input_ids, positions)


def tiny_llama_factory() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """:func:`llama_factory` with the tiny config on any device (fast to build)."""
    return llama_factory(batch=2, config=TINY)
