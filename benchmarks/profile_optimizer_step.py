"""Where the device time of a captured ResNet-50 b1 AdamW training step goes: foreach vs fused.

``tr.graph_step`` of the same step with ``AdamW(capturable=True)`` (foreach) and with
``fused=True``; per variant the replay time, the eager ``opt.step()`` alone, and a CUDA profile
of 5 replays grouped by kind of kernel, with the 8 most expensive kernels. CUDA only. Usage:
``python benchmarks/profile_optimizer_step.py``.
"""
import sys, os
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch, torch.nn.functional as F
from torch.profiler import profile, ProfilerActivity
import torchreplay as tr
from torchreplay.models.cnn import resnet50

def build(kind):
    torch.manual_seed(0)
    model = resnet50("cuda").train()
    x = torch.randn(1, 3, 224, 224, device="cuda"); y = torch.randint(0, 1000, (1,), device="cuda")
    kw = dict(capturable=True, foreach=True) if kind == "foreach" else dict(capturable=True, fused=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **kw)
    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y); loss.backward(); opt.step(); return loss
    g = tr.graph_step(step, x, y)
    # the optimizer step alone, eager, for its kernel count
    return g, x, y, opt, model

def timeit(f, n=50):
    for _ in range(5): f()
    torch.cuda.synchronize(); s, e = torch.cuda.Event(True), torch.cuda.Event(True); s.record()
    for _ in range(n): f()
    e.record(); torch.cuda.synchronize(); return s.elapsed_time(e) / n * 1e3

for kind in ("foreach", "fused"):
    g, x, y, opt, model = build(kind)
    print(f"== {kind}: {sum(1 for _ in model.parameters())} params; whole step replay {timeit(lambda: g(x, y)):.0f} us/step")
    opt_t = timeit(lambda: opt.step(), n=20)
    print(f"   eager opt.step alone: {opt_t:.0f} us/step (host-bound eager, for reference)")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5): g(x, y)
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type.name == "CUDA"]
    tot = sum(e.device_time for e in evs) / 5
    print(f"   profiled kernels per step: {len(evs)/5:.0f}, summed kernel time {tot:.0f} us")
    groups = {}
    for e in evs:
        n = e.name
        key = ("adam" if "adam" in n.lower() or "Adam" in n else
               "foreach/multi_tensor" if "multi_tensor" in n or "foreach" in n.lower() else
               "conv/gemm" if any(k in n.lower() for k in ("conv", "gemm", "sm90", "sm80", "cutlass", "xmma", "cudnn")) else
               "batchnorm" if "batch_norm" in n.lower() or "bn_" in n.lower() else
               "elementwise/reduce" if any(k in n for k in ("elementwise", "reduce", "vectorized")) else "other")
        c, t = groups.get(key, (0, 0.0)); groups[key] = (c + 1, t + e.device_time)
    for k, (c, t) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print(f"   {k:22s} {c/5:6.0f} kernels  {t/5:8.0f} us")
    top = {}
    for e in evs:
        c, t = top.get(e.name, (0, 0.0)); top[e.name] = (c + 1, t + e.device_time)
    for n, (c, t) in sorted(top.items(), key=lambda kv: -kv[1][1])[:8]:
        print(f"     {t/5:7.0f} us {c/5:5.0f}x  {n[:110]}")
    del g, opt, model; torch.cuda.empty_cache()
