"""Host time of a training step with breaks, op by op, as torch's profiler sees it (CPU
activity only): the HF Llama of ``_llama_train.py`` broken at SDPA's kernel op, then graphed
whole, 20 steps each after 20 warm ones; the table of each by total CPU time. It shows what
autograd's engine does per node (``evaluate_function: ...``) and the eager ops around the
graphs (the loss, its backward, the optimizer).

Usage: ``PYTHONPATH=. python benchmarks/breaks_training_engine.py``"""
import copy, sys
sys.path.insert(0, "benchmarks")
import torch
import torch.nn.functional as F
import torchreplay as tr
from torch.profiler import profile, ProfilerActivity
from _llama_train import BREAK, llama_and_tokens
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
        fwd().backward(); opt.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(20):
            loss = fwd()
            loss.backward()
            opt.step()
        torch.cuda.synchronize()
    print("=====", name)
    print(p.key_averages().table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=75))
