"""The 32-size breakable build of the built-in Llama (``tr.graph(breaks=, sizes=1..32)``),
timed three times after a first build, and its peak memory over the base.

Usage: ``python benchmarks/breaks_build.py LABEL``; compare two versions of the library by
running it with each on PYTHONPATH, alternately. ``SDPA=efficient`` in the environment pins the
memory-efficient attention kernel for the whole run (torch's default on the H200 is cuDNN's,
which builds a plan per new shape: README, "What a capture of many sizes pays besides
capturing")."""
import os, sys, time, contextlib, torch
from torchreplay.bench.breaks import _capture_sizes, _inputs
from torchreplay.models import build_llama
import torchreplay
model = build_llama(device="cuda")
pinned = contextlib.nullcontext()
if os.environ.get("SDPA") == "efficient":
    from torch.nn.attention import SDPBackend, sdpa_kernel
    pinned = sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION)
with torch.no_grad(), pinned:
    model(*_inputs(model, 1)); torch.cuda.synchronize()
    first, _ = _capture_sizes(model)
    times = []
    for _ in range(3):
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
        s, n = _capture_sizes(model)
        times.append(s)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
cache = sum(b.nbytes for n_, b in model.named_buffers() if "cache" in n_) / 2**20
print(f"{sys.argv[1]} (SDPA={os.environ.get('SDPA', 'default')}): first {first:.3f} s, again {['%.3f' % t for t in times]} s, captures {n}, peak over base {peak:.0f} MiB, caches {cache:.0f} MiB, from {torchreplay.__file__}")
