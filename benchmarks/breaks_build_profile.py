"""Where the 32-size breakable build of the built-in Llama spends its host time: one build to
meet every shape, then a second under cProfile (top functions by own time and by cumulative).

Usage: ``python benchmarks/breaks_build_profile.py [N]`` (N rows of each listing, default 30)."""
import cProfile
import io
import pstats
import sys
import time

import torch

from torchreplay.bench.breaks import _capture_sizes, _inputs
from torchreplay.models import build_llama

rows = int(sys.argv[1]) if len(sys.argv) > 1 else 30
model = build_llama(device="cuda")
with torch.no_grad():
    model(*_inputs(model, 1))
    torch.cuda.synchronize()
    _capture_sizes(model)
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    seconds, captures = _capture_sizes(model)
    pr.disable()
    print(f"build under the profiler: {time.perf_counter() - t0:.3f} s ({seconds:.3f} s inside), {captures} captures")
    plain, _ = _capture_sizes(model)
    print(f"build without it: {plain:.3f} s")
for key in ("tottime", "cumulative"):
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats(key).print_stats(rows)
    print(out.getvalue()[-9000:])
