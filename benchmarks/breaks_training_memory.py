"""Device memory of a training step with breaks, against eager and one graph of the whole model:
the HF Llama of ``_llama_train.py`` (4 layers, hidden 512, fp32) at two batch shapes, broken at
SDPA's kernel op. Each method runs in a fresh process (the caching allocator keeps what a
process ever reserved): the build, then 5 SGD steps. Reported: the weights alone; the peak of
allocated and of reserved memory over the build and the steps (``torch.cuda.max_memory_*``:
a graph pool's blocks count as reserved, and as allocated while a tensor of it is alive).

Usage: ``PYTHONPATH=. python benchmarks/breaks_training_memory.py [4x64 8x512 ...]`` (batch x
tokens; default both)"""
import json
import subprocess
import sys

SHAPES = [(4, 64), (8, 512)]
METHODS = ["eager", "breaks", "whole graph"]


def one(method: str, batch: int, tokens: int) -> dict:
    import torch
    import torch.nn.functional as F

    import torchreplay as tr
    from _llama_train import BREAK, llama_and_tokens

    model, _ = llama_and_tokens()
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens), device="cuda")
    torch.cuda.synchronize()
    weights = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    import time
    t0 = time.perf_counter()
    if method == "breaks":
        tr.make_graphed_callables(model, (ids,), breaks=[BREAK])
    elif method == "whole graph":
        tr.make_graphed_callables(model, (ids,))
    torch.cuda.synchronize()
    build = time.perf_counter() - t0
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(5):
        opt.zero_grad(set_to_none=True)
        out = model(ids)
        F.cross_entropy(getattr(out, "logits", out).flatten(0, 1), ids.flatten()).backward()
        opt.step()
    torch.cuda.synchronize()
    mib = 2**20
    return {"build s": build, "weights": weights / mib, "peak allocated": torch.cuda.max_memory_allocated() / mib,
            "peak reserved": torch.cuda.max_memory_reserved() / mib}


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] in METHODS:
        print(json.dumps(one(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
        sys.exit(0)
    if len(sys.argv) > 1:
        SHAPES = [tuple(int(n) for n in a.split("x")) for a in sys.argv[1:]]
    print("| batch x tokens | method | build s | weights MiB | peak allocated MiB | peak reserved MiB | reserved vs eager |")
    print("|---|---|---|---|---|---|---|")
    for b, t in SHAPES:
        eager = None
        for m in METHODS:
            run = subprocess.run([sys.executable, __file__, m, str(b), str(t)], capture_output=True, text=True)
            if run.returncode:
                print(f"| {b} x {t} | {m} | failed: {run.stderr.strip().splitlines()[-1][:200]} | | | | |")
                continue
            r = json.loads(run.stdout.strip().splitlines()[-1])
            eager = eager or r["peak reserved"]
            print(f"| {b} x {t} | {m} | {r['build s']:.2f} | {r['weights']:.0f} | {r['peak allocated']:.0f} | "
                  f"{r['peak reserved']:.0f} | {r['peak reserved'] / eager:.2f}x |", flush=True)
