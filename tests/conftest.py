"""Test-suite wide: the ``gpu`` marker, skipping GPU tests cleanly where CUDA is absent, and a
compile-cache folder of the suite's own.

Every test under ``tests/gpu`` gets the ``gpu`` marker, so ``-m "not gpu"`` deselects them and,
without CUDA, they are skipped with one reason instead of failing on the first ``.cuda()``.
"""

from __future__ import annotations

import os
import re
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


@pytest.fixture
def installed_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a fresh process that sees torchreplay as ``pip install`` leaves it:
    the checkout on ``PYTHONPATH`` and package metadata declaring the entry points that
    pyproject.toml declares (``torch_dynamo_backends``: ``backend="torchreplay"`` without an
    import). Not installed on the GPU machines or here, the test of the entry point would
    otherwise skip for good."""
    root = Path(__file__).resolve().parents[1]
    text = (root / "pyproject.toml").read_text()
    found = re.search(r"\[project\.entry-points\.torch_dynamo_backends\]\n((?:[^\[\n].*\n?)*)", text)
    assert found, "pyproject.toml declares no torch_dynamo_backends entry point"
    info = tmp_path / "torchreplay_entry_points-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torchreplay-entry-points\nVersion: 0\n")
    lines = [ln.replace('"', "") for ln in found.group(1).splitlines() if "=" in ln and not ln.startswith("#")]
    (info / "entry_points.txt").write_text("[torch_dynamo_backends]\n" + "\n".join(lines) + "\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env
