"""The benchmark suite behind ``torchreplay bench``: one module per workload family.

- :mod:`~torchreplay.bench.timing`: options, the clock, one measurement, the hand-written floor;
- :mod:`~torchreplay.bench.inference`: the ``mlp``, ``resnet50``, ``llama`` and ``llama-sizes``
  rows and a user's ``module:factory``;
- :mod:`~torchreplay.bench.breaks`: the ``llama-breaks`` row (breakable graphs);
- :mod:`~torchreplay.bench.training`: the ``mlp-train`` and ``resnet50-train`` rows;
- :mod:`~torchreplay.bench.compile`: the ``torch.compile`` backend rows (``compile-mlp``,
  ``compile-if``, ``compile-nonzero``, ``compile-bert``, ``compile-sweep``, ``compile-resnet50``);
- :mod:`~torchreplay.bench.compile_costs`: the backend's memory for many sizes
  (``compile-memory``) and host time per split (``compile-split-cost``).

Every row needs CUDA; the ``compile-*`` rows (:data:`COMPILE_ROWS`) have no CPU stand-in, so
the command line skips them without CUDA where it checks the other rows' models.

The library never imports this package; only the command line (and ``scripts/``) does.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Iterator, Mapping, Optional, Sequence

import torch

from torchreplay.bench import breaks, compile_costs, inference, training
from torchreplay.bench import compile as compile_rows
from torchreplay.bench.inference import METHODS, Workload, run_factory, unpack_factory_result
from torchreplay.bench.timing import (
    QUICK,
    BenchOptions,
    Measurement,
    StepCallback,
    environment,
    release,
    time_call,
    write_json,
)

__all__ = [
    "ROWS",
    "COMPILE_ROWS",
    "run",
    "run_factory",
    "unpack_factory_result",
    "BenchOptions",
    "QUICK",
    "Measurement",
    "Workload",
    "METHODS",
    "time_call",
    "environment",
    "write_json",
]

RowFn = Callable[[BenchOptions, Optional[StepCallback]], Iterator[Measurement]]

#: Benchmark rows by name, in table order. A row is a function of the options that yields
#: measurements; it builds its models lazily, so one row's memory is free before the next.
ROWS: Mapping[str, RowFn] = MappingProxyType(
    {
        "mlp": inference.mlp_row,
        "resnet50": inference.resnet50_row,
        "llama": inference.llama_row,
        "llama-sizes": inference.llama_sizes_row,
        "llama-breaks": breaks.llama_breaks_row,
        "mlp-train": training.mlp_train_row,
        "resnet50-train": training.resnet50_train_row,
        "compile-mlp": compile_rows.compile_mlp_row,
        "compile-if": compile_rows.compile_if_row,
        "compile-nonzero": compile_rows.compile_nonzero_row,
        "compile-bert": compile_rows.compile_bert_row,
        "compile-sweep": compile_rows.compile_sweep_row,
        "compile-resnet50": compile_rows.compile_resnet50_row,
        "compile-memory": compile_costs.compile_memory_row,
        "compile-split-cost": compile_costs.compile_split_cost_row,
    }
)

#: The rows that time the ``torch.compile`` backend (the names start with ``compile-``).
COMPILE_ROWS: tuple[str, ...] = tuple(name for name in ROWS if name.startswith("compile-"))


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available: the benchmark rows time CUDA graphs and need a GPU")


def run(
    names: Sequence[str] | None = None,
    opts: BenchOptions = BenchOptions(),
    on_step: StepCallback | None = None,
) -> list[Measurement]:
    """Run the rows ``names`` (default: all of :data:`ROWS`) and return every measurement.

    Raises:
        ValueError: a name that is not in :data:`ROWS`.
        RuntimeError: CUDA is not available.
    """
    names = list(ROWS) if names is None else list(names)
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise ValueError(f"unknown benchmark rows {unknown}; choose from {sorted(ROWS)}")
    _require_cuda()
    results: list[Measurement] = []
    for name in names:
        results.extend(ROWS[name](opts, on_step))
        release()
    return results
