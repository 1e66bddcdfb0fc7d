"""Importing torchreplay initialises no CUDA, writes no global torch config and patches nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PROBE = r"""
import json, sys
import torch

def snapshot():
    return {
        "default_dtype": str(torch.get_default_dtype()),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "grad_enabled": torch.is_grad_enabled(),
        "num_threads": torch.get_num_threads(),
        "rng": torch.get_rng_state().sum().item(),
        # callables replaced or added on what a library might monkeypatch
        "patched": sorted(
            name for name, obj in [
                ("Tensor", torch.Tensor), ("Module", torch.nn.Module), ("cuda", torch.cuda),
            ]
            for name in [f"{name}.{k}" for k, v in vars(obj).items()
                         if callable(v) and id(v) != BEFORE_IDS.get(f"{name}.{k}")]
        ),
    }

BEFORE_IDS = {}
for prefix, obj in [("Tensor", torch.Tensor), ("Module", torch.nn.Module), ("cuda", torch.cuda)]:
    for k, v in list(vars(obj).items()):
        if callable(v):
            BEFORE_IDS[f"{prefix}.{k}"] = id(v)

before = snapshot()
import torchreplay, torchreplay.cli, torchreplay.bench, torchreplay.models, torchreplay.models.factories
after = snapshot()
print(json.dumps({
    "cuda_initialized": torch.cuda.is_initialized(),
    "before": before,
    "after": after,
}))
"""


def test_import_initialises_no_cuda_and_changes_no_global_config() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["cuda_initialized"] is False
    assert result["after"]["patched"] == []
    assert result["after"] == result["before"]
