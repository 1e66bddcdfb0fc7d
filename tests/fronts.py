"""The front ends the GPU tests of eager semantics run one model through: ``tr.graph`` with one
shape, ``sizes=``, ``breaks=`` (the model's second layer is the break), both, and ``tr.compile``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

import torchreplay as tr

SIZES = [2, 4, 8]


def build(front: str, model: nn.Module, x: torch.Tensor) -> Any:
    """``model`` (a Sequential whose ``[1]`` can be a break) graphed by ``front`` from ``x``;
    a ``tr.compile``d one is called once on ``x`` (compiled and captured in the caller's mode)."""
    if front == "sizes":
        return tr.graph(model, x, sizes=SIZES)
    if front == "breaks":
        return tr.graph(model, x, breaks=[model[1]])
    if front == "breaks, sizes":
        return tr.graph(model, x, breaks=[model[1]], sizes=SIZES)
    if front.startswith("compile"):
        torch._dynamo.reset()
        g = tr.compile(model)
        g(x)
        return g
    assert front == "one shape", front
    return tr.graph(model, x)


def rows(front: str) -> int:
    """The rows of a call: with ``sizes=``, 3 (padded to 4)."""
    return 3 if "sizes" in front else 4
