"""The ``compile-*`` rows of ``torchreplay bench`` (:mod:`torchreplay.bench.compile` and
:mod:`torchreplay.bench.compile_costs`) in one process, with a choice of methods.

``torchreplay bench --model compile-mlp`` (one row per process: ``scripts/gpu_test.py --rows
compile``) is the usual way; this script adds ``--variants`` to time only some methods, e.g. to
find which one breaks a process. Old names still work: rows ``mlp,if,nonzero,sweep``, variants
``reduce-overhead,cudagraphs,torchreplay`` (``tr.compile``).

Usage: python benchmarks/compile_rows.py [--rows mlp,if,...] [--variants eager,torchreplay]
       [--repeats 7] [--calls 100] [--no-compile] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402

from torchreplay import bench  # noqa: E402
from torchreplay.bench import compile as compile_rows  # noqa: E402
from torchreplay.bench.timing import FLOOR  # noqa: E402
from torchreplay.cli import results_table  # noqa: E402

#: Variant names of the first version of this script.
ALIASES = {
    "reduce-overhead": compile_rows.REDUCE_OVERHEAD,
    "cudagraphs": compile_rows.CUDAGRAPHS,
    "torchreplay": compile_rows.TR_COMPILE,
    "floor": FLOOR,
}


def main() -> int:
    ap = argparse.ArgumentParser(
        description="The compile-* rows of `torchreplay bench` in one process, with a choice of "
        "methods (--variants).")
    ap.add_argument("--rows", default=",".join(bench.COMPILE_ROWS),
                    help=f"comma-separated, from {', '.join(bench.COMPILE_ROWS)} (the compile- "
                    "prefix may be left out); default: all")
    ap.add_argument("--variants", default="",
                    help="only these methods of the timed rows, e.g. eager,tr.graph,torchreplay "
                    f"(names: {', '.join(compile_rows.COMPILE_METHODS)}, or {', '.join(ALIASES)})")
    defaults = bench.BenchOptions()
    ap.add_argument("--repeats", type=int, default=defaults.repeats)
    ap.add_argument("--calls", type=int, default=defaults.calls)
    ap.add_argument("--no-compile", action="store_true", help="leave out torch.compile's methods")
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = [r if r.startswith("compile-") else f"compile-{r}" for r in a.rows.split(",") if r]
    unknown = [r for r in rows if r not in bench.COMPILE_ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; choose from {', '.join(bench.COMPILE_ROWS)}")
    variants = {ALIASES.get(v, v) for v in a.variants.split(",") if v}
    opts = bench.BenchOptions(repeats=a.repeats, calls=a.calls, compile=not a.no_compile)
    env = bench.environment()
    print(f"{env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}", flush=True)
    results: list[bench.Measurement] = []
    has_bert = importlib.util.find_spec("transformers") is not None
    for row in rows:
        # The memory and split-cost rows have no methods to choose; the BERT row without
        # transformers is one "skipped" entry.
        if variants and row in compile_rows.WORKLOADS and (row != "compile-bert" or has_bert):
            for w in compile_rows.WORKLOADS[row]():
                w = dataclasses.replace(w, methods=tuple(m for m in w.methods if m in variants))
                results += compile_rows.measure_compile_workload(w, opts)
        else:
            results += bench.run([row], opts)
    Console(width=160).print(results_table(dataclasses.asdict(m) for m in results))
    if a.json:
        bench.write_json(a.json, results, opts)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
