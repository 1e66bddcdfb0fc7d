"""A model compiled block by block (regional compilation), timed interleaved (CUDA only).

Twelve residual MLP blocks (Linear 1024 -> 2048 -> 1024, GELU, a scale buffer; batch 8, fp32),
one process, no grad. Methods: eager; ``tr.compile`` of the whole model; ``tr.compile`` of each
block (one backend per class: Dynamo compiles once, graphs per block); each block with a
backend object of its own (what ``tr.compile`` did before: Dynamo compiles each block again and
past its recompile limit, 8, runs the rest eagerly); ``torch.compile(mode="reduce-overhead")``
of each block. Every method is checked against eager first. Prints us per call (median,
synchronized), host us (min), first call s, Dynamo compiles and graphed blocks.

``--train``: a training step instead (the blocks in training mode, forward, ``square().mean()``,
backward, gradients set to None; the input requires grad), checked against eager's gradients;
methods: eager, ``tr.compile`` of the whole model, of each block (also with the CUDA driver's
copy nodes hidden at its capture: its graphs copy each call's input and incoming gradient in
with launches, as before session 63), and reduce-overhead of each block with a step marked per
call.

``--fsdp``: the training step with each block sharded by FSDP2 (``fully_shard``, one process,
world size 1, ``reshard_after_forward`` both ways); methods: eager, ``tr.compile`` of each block
(whose parameters move every call: it runs Inductor's code without graphs once it sees that),
``torch.compile`` of each block (Inductor, no graphs).

``--twice``: a training step that calls the model twice before one backward (a siamese or
contrastive loss: ``loss(model(a)) + loss(model(b))``); methods: eager, ``tr.compile`` of the
whole model and of each block (the second call replays a copy of each graph), the same with
``max_graphs=1`` (no room for a copy: the second call and its backward run without graphs, as
before session 55), and reduce-overhead of each block with a step marked per training step.

Usage: ``PYTHONPATH=. python benchmarks/regional_compile.py [--train | --fsdp | --twice]``
"""
from __future__ import annotations

import copy
import sys
import time
import types

import torch
import torch.nn as nn

sys.path.insert(0, ".")
import torchreplay as tr  # noqa: E402
from torchreplay._compat import copy_nodes  # noqa: E402
from torchreplay.bench.timing import BenchOptions, time_interleaved  # noqa: E402
from torchreplay.compile.backend import Backend  # noqa: E402
from torchreplay.config import CompileConfig  # noqa: E402
from torchreplay.models.blocks import ResidualBlock  # noqa: E402

BLOCKS, WIDTH, BATCH = 12, 1024, 8


def own_class(tag: str) -> type:
    """``ResidualBlock`` with a forward of its own code object: each method gets Dynamo
    caches of its own (they would share one recompile limit)."""
    code = ResidualBlock.forward.__code__.replace(co_name=f"forward_{tag}")
    forward = types.FunctionType(code, ResidualBlock.forward.__globals__, code.co_name)
    return type(f"Block_{tag}", (ResidualBlock,), {"forward": forward})


def fresh_copy(ref: nn.Module, tag: str) -> nn.Module:
    """A copy of ``ref`` whose blocks are of a class of their own (:func:`own_class`)."""
    model = copy.deepcopy(ref)
    cls = own_class(tag)
    for b in model:
        b.__class__ = cls
    return model


def marked(run):
    """torch's fix for reduce-overhead outputs overwritten by a later run: a step per call."""
    def step(x):
        torch.compiler.cudagraph_mark_step_begin()
        return run(x)
    return step


def chain(blocks):
    def run(x):
        for b in blocks:
            x = b(x)
        return x
    return run


copy_nodes.available()  # (loads the driver: kept here, put back after a method that hid it)
DRIVER = list(copy_nodes._driver)


def launches(build):
    """``build`` with the CUDA driver's copy nodes hidden until its first calls captured (undone
    by the check): its graphs copy the call's tensors in with launches, as before session 63."""
    def b(m):
        copy_nodes._driver[:] = [None]
        return build(m)
    return b


