"""Host cost of watching a plain function's modules (core/args.py ``called_module``): per call,
``tr.graph(model, x)`` against ``tr.graph(lambda x: model(x), x)`` (one root: the same checks as
the module's) and a function of two models (a :class:`ModuleGroup`: a tuple of their modes per
call), each against a hand-written graph, interleaved, paired medians (as host_overhead.py).
Then ``make_graphed_callables`` forward + backward of the module and of a function over it.
Usage: ``PYTHONPATH=. python benchmarks/function_watch.py`` (CUDA only)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import torch.nn as nn

import torchreplay as tr
from torchreplay.bench.timing import handwritten_graph
from _paired import interleaved  # noqa: E402


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
