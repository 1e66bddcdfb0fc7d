"""Host memory of the graph templates kept for copy nodes (CUDA only; RESULTS.md, session 63).

A graph whose first nodes copy the call's tensors in (``_compat/copy_nodes.py``) is made with
``CUDAGraph(keep_graph=True)``: the driver's template of the graph lives as long as the graph
(the nodes are found and repointed through it). This measures what that costs the host: the
benchmark MLP (24 x Linear(512, 512) + ReLU) compiled with ``tr.compile(sizes=1..32)`` (32
graphs, each keeping its template), the process's resident memory before the compile and after
its first call (which captures every size), with the copy nodes or with them hidden (``--hide``:
the graphs copy with launches and keep no template). Run each way in fresh processes, alternately.

``--breaks``: the same for issue 11's build instead, the built-in Llama as a breakable graph
(``tr.graph(breaks=[host_attention], sizes=1..32)``: 544 segments, the first of each size
copying the call's tensors by nodes and each after a break copying its outputs by nodes, so
every such segment keeps its template), one build first apart (held), the second measured and held.

Usage: ``PYTHONPATH=. python benchmarks/template_memory.py [--hide] [--breaks]``
"""
from __future__ import annotations

import copy
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch

import torchreplay as tr
from torchreplay._compat import copy_nodes
from torchreplay.models.factories import mlp_factory


def rss_mib() -> float:
    gc.collect()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def breaks(hide: bool) -> None:
    from torchreplay.bench.breaks import _inputs
    from torchreplay.models import build_llama
    from torchreplay.models.llama import host_attention

    model = build_llama(device="cuda")
    with torch.no_grad():
        model(*_inputs(model, 1))
        # kernels and per-shape first uses, apart; held, so that the measured build cannot
        # reuse the host memory a freed one gave back
        first = tr.graph(model, *_inputs(model, 1), breaks=[host_attention], sizes=list(range(1, 33)))
        if hide:
            copy_nodes.available()
            copy_nodes._driver[:] = [None]
        before = rss_mib()
        g = tr.graph(model, *_inputs(model, 1), breaks=[host_attention], sizes=list(range(1, 33)))
        torch.cuda.synchronize()
        after = rss_mib()
    kept = "hidden (no template kept)" if hide else f"on ({g.stats.graph_copies} input(s) by node)"
    print(f"breakable Llama, copy nodes {kept}: 32 sizes, {g.stats.captures} captures; "
          f"RSS +{after - before:.1f} MiB over the build (the first, held: {first.stats.captures} captures)")


def main() -> None:
    hide = "--hide" in sys.argv
    if "--breaks" in sys.argv:
        return breaks(hide)
    model, (x,) = mlp_factory(batch=32)
    model.eval()
    sizes = list(range(1, 33))
    copy_nodes.available()
    saved = list(copy_nodes._driver)
    copy_nodes._driver[:] = [None]
    warm = copy.deepcopy(model)  # the same compile first, apart: Inductor's caches and Triton
    warm.__class__ = type("Warm", (type(model),), {})  # loaded before the measure
    with torch.no_grad():
        tr.compile(warm, sizes=sizes, cache_dir=None)(x[:5])
    copy_nodes._driver[:] = saved
    if hide:
        copy_nodes._driver[:] = [None]
    before = rss_mib()
    c = tr.compile(model, sizes=sizes, cache_dir=None)
    with torch.no_grad():
        c(x[:5])
    torch.cuda.synchronize()
    after = rss_mib()
    (rt,) = c.backend.runtimes
    kept = "hidden (no template kept)" if hide else f"on ({rt.stats.graph_copies} input by node)"
    print(f"copy nodes {kept}: {len(sizes)} sizes, {rt.stats.captures} captures; "
          f"RSS +{after - before:.1f} MiB over the compile and capture")


if __name__ == "__main__":
    main()
