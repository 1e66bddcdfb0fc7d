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


def _halve_op() -> object:
    """``torch.ops.cli_factories.halve`` (``x * 0.5``), registered on first use."""
    try:
        return torch.ops.cli_factories.halve
    except AttributeError:
        pass

    @torch.library.custom_op("cli_factories::halve", mutates_args=())
    def halve(x: torch.Tensor) -> torch.Tensor:
        return x * 0.5

    @halve.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    return torch.ops.cli_factories.halve


class _TwoLinears(torch.nn.Module):
    """Two layers with a custom op between them: with ``--splitting-ops cli_factories.halve``,
    3 pieces (graphed, eager, graphed)."""

    def __init__(self) -> None:
        super().__init__()
        _halve_op()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        h = torch.ops.cli_factories.halve(h)  # LINE: split
        return self.b(h)


def pieces() -> tuple:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return _TwoLinears().to(device).eval(), (torch.randn(4, 16, device=device),)
