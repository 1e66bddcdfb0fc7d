"""Test-suite wide: the ``gpu`` marker, and skipping GPU tests cleanly where CUDA is absent.

Every test under ``tests/gpu`` gets the ``gpu`` marker, so ``-m "not gpu"`` deselects them and,
without CUDA, they are skipped with one reason instead of failing on the first ``.cuda()``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

GPU_DIR = Path(__file__).parent / "gpu"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # is_available() asks the driver for a device count; it does not initialise CUDA in torch.
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if GPU_DIR in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.gpu)
        if skip is not None and item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
