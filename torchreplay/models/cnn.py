"""A ResNet-style CNN of bottleneck blocks, used when torchvision is not installed.

With the default depths ``(3, 4, 6, 3)`` it has ResNet-50's layout (53 convolutions, 53
BatchNorms, about 25.6M parameters), so at batch 1 it is launch-bound the same way: a few hundred
small kernels per forward. :func:`resnet50` returns torchvision's model when it can be imported.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

__all__ = ["CNNConfig", "Bottleneck", "ResNet", "build_cnn", "resnet50", "resnet50_source"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CNNConfig:
    """Layout of :class:`ResNet`.

    Args:
        depths: bottleneck blocks in each of the four stages.
        width: channels of the stem; stage ``i`` works at ``width * 2**i`` and outputs 4x that.
        num_classes: outputs of the final linear layer.
    """

    depths: tuple[int, ...] = (3, 4, 6, 3)
    width: int = 64
    num_classes: int = 1000

    def __post_init__(self) -> None:
        if not self.depths or any(d < 1 for d in self.depths):
            raise ValueError(f"depths must be a non-empty tuple of ints >= 1, got {self.depths!r}")
        if self.width < 1 or self.num_classes < 1:
            raise ValueError(f"width and num_classes must be >= 1, got {self.width}, {self.num_classes}")


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand, each with BatchNorm; plus the residual."""

    expansion = 4

    def __init__(self, in_ch: int, mid_ch: int, stride: int = 1) -> None:
        super().__init__()
        out_ch = mid_ch * self.expansion
        self.conv1 = nn.Conv2d(in_ch, mid_ch, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid_ch)
        self.conv2 = nn.Conv2d(mid_ch, mid_ch, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid_ch)
        self.conv3 = nn.Conv2d(mid_ch, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, in_ch, H, W] -> [B, 4 * mid_ch, H / stride, W / stride]
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + identity)


class ResNet(nn.Module):
    """A stem (7x7 conv, max-pool), four stages of :class:`Bottleneck`, average pool, linear.

    Args:
        config: the layout; the default is ResNet-50's.
    """

    def __init__(self, config: CNNConfig = CNNConfig()) -> None:
        super().__init__()
        self.config = config
        w = config.width
        self.stem = nn.Sequential(
            nn.Conv2d(3, w, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(w),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        stages: list[nn.Module] = []
        in_ch = w
        for i, depth in enumerate(config.depths):
            mid = w * 2**i
            blocks = [Bottleneck(in_ch, mid, stride=1 if i == 0 else 2)]
            in_ch = mid * Bottleneck.expansion
            blocks += [Bottleneck(in_ch, mid) for _ in range(depth - 1)]
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, config.num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, 3, H, W] -> logits [B, num_classes]
        y = self.stages(self.stem(x))  # [B, C, H / 32, W / 32]
        return self.fc(torch.flatten(self.pool(y), 1))


def build_cnn(
    config: CNNConfig = CNNConfig(),
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> ResNet:
    """Build the built-in :class:`ResNet` with weights drawn from ``seed`` (global RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ResNet(config)
    return model.to(device=device, dtype=dtype)


def resnet50_source() -> str:
    """Return which ResNet-50 :func:`resnet50` builds: ``"torchvision"`` or ``"built-in"``."""
    try:
        import torchvision.models  # noqa: F401
    except ImportError:
        return "built-in"
    return "torchvision"


def resnet50(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0
) -> nn.Module:
    """Return ResNet-50 with random weights: torchvision's when installed, else :class:`ResNet`.

    The model is in training mode, like any freshly built module; call ``.eval()`` for inference.
    :func:`resnet50_source` says which one it is. The global RNG is left as it was.
    """
    if resnet50_source() == "built-in":
        log.debug("torchvision is not installed; using the built-in ResNet-50 layout")
        return build_cnn(CNNConfig(), device, dtype, seed)
    from torchvision.models import resnet50 as tv_resnet50

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tv_resnet50(weights=None)
    return model.to(device=device, dtype=dtype)