def train_main() -> None:
    """A training step per call, block by block: see the module's docstring."""
    torch.manual_seed(0)
    ref = nn.Sequential(*[ResidualBlock(WIDTH) for _ in range(BLOCKS)]).cuda().train()
    x = torch.randn(BATCH, WIDTH, device="cuda", requires_grad=True)
    builds = {
        "eager": lambda m: m,
        "tr.compile, whole model": lambda m: tr.compile(m, cache_dir=None),
        "tr.compile, each block": lambda m: chain([tr.compile(b, cache_dir=None) for b in m]),
        "tr.compile, each block, copy launches": launches(
            lambda m: chain([tr.compile(b, cache_dir=None) for b in m])),
        "reduce-overhead, each block, step marked": lambda m: marked(chain(
            [torch.compile(b, mode="reduce-overhead") for b in m])),
    }

    def step(fn, model):
        def run():
            out = fn(x)
            out.square().mean().backward()
            for p in model.parameters():
                p.grad = None
            x.grad = None
        return run

    ref(x).square().mean().backward()
    want = [p.grad.clone() for p in ref.parameters()] + [x.grad.clone()]
    ref.zero_grad(set_to_none=True)
    x.grad = None
    def check(fn, model):
        try:
            for _ in range(3):
                x.grad = None
                for p in model.parameters():
                    p.grad = None
                fn(x).square().mean().backward()
        finally:
            copy_nodes._driver[:] = DRIVER  # (hidden by launches() for one method's captures)
        torch.cuda.synchronize()
        for got, w in zip([p.grad for p in model.parameters()] + [x.grad], want):
            torch.testing.assert_close(got, w, rtol=2e-3, atol=2e-3)
        return step(fn, model)

    calls, errors, first = build_all(ref, builds, check, "t")
    res = time_interleaved(calls, BenchOptions(repeats=9, calls=20, warmup=5, host_calls=10))
    report(res, errors, first, "training step, ")


def twice_main() -> None:
    """A training step calling the model twice before its backward: see the module's docstring."""
    torch.manual_seed(0)
    ref = nn.Sequential(*[ResidualBlock(WIDTH) for _ in range(BLOCKS)]).cuda().train()
    a = torch.randn(BATCH, WIDTH, device="cuda")
    b = torch.randn(BATCH, WIDTH, device="cuda")

    def each(m, **kw):
        return chain([tr.compile(blk, cache_dir=None, **kw) for blk in m])

    builds = {
        "eager": lambda m: m,
        "tr.compile, whole model": lambda m: tr.compile(m, cache_dir=None),
        "tr.compile, whole model, max_graphs=1": lambda m: tr.compile(m, cache_dir=None, max_graphs=1),
        "tr.compile, each block": lambda m: each(m),
        "tr.compile, each block, max_graphs=1": lambda m: each(m, max_graphs=1),
        "reduce-overhead, each block": lambda m: chain(
            [torch.compile(blk, mode="reduce-overhead") for blk in m]),
    }

    def loss(fn):
        return fn(a).square().mean() + fn(b).pow(2).sum() * 1e-3

    def run_step(fn, model):
        def run():
            torch.compiler.cudagraph_mark_step_begin()  # (for reduce-overhead; nothing for others)
            loss(fn).backward()
            for p in model.parameters():
                p.grad = None
        return run

    loss(ref).backward()
    want = [p.grad.clone() for p in ref.parameters()]
    ref.zero_grad(set_to_none=True)

    def check(fn, model):
        for _ in range(3):
            for p in model.parameters():
                p.grad = None
            torch.compiler.cudagraph_mark_step_begin()
            loss(fn).backward()
        torch.cuda.synchronize()
        for got, w in zip([p.grad for p in model.parameters()], want):
            torch.testing.assert_close(got, w, rtol=2e-3, atol=2e-3)
        return run_step(fn, model)

    calls, errors, first = build_all(ref, builds, check, "w")
    res = time_interleaved(calls, BenchOptions(repeats=9, calls=20, warmup=5, host_calls=10))
    report(res, errors, first, "training step, the model called twice before one backward, ")


