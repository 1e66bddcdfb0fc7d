#!/usr/bin/env python3
"""Run the benchmark rows: ``python benchmarks/run.py [--model mlp|resnet50|llama|all] [--json PATH]``.

The same as ``torchreplay bench`` (every option of it works here), runnable from a checkout
without installing. The method and the numbers so far are in ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchreplay.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(["bench", *sys.argv[1:]]))
