"""Host cost of watching a plain function's modules (core/args.py ``called_module``): per call,
``tr.graph(model, x)`` against ``tr.graph(lambda x: model(x), x)`` (one root: the same checks as
the module's) and a function of two models (a :class:`ModuleGroup`: a tuple of their modes per
call), each against a hand-written graph, interleaved, paired medians (as host_overhead.py).
Then ``make_graphed_callables`` forward + backward of the module and of a function over it.
Usage: ``PYTHONPATH=. python benchmarks/function_watch.py`` (CUDA only)."""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import torch.nn as nn

import torchreplay as tr
from torchreplay.bench.timing import handwritten_graph


def interleaved(methods, rounds=300, calls=10):
    names = list(methods)
    s = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            f = methods[k]
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(calls):
                f()
            s[k].append((time.perf_counter() - t) / calls * 1e6)
    torch.cuda.synchronize()
    for k in names:
        d = sorted(a - b for a, b in zip(s[k], s[names[0]]))
        q = lambda p: d[int(p * (len(d) - 1))]  # noqa: E731
        print(f"   {k:36s} min {min(s[k]):8.2f}  med {statistics.median(s[k]):8.2f}  "
              f"paired vs {names[0]}: med {q(.5):+6.2f} [{q(.25):+6.2f}, {q(.75):+6.2f}]")


torch.manual_seed(0)
body = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(1024, 1024), nn.GELU())]).cuda().eval()
head = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(1024, 1024), nn.GELU())]).cuda().eval()
model = nn.Sequential(body, head)
x = torch.randn(8, 1024, device="cuda")
with torch.no_grad():
    hand = handwritten_graph(model, (x,), {})
    g_module = tr.graph(model, x)
    g_fn = tr.graph(lambda x: model(x), x)
    g_two = tr.graph(lambda x: head(body(x)), x)
    assert g_fn._module is model and type(g_two._module).__name__ == "ModuleGroup"
    print(f"== inference, MLP 12 x Linear(1024) b8, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    interleaved({"hand-written graph": lambda: hand(), "tr.graph(model)": lambda: g_module(x),
                 "tr.graph(lambda x: model(x))": lambda: g_fn(x),
                 "tr.graph(lambda x: head(body(x)))": lambda: g_two(x)})

xs = torch.randn(8, 1024, device="cuda", requires_grad=True)
train = nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024)).cuda()
mgc_module = tr.make_graphed_callables(train, (xs,))
train2 = nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024)).cuda()
mgc_fn = tr.make_graphed_callables(lambda x: train2(x), (xs,))


def step(f):
    def run():
        f(xs).sum().backward()
    return run


print("== make_graphed_callables, forward + backward, MLP 2 x Linear(1024) b8")
interleaved({"module": step(train), "function over a module": step(mgc_fn)}, rounds=200)