def fsdp_main() -> None:
    """A training step per call, each block sharded by FSDP2: see the module's docstring."""
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.manual_seed(0)
    ref = nn.Sequential(*[ResidualBlock(WIDTH) for _ in range(BLOCKS)]).cuda().train()
    x = torch.randn(BATCH, WIDTH, device="cuda", requires_grad=True)
    ref(x).square().mean().backward()
    want = [p.grad.clone() for p in ref.parameters()]
    ref.zero_grad(set_to_none=True)

    def grads(model):
        return [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                for p in model.parameters()]

    def run_step(fn, model):
        def run():
            fn(x).square().mean().backward()
            for p in model.parameters():
                p.grad = None
            x.grad = None
        return run

    def check(fn, model):
        for _ in range(4):
            for p in model.parameters():
                p.grad = None
            fn(x).square().mean().backward()
        for got, w in zip(grads(model), want):
            torch.testing.assert_close(got, w, rtol=2e-3, atol=2e-3)
        return run_step(fn, model)

    for reshard in (True, False):
        def shard(m, reshard=reshard):
            for b in m:
                fully_shard(b, reshard_after_forward=reshard)
            return fully_shard(m)

        builds = {
            "eager FSDP2": lambda m: shard(m),
            "tr.compile, each block": lambda m: chain([tr.compile(b, cache_dir=None) for b in shard(m)]),
            "torch.compile, each block (Inductor)": lambda m: chain([torch.compile(b) for b in shard(m)]),
        }
        torch._dynamo.reset()
        calls, errors, first = build_all(ref, builds, check, f"f{int(reshard)}")
        res = time_interleaved(calls, BenchOptions(repeats=9, calls=20, warmup=5, host_calls=10))
        report(res, errors, first, f"FSDP2 reshard_after_forward={reshard}, training step, ")
    dist.destroy_process_group()


def build_all(ref, builds, check, tag: str = ""):
    """Build each method on a fresh copy of ``ref``; ``check(fn, model)`` runs it against eager
    and returns the call to time. Returns the calls, the failures (a row each, not a crash) and
    per method the first calls' seconds and Dynamo graphs."""
    calls, errors, first = {}, {}, {}
    for k, (name, build) in enumerate(builds.items()):
        counters_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        model = fresh_copy(ref, f"{tag}{k}")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            call = check(build(model), model)
        except Exception as exc:  # noqa: BLE001 - a failing method is a row, not a crash
            errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:150]}"
            continue
        first[name] = (time.perf_counter() - t0,
                       torch._dynamo.utils.counters["stats"]["unique_graphs"] - counters_before)
        calls[name] = call
    return calls, errors, first


def report(res, errors, first, what: str = "") -> None:
    print(f"{what}{BLOCKS} blocks, batch {BATCH}, width {WIDTH}, fp32; {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}")
    for name, e in errors.items():
        print(f"{name:44s} failed: {e}")
    for name, v in res.items():
        s, graphs = first[name]
        if isinstance(v, str):
            print(f"{name:44s} error: {v}")
            continue
        print(f"{name:44s} {v[0]:8.1f} us/call  host min {v[1]:7.1f}  first 3 calls {s:6.2f} s  "
              f"Dynamo graphs {graphs}")


def main() -> None:
    if "--train" in sys.argv:
        return train_main()
    if "--fsdp" in sys.argv:
        return fsdp_main()
    if "--twice" in sys.argv:
        return twice_main()
    torch.manual_seed(0)
    ref = nn.Sequential(*[ResidualBlock(WIDTH) for _ in range(BLOCKS)]).cuda().eval()
    x = torch.randn(BATCH, WIDTH, device="cuda")
    builds = {
        "eager": lambda m: m,
        "tr.compile, whole model": lambda m: tr.compile(m, cache_dir=None),
        "tr.compile, each block": lambda m: chain([tr.compile(b, cache_dir=None) for b in m]),
        "each block, a backend object each (before)": lambda m: chain(
            [torch.compile(b, backend=Backend(CompileConfig(cache_dir=None))) for b in m]),
        "reduce-overhead, each block": lambda m: chain(
            [torch.compile(b, mode="reduce-overhead") for b in m]),
        "reduce-overhead, each block, step marked": lambda m: marked(chain(
            [torch.compile(b, mode="reduce-overhead") for b in m])),
    }
    def check(fn, model):
        for _ in range(3):  # reduce-overhead records at its second call
            out = fn(x)
        torch.cuda.synchronize()
        torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3)
        return lambda: fn(x)

    with torch.no_grad():
        want = ref(x)
        calls, errors, first = build_all(ref, builds, check)
        res = time_interleaved(calls, BenchOptions(repeats=9, calls=40, warmup=10, host_calls=10))
    report(res, errors, first)


if __name__ == "__main__":
    main()
