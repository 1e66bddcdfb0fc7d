"""Built-in benchmark models, written in this project: random weights from a seed, no downloads.

- :mod:`~torchreplay.models.mlp`: 24 x ``Linear(512, 512) + ReLU``, the smallest launch-bound model.
- :mod:`~torchreplay.models.cnn`: a ResNet-50-style CNN, used where torchvision is not installed.
- :mod:`~torchreplay.models.llama`: a Llama-style decoder with a static, in-place KV cache.
- :mod:`~torchreplay.models.blocks`: the ``compile-*`` rows' models (a GELU MLP, a data-dependent
  ``if``, ``nonzero`` between blocks, an MLP cut by a custom splitting op, Hugging Face's BERT).
- :mod:`~torchreplay.models.factories`: ``(fn, args)`` factories for ``torchreplay check`` / ``bench``.

Not part of ``torchreplay.__all__``: these exist for benchmarks, tests and examples.
"""

from __future__ import annotations

from torchreplay.models.cnn import CNNConfig, ResNet, build_cnn, resnet50, resnet50_source
from torchreplay.models.llama import Llama, LlamaConfig, build_llama
from torchreplay.models.mlp import MLP, MLPConfig, build_mlp

__all__ = [
    "MLP", "MLPConfig", "build_mlp",
    "ResNet", "CNNConfig", "build_cnn", "resnet50", "resnet50_source",
    "Llama", "LlamaConfig", "build_llama",
]
