"""Factories for ``torchreplay check`` and ``torchreplay bench --factory``: each returns
``(fn, args)`` or ``(fn, args, kwargs)`` ready to call, on CUDA when it is available, else the CPU.

One factory per row of ``torchreplay bench`` (:data:`ROW_FACTORIES`): without CUDA, ``bench``
checks the row's call with ``torchreplay check`` instead of timing it. The training factories
return a ``train_step(x, target)`` that runs the whole step (zero_grad, forward, loss, backward,
AdamW), so the check covers the training code and not only the forward.

Usage::

    torchreplay check torchreplay.models.factories:mlp_factory
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F

from torchreplay.models.cnn import resnet50
from torchreplay.models.llama import TINY, LlamaConfig, build_llama
from torchreplay.models.mlp import MLPConfig, build_mlp

__all__ = [
    "default_device",
    "mlp_factory",
    "resnet50_factory",
    "llama_factory",
    "llama_sizes_factory",
    "llama_breaks_factory",
    "tiny_llama_factory",
    "mlp_train_factory",
    "resnet50_train_factory",
    "ROW_FACTORIES",
]

Factory = Callable[[], tuple[Any, ...]]
TrainStep = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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


def llama_sizes_factory() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The ``llama-sizes`` row's call: a decode step at batch 13 with a KV cache of 32 rows.

    The row graphs batch sizes 1 to 32 and pads 13 to 16; the eager call is the same code at
    any batch. The default config on CUDA, :data:`~torchreplay.models.llama.TINY` on the CPU.
    """
    cuda = default_device().type == "cuda"
    config = LlamaConfig(max_batch=32) if cuda else dataclasses.replace(TINY, max_batch=32)
    return llama_factory(batch=13, config=config)


def llama_breaks_factory() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The ``llama-breaks`` row's call: a decode step at batch 8 whose attention reads host-side
    lengths (``positions + 1`` on the CPU; :func:`~torchreplay.models.llama.host_attention`).
    ``torchreplay check`` finds what the row breaks at."""
    model, (ids, positions) = llama_factory(batch=8 if default_device().type == "cuda" else 2)
    return model, (ids, positions, (positions + 1).cpu())


def tiny_llama_factory() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """:func:`llama_factory` with the tiny config on any device (fast to build)."""
    return llama_factory(batch=2, config=TINY)


def _train_step(model: torch.nn.Module,
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> TrainStep:
    """Return ``train_step(x, target)``: the whole training step of the training rows."""
    params = list(model.parameters())
    # The rows step with AdamW(capturable=True), which keeps its step counts on the GPU and
    # refuses CPU parameters. On the CPU the fused AdamW keeps them in tensors too; the default
    # (foreach) AdamW would read each one with .item(), a finding that the GPU step does not have.
    on_cuda = params[0].device.type == "cuda"
    opt = torch.optim.AdamW(params, lr=1e-4, **({"capturable": True} if on_cuda else {"fused": True}))

    def train_step(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), target)
        loss.backward()
        opt.step()
        return loss

    return train_step


def mlp_train_factory(batch: int = 8) -> tuple[TrainStep, tuple[torch.Tensor, torch.Tensor]]:
    """The ``mlp-train`` row's call: an AdamW training step of the benchmark MLP (MSE loss) on
    ``x, target [batch, 512]``."""
    device = default_device()
    model = build_mlp(MLPConfig(), device)
    x = torch.randn(batch, model.config.width, device=device)  # [B, 512]
    target = torch.randn(batch, model.config.width, device=device)  # [B, 512]
    return _train_step(model, F.mse_loss), (x, target)


def resnet50_train_factory(batch: int = 1) -> tuple[TrainStep, tuple[torch.Tensor, torch.Tensor]]:
    """The ``resnet50-train`` row's call: an AdamW training step of ResNet-50 (training mode,
    cross-entropy) on images ``[batch, 3, 224, 224]`` and labels ``[batch]``."""
    device = default_device()
    model = resnet50(device).train()
    x = torch.randn(batch, 3, 224, 224, device=device)  # [B, 3, 224, 224]
    labels = torch.randint(0, 1000, (batch,), device=device)  # [B]
    return _train_step(model, F.cross_entropy), (x, labels)


#: The factory of each ``torchreplay bench`` row, as ``module:function``: what ``bench`` checks
#: in place of timing the row on a machine without CUDA. Keys and order are the bench's rows.
ROW_FACTORIES: Mapping[str, str] = MappingProxyType({
    row: f"{__name__}:{factory.__name__}"
    for row, factory in (
        ("mlp", mlp_factory),
        ("resnet50", resnet50_factory),
        ("llama", llama_factory),
        ("llama-sizes", llama_sizes_factory),
        ("llama-breaks", llama_breaks_factory),
        ("mlp-train", mlp_train_factory),
        ("resnet50-train", resnet50_train_factory),
    )
})
