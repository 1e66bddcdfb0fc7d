"""The cost of breakable graphs' machinery per break, against Meta's piecewise-cuda-graphs
(RESULTS.md, "Breakable graphs"): 16 Linear(256) layers at batch 1 with a trivial break after each
(`brk(out, x)` writes its argument; `brk_ret(x)` returns a new tensor, which Meta's package
refuses), interleaved timing. Needs CUDA and `piecewise_cuda_graphs` installed.

Usage: ``PYTHONPATH=. python benchmarks/breaks_overhead.py``
"""
import torch, sys
sys.path.insert(0, ".")
import torch.nn as nn
import torchreplay as tr
from torchreplay.bench.timing import BenchOptions, time_interleaved
import piecewise_cuda_graphs as pcg

def brk(out, x):
    out.copy_(x)

class M(nn.Module):
    def __init__(s, n=16):
        super().__init__(); s.l = nn.ModuleList(nn.Linear(256, 256) for _ in range(n))
    def forward(s, x):
        for l in s.l:
            x = l(x)
            y = torch.empty_like(x)
            brk(y, x)
            x = y
        return x

def brk_ret(x):
    return x * 1
class M2(M):
    def forward(s, x):
        for l in s.l:
            x = brk_ret(l(x))
        return x

torch.manual_seed(0)
with torch.no_grad():
    m = M().cuda().eval(); m2 = M2().cuda().eval(); m2.load_state_dict(m.state_dict())
    x = torch.randn(1, 256, device="cuda")
    ours = tr.graph(m, x, breaks=[brk])
    ours_ret = tr.graph(m2, x, breaks=[brk_ret])
    static = x.clone()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): m(static)
    torch.cuda.current_stream().wait_stream(s)
    seq = pcg.CUDAGraphSequence()
    g = globals(); plain = g["brk"]; g["brk"] = pcg.no_graph(plain)
    with pcg.piecewise_graph(seq):
        out = m(static)
    g["brk"] = plain
    def meta():
        static.copy_(x); seq.replay(); return out
    whole = tr.graph(nn.Sequential(*m.l), x)
    torch.testing.assert_close(ours(x), m(x)); torch.testing.assert_close(meta(), m(x)); torch.testing.assert_close(ours_ret(x), m(x))
    calls = {"ours": lambda: ours(x), "meta": meta, "ours returning": lambda: ours_ret(x), "whole graph (no breaks)": lambda: whole(x), "eager": lambda: m(x)}
    res = time_interleaved(calls, BenchOptions(repeats=15, calls=100, warmup=20, host_calls=10))
    for k, v in res.items():
        print(f"{k:28s} per call {v[0]:8.1f} us  host min {v[1]:8.1f}  host median {v[2]:8.1f}")
