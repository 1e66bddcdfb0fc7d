"""The host Python of ``tr.make_graphed_callables`` against the structure of torch's
``make_graphed_callables`` (``torch/cuda/graphs.py``: one ``autograd.Function`` per callable that
copies its inputs, replays, returns the static outputs detached, and in its backward copies the
gradients, replays, returns the static gradients detached), on the CPU, both with "replays" that
do nothing (ours through ``tests/cpu/test_training.py``'s emulated capture): four layers of
Linear(64)+GELU, a training step (``.grad`` set to None, forward, ``sum().backward()``) and a
forward under ``no_grad``, interleaved, us (RESULTS.md, session 71). ``-p``: a cProfile of ours.

Usage: ``python benchmarks/mgc_cpu_overhead.py [-p]`` from the repository root."""
import sys, time, dataclasses, statistics
sys.path[:0] = [".", "tests", "tests/cpu"]  # (run from the repository root)
import torch, torch.nn as nn
import torch.utils._pytree as pytree
import torchreplay as tr
import test_training as T
from torchreplay.training import callables as training

def layers():
    torch.manual_seed(0)
    return tuple(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4))

def noop_pairs(runners, **kw):
    return [None if p is None else dataclasses.replace(p, fwd_replay=lambda: None,
            bwd_replay=(lambda: None) if p.bwd_replay is not None else None)
            for p in T._emulated_capture_pairs(runners, **kw)]

training._capture_pairs = noop_pairs
training.infer_device = lambda fn, call, device=None: T.CPU
ours = tr.make_graphed_callables(layers(), tuple((torch.randn(8, 64, requires_grad=True),) for _ in range(4)))

def torch_like(module, sample):
    """torch/cuda/graphs.py's structure around one callable, replays no-ops."""
    params = tuple(module.parameters())
    static_inputs = tuple(sample) + params
    with torch.enable_grad():
        outs = module(*sample)
    static_outputs = (outs.detach().requires_grad_(False),)
    static_grad_outputs = (torch.zeros_like(outs),)
    static_grad_inputs = tuple(torch.zeros_like(t) for t in static_inputs)
    _, spec = pytree.tree_flatten(outs)
    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            for i in range(len(static_inputs)):
                if static_inputs[i].data_ptr() != inputs[i].data_ptr():
                    static_inputs[i].copy_(inputs[i])
            (lambda: None)()
            assert isinstance(static_outputs, tuple)
            return tuple(o.detach() for o in static_outputs)
        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, *grads):
            assert len(grads) == len(static_grad_outputs)
            for g, grad in zip(static_grad_outputs, grads):
                if g is not None and g.data_ptr() != grad.data_ptr():
                    g.copy_(grad)
            (lambda: None)()
            assert isinstance(static_grad_inputs, tuple)
            return tuple(b.detach() if b is not None else b for b in static_grad_inputs)
    def functionalized(*user_args):
        flat = pytree.arg_tree_leaves(*user_args)
        out = Graphed.apply(*(tuple(flat) + params))
        return pytree.tree_unflatten(out, spec)
    module.forward = functionalized
    return module

theirs = tuple(torch_like(m, (torch.randn(8, 64, requires_grad=True),)) for m in layers())
x = torch.randn(8, 64, requires_grad=True)

def step(mods):
    for m in mods:
        for p in m.parameters():
            p.grad = None
    h = x
    for m in mods:
        h = m(h)
    h.sum().backward()

def fwd_only(mods):
    with torch.no_grad():
        h = x
        for m in mods:
            h = m(h)

for f in (step, fwd_only):
    s = {"ours": [], "torch-like": []}
    for r in range(400):
        for name, mods in (("ours", ours), ("torch-like", theirs)) if r % 2 else (("torch-like", theirs), ("ours", ours)):
            t = time.perf_counter()
            for _ in range(20):
                f(mods)
            s[name].append((time.perf_counter() - t) / 20 * 1e6)
    print(f.__name__, {k: f"min {min(v):.1f} med {statistics.median(v):.1f}" for k, v in s.items()})

if "-p" in sys.argv:
    import cProfile, pstats
    pr = cProfile.Profile(); pr.enable()
    for _ in range(3000): step(ours)
    pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(25)
