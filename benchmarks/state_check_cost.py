"""What the padding check's state comparison adds to a `tr.graph(sizes=)` build (CUDA): the
built-in Llama (8 layers, 512 MiB of KV cache buffers, written at every call), 3 rows, sizes
1..32, capture="lazy" (the probe and the largest size), with the state comparison on and
replaced by a no-op, alternating, fresh model each build. Usage:
``python benchmarks/state_check_cost.py``."""
import sys, os, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import torchreplay as tr
from torchreplay.core import padcheck
from torchreplay.models.llama import LlamaConfig, build_llama

DEV = "cuda"


def build(compare):
    cfg = LlamaConfig(n_layers=8, max_batch=32)
    model = build_llama(cfg, DEV, torch.float32, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (3, 1), device=DEV)
    pos = torch.full((3,), 5, dtype=torch.long, device=DEV)
    saved = padcheck.StateCheck.after_first, padcheck.StateCheck.after_second
    if not compare:
        padcheck.StateCheck.after_first = padcheck.StateCheck.after_second = lambda self, written: None
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t = time.perf_counter()
        g = tr.graph(model, ids, pos, sizes=[1, 2, 4, 8, 16, 32], capture="lazy")
        torch.cuda.synchronize()
        return time.perf_counter() - t, (torch.cuda.max_memory_allocated() - base) / 2**20, g.stats.padding_check
    finally:
        padcheck.StateCheck.after_first, padcheck.StateCheck.after_second = saved


with torch.no_grad():
    build(True)  # (first use of every kernel)
    for r in range(3):
        for compare in (True, False) if r % 2 == 0 else (False, True):
            s, peak, line = build(compare)
            print(f"state compared {str(compare):5s}  build {s:.3f} s  peak over base {peak:.0f} MiB  {line[:90]}")
