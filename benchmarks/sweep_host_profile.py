"""Where a `tr.compile(sizes=)` call's host time goes, against a static compile of one shape
(RESULTS.md, the sweep row): the `compile-sweep` MLP (12 x Linear(1024)+GELU) called at a
captured size (8 rows) and at a padded one (5 rows -> 8), through `tr.compile` and through its
piecewise runtime alone (no Dynamo), interleaved, host time without a sync. Needs CUDA.

Usage: ``PYTHONPATH=. python benchmarks/sweep_host_profile.py``
"""
from __future__ import annotations

import cProfile
import io
import pstats
import sys

import torch

sys.path.insert(0, ".")
import torchreplay as tr  # noqa: E402
from torchreplay.bench.compile import _compile_per_shape  # noqa: E402
from torchreplay.bench.timing import BenchOptions, time_interleaved  # noqa: E402
from torchreplay.models.blocks import gelu_mlp  # noqa: E402
from torchreplay.pieces.runtime import PiecewiseRuntime  # noqa: E402

sys.path.insert(0, "benchmarks")
from split_cost_profile import runtime_and_args  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    model = gelu_mlp().cuda().eval()
    x8, x5 = torch.randn(8, 1024, device="cuda"), torch.randn(5, 1024, device="cuda")
    with torch.no_grad():
        sweep = tr.compile(model, sizes=[1, 2, 4, 8, 16])
        sweep(x8)
        fixed = _compile_per_shape(model)
        fixed(x8)
        for x in (x8, x5):
            torch.testing.assert_close(sweep(x), model(x))
        rt_sweep, args8 = runtime_and_args(sweep, x8)
        _, args5 = runtime_and_args(sweep, x5)
        (c8,) = fixed.compiled.values()
        rt_fixed, argsf = runtime_and_args(c8, x8)
        calls = {
            "tr.compile sizes=, 8 rows": lambda: sweep(x8),
            "tr.compile sizes=, 5 rows (padded)": lambda: sweep(x5),
            "tr.compile, static 8 rows": lambda: fixed(x8),
            "runtime alone, sizes=, 8 rows": lambda: rt_sweep(*args8),
            "runtime alone, sizes=, 5 rows": lambda: rt_sweep(*args5),
            "runtime alone, static 8 rows": lambda: rt_fixed(*argsf),
        }
        res = time_interleaved(calls, BenchOptions(repeats=5, calls=100, warmup=20, host_calls=10))
        for name, v in res.items():
            print(f"{name:36s} per call {v[0]:8.1f} us  host min {v[1]:8.1f}  host median {v[2]:8.1f}")
        print("runtime inputs, sizes=:", [(i.name, i.kind, i.dim, i.is_size) for i in rt_sweep.program.inputs][:3],
              "...", len(rt_sweep.program.inputs), "inputs")
        print("runtime inputs, static:", len(rt_fixed.program.inputs), "inputs")
        for name, f in (("sizes=, 5 rows", lambda: rt_sweep(*args5)), ("static", lambda: rt_fixed(*argsf))):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(5000):
                f()
            prof.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
            print(f"== runtime alone, {name}\n" + s.getvalue()[-3000:])


if __name__ == "__main__":
    assert PiecewiseRuntime
    main()
