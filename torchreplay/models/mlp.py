"""A plain MLP: the smallest launch-bound workload (one GEMM and one ReLU kernel per layer).

At batch 8 every kernel finishes in a few microseconds, so eager time is almost all Python and
launch overhead; a CUDA graph removes it. This is the first row of ``torchreplay bench``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

__all__ = ["MLPConfig", "MLP", "build_mlp"]


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """Sizes of :class:`MLP`.

    Args:
        depth: number of ``Linear(width, width) + ReLU`` layers.
        width: features in and out of every layer.
    """

    depth: int = 24
    width: int = 512

    def __post_init__(self) -> None:
        if self.depth < 1 or self.width < 1:
            raise ValueError(f"depth and width must be >= 1, got depth={self.depth}, width={self.width}")


class MLP(nn.Sequential):
    """``depth`` layers of ``Linear(width, width)`` followed by ReLU.

    Args:
        depth: number of layers.
        width: features in and out of every layer.
    """

    def __init__(self, depth: int = 24, width: int = 512) -> None:
        self.config = MLPConfig(depth=depth, width=width)
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        super().__init__(*layers)

    # forward is nn.Sequential's: x [B, width] -> [B, width]


def build_mlp(
    config: MLPConfig = MLPConfig(),
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> MLP:
    """Build an :class:`MLP` with weights drawn from ``seed``, on ``device`` in ``dtype``.

    The global RNG is left as it was: weights are drawn inside ``torch.random.fork_rng`` on the
    CPU, so the same seed gives the same weights on every device.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MLP(config.depth, config.width)
    return model.to(device=device, dtype=dtype)
