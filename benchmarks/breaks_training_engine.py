"""Host time of a training step with breaks, op by op, as torch's profiler sees it: the HF Llama
of ``_llama_train.py`` broken at SDPA's kernel op, then graphed whole, 20 steps each after 20
warm ones; the table of each by total CPU time. It shows what autograd's engine does per node
(``evaluate_function: ...``) and the eager ops around the graphs (the loss, its backward, the
optimizer).

Open question (session 51): with breaks, the loss's backward ``zero_`` and ``fill_`` took 80 to
140 us on the host against 23 to 33 us whole. ``--cuda`` adds CUDA activity (is the launch
waiting on the GPU?); ``--sort self_cpu_time_total`` ranks by own time.

Usage: ``PYTHONPATH=. python benchmarks/breaks_training_engine.py [--cuda] [--sort KEY] [--rows N]``"""
import argparse
import copy
import sys

sys.path.insert(0, "benchmarks")

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import torchreplay as tr
from _llama_train import BREAK, llama_and_tokens

p = argparse.ArgumentParser()
p.add_argument("--cuda", action="store_true", help="profile CUDA activity too")
p.add_argument("--sort", default="cpu_time_total")
p.add_argument("--rows", type=int, default=40)
a = p.parse_args()
base, ids = llama_and_tokens()
for name in ["breaks", "whole graph"]:
    m = copy.deepcopy(base)
    if name == "breaks":
        tr.make_graphed_callables(m, (ids,), breaks=[BREAK])
    else:
        tr.make_graphed_callables(m, (ids,))
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)

    def fwd():
        opt.zero_grad(set_to_none=True)
        return F.cross_entropy(m(ids).logits.flatten(0, 1), ids.flatten())

    for _ in range(20):
        fwd().backward()
        opt.step()
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(20):
            loss = fwd()
            loss.backward()
            opt.step()
        torch.cuda.synchronize()
    print("=====", name)
    print(prof.key_averages().table(sort_by=a.sort, row_limit=a.rows, max_name_column_width=75))
