"""What registering the user's generators costs (CUDA only): the build and the call.

1. The 32-size breakable build of the built-in Llama (issue 11's, ``SDPA`` pinned to the
   memory-efficient kernel) with the generator watch of ``core/generators.py`` and with it
   replaced by a no-op, alternating, four builds each after a first one.
2. Host time per call of a graph of ``x + torch.randn(x.shape, generator=g)`` (64 elements)
   against the same graph drawing from the default generator: the generator passed as an
   argument (the sample's, and another per call), and eager. 30 interleaved rounds of 1000
   calls; median per method and the paired difference to the default-generator graph.

Usage: ``python benchmarks/generators_cost.py``.
"""
import contextlib, statistics, time, torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torchreplay as tr
from torchreplay.bench.breaks import _capture_sizes, _inputs
from torchreplay.core import generators
from torchreplay.models import build_llama

real = generators.Draws.watch
off = lambda self, compare=True: contextlib.nullcontext()  # noqa: E731 (no watch: the A/B)
model = build_llama(device="cuda")
with torch.no_grad(), sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
    model(*_inputs(model, 1)); torch.cuda.synchronize()
    first, _ = _capture_sizes(model)
    res = {"watch": [], "off": []}
    for r in range(4):
        for k in (("watch", "off") if r % 2 == 0 else ("off", "watch")):
            generators.Draws.watch = real if k == "watch" else off
            s, n = _capture_sizes(model)
            res[k].append(round(s, 3))
    generators.Draws.watch = real
print(f"32-size breakable build: first {first:.3f} s; with the generator watch {res['watch']}, without {res['off']} (captures {n})")

gen = torch.Generator(device="cuda"); gen.manual_seed(0)
req = torch.Generator(device="cuda"); req.manual_seed(1)
def noisy(x, generator): return x + torch.randn(x.shape, device=x.device, generator=generator)
def noisy_default(x): return x + torch.randn(x.shape, device=x.device)
x = torch.randn(64, device="cuda")
with torch.no_grad():
    gg = tr.graph(noisy, x, generator=gen); gd = tr.graph(noisy_default, x)
    def per(f, n=1000):
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(n): f()
        torch.cuda.synchronize(); return (time.perf_counter() - t) / n * 1e6
    rows = {"graph, default generator": lambda: gd(x), "graph, generator argument (sample's)": lambda: gg(x, generator=gen),
            "graph, generator argument (another)": lambda: gg(x, generator=req), "eager, generator argument": lambda: noisy(x, req)}
    got = {k: [] for k in rows}
    for r in range(30):
        for k in list(rows)[r % 4:] + list(rows)[:r % 4]:
            got[k].append(per(rows[k]))
for k, v in got.items():
    d = sorted(a - b for a, b in zip(v, got["graph, default generator"]))
    print(f"{k:40s} median {statistics.median(v):7.2f} us/call  min {min(v):7.2f}  paired d vs default-generator graph {d[len(d)//2]:+.2f}")
