"""Test-suite wide: the ``gpu`` marker, skipping GPU tests cleanly where CUDA is absent, and a
compile-cache folder of the suite's own.

Every test under ``tests/gpu`` gets the ``gpu`` marker, so ``-m "not gpu"`` deselects them and,
without CUDA, they are skipped with one reason instead of failing on the first ``.cuda()``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

GPU_DIR = Path(__file__).parent / "gpu"
_CACHE_DIR = tempfile.mkdtemp(prefix="torchreplay-test-cache-")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    # The compile cache is on by default: the tests (and the processes they start) use a
    # folder of their own, never the user's ~/.cache/torchreplay.
    os.environ["TORCHREPLAY_CACHE_DIR"] = _CACHE_DIR


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_CACHE_DIR, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # is_available() asks the driver for a device count; it does not initialise CUDA in torch.
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if GPU_DIR in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.gpu)
        if skip is not None and item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def full_fp32_matmul():
    """TF32 off (GEMMs and cuDNN), so fp32 results of different kernels differ only in
    summation order; put back after. Used with ``pytest.mark.usefixtures``."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
