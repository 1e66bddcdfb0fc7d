"""Factories for the CLI tests (``torchreplay check cli_factories:NAME``); not a test module."""

from __future__ import annotations

import torch


def clean() -> tuple:
    """Nothing that would break capture; on CUDA where there is one."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return (lambda x: torch.relu(x * 2 + 1)), (torch.randn(4, 4, device=device),)


def item_sync() -> tuple:
    def fn(x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        if x.sum().item() > 0:  # LINE: item
            return x * scale
        return -x

    return fn, (torch.randn(4),), {"scale": 2.0}


def not_a_pair() -> object:
    return 42


def raises() -> tuple:
    raise RuntimeError("factory exploded")


def fn_raises() -> tuple:
    def fn(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("fn exploded")

    return fn, (torch.ones(1),)


NOT_CALLABLE = 3
