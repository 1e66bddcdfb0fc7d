"""PyTorch's own CUDA-graph tests (``test/test_cuda.py``: ``TestCuda.test_graph_*``,
``TestCuda.test_make_graphed_callables*``, the graphed-optimizer tests and ``TestCudaOptims``),
ported to run against torchreplay.

Each test names the torch test it ports in its docstring and checks what that test checks, with
``tr.graph`` in place of ``with torch.cuda.graph(g): ...; g.replay()``,
``tr.make_graphed_callables`` in place of ``torch.cuda.make_graphed_callables`` and
``tr.graph_step`` for a captured optimizer step, against eager on fresh random inputs over
several replays. Where torch is silently wrong and torchreplay deliberately differs, the test
asserts torchreplay's behaviour and a comment says why.

Not ported (raw ``CUDAGraph`` internals, not behaviour of graphing a callable): debug dumps,
timing with external events, ``instantiate``/raw graph handles, conditional nodes, allocator
block-state checkpoints, memory-stat bookkeeping of raw private pools, graph-safe generator
state registration, capture on the default stream, record_stream during capture.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import inspect
import logging
import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import torchreplay as tr

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEV = "cuda"
MiB = 2**20
# Graph and eager run the same kernels; cuBLAS may still pick another algorithm on another
# stream, so matmul results are compared within a small tolerance, elementwise ones bitwise.
TOL = dict(rtol=1e-4, atol=1e-5)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def line_of(marker: str) -> int:
    """The line number in this file of the line that carries ``marker``."""
    for i, line in enumerate(open(__file__).read().splitlines(), start=1):
        if marker in line and "line_of(" not in line:
            return i
    raise AssertionError(marker)


def value_or_stale(t: torch.Tensor, expected: torch.Tensor) -> str:
    """``t`` holds ``expected`` ("value"), or reading it raises a RuntimeError whose message starts
    with ``StaleOutputError`` ("stale"). Anything else (a wrong value, another error) fails."""
    try:
        same = torch.equal(t, expected)
    except RuntimeError as e:
        assert str(e).lstrip().startswith("StaleOutputError"), str(e)
        return "stale"
    assert same, "a checked output silently holds a wrong value"
    return "value"


@contextlib.contextmanager
def messages(caplog: pytest.LogCaptureFixture):
    """Collect the text of every warning and every log record at WARNING or above."""
    out: list[str] = []
    with caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = len(caplog.records)
        yield out
    out.extend(str(w.message) for w in caught)
    out.extend(r.getMessage() for r in caplog.records[start:])


def func_with_temps(t: torch.Tensor, val: float) -> torch.Tensor:
    x = t.clone() + val
    y = t.clone() + val
    return x + y


# == capture and replay ===========================================================================


def _add_ten(b: torch.Tensor) -> torch.Tensor:
    for _ in range(10):
        b = b + 1
    return b


def test_graph_capture_simple() -> None:
    """ports TestCuda.test_graph_capture_simple"""
    a = torch.full((1000,), 1.0, device=DEV)
    g = tr.graph(_add_ten, a)
    assert g(a).sum().item() == 11000.0
    for _ in range(20):
        x = torch.randn(1000, device=DEV)
        assert torch.equal(g(x), _add_ten(x))
    assert g.stats.captures == 1 and g.stats.replays == 21


def test_graph_capture_reset_recapture() -> None:
    """ports TestCuda.test_graph_capture_reset_recapture: capture, drop, capture something else;
    the second callable writes its argument in place (``b.fill_(2.0)``), which must reach the
    caller's tensor after each replay, as it would eagerly."""
    a = torch.full((1000,), 1.0, device=DEV)
    g = tr.graph(_add_ten, a)
    assert g(a).sum().item() == 11000.0
    del g

    def fill_then_add(b):
        b.fill_(2.0)
        for _ in range(10):
            b = b + 2
        return b

    buf = torch.full((1000,), 1.0, device=DEV)
    g = tr.graph(fill_then_add, buf)
    assert torch.equal(buf, torch.full_like(buf, 1.0)), "building the graph wrote the sample"
    assert g(buf).sum().item() == 22000.0
    assert torch.equal(buf, torch.full_like(buf, 2.0)), "the in-place write did not reach the caller"
    for _ in range(5):
        x = torch.randn(1000, device=DEV)
        x_ref = x.clone()
        ref = fill_then_add(x_ref)
        assert torch.equal(g(x), ref)
        assert torch.equal(x, x_ref)


def test_graph_function_without_tensor_arguments() -> None:
    """ports TestCuda.test_graph_rng_distributions (torch.randn with no tensor argument): a
    function of no arguments, graphed with ``device=``, draws fresh numbers every replay and the
    same numbers as eager from the same seed."""

    def fn():
        return torch.randn(4, device=DEV) * 2

    g = tr.graph(fn, device=DEV)
    draws = [g().clone() for _ in range(4)]
    for i in range(len(draws)):
        for j in range(i):
            assert not torch.equal(draws[i], draws[j]), "two replays drew the same numbers"
    for seed in (0, 1, 123):
        torch.cuda.manual_seed(seed)
        got1 = g().clone()
        got2 = g().clone()
        torch.cuda.manual_seed(seed)
        ref1 = fn()
        ref2 = fn()
        assert torch.equal(got1, ref1) and torch.equal(got2, ref2)
        # replays and eager calls share one RNG stream, as two eager calls do
        torch.cuda.manual_seed(seed)
        g()
        mixed = fn()
        assert torch.equal(mixed, ref2)


# == RNG ==========================================================================================


@pytest.mark.parametrize(
    "op, kwargs",
    [(F.dropout, {"p": 0.1}), (F.rrelu, {"training": True})],
    ids=["dropout", "rrelu"],
)
def test_graph_rng_functional(op, kwargs) -> None:
    """ports TestCuda.test_graph_rng_functional"""
    size = 10000
    a = torch.randn(size, device=DEV)

    def twice(t):
        return op(op(t, **kwargs), **kwargs)

    # Control: six applications from seed 5.
    torch.cuda.manual_seed(5)
    eager_out = a
    for _ in range(6):
        eager_out = op(eager_out, **kwargs)

    g = tr.graph(twice, a)
    # graphed -> eager -> graphed: six applications in total, as the control.
    torch.cuda.manual_seed(5)
    out = g(a)
    out = op(out, **kwargs)
    out = op(out, **kwargs)
    graph_out = g(out).clone()
    assert torch.equal(graph_out, eager_out)

    # every replay draws a fresh mask
    r1, r2 = g(a).clone(), g(a).clone()
    assert not torch.equal(r1, r2)

    for seed in (6, 128, 9999):
        torch.cuda.manual_seed(seed)
        for _ in range(3):
            graph_out = g(a).clone()
        # a new seed gives new numbers
        assert not torch.equal(graph_out, eager_out)
        torch.cuda.manual_seed(seed)
        for _ in range(3):
            eager_out = twice(a)
        assert torch.equal(graph_out, eager_out)


_RNG_SIZE = 10000
# name: (one draw, its arguments from (inp, alloc)); torch's list of ops and tensor methods.
_RNG_CASES = {
    "torch.bernoulli": (lambda p: torch.bernoulli(p), lambda inp, alloc: (inp,)),
    "torch.normal": (lambda mean: torch.normal(mean, 1.0), lambda inp, alloc: (inp + 1,)),
    "torch.poisson": (lambda rate: torch.poisson(rate), lambda inp, alloc: (inp,)),
    "torch.rand": (lambda: torch.rand(_RNG_SIZE, device=DEV), lambda inp, alloc: ()),
    "torch.randint": (
        lambda: torch.randint(0, 3, (_RNG_SIZE,), device=DEV, dtype=torch.float),
        lambda inp, alloc: (),
    ),
    "torch.randn": (lambda: torch.randn(_RNG_SIZE, device=DEV), lambda inp, alloc: ()),
    "Tensor.bernoulli_": (lambda t, p: t.clone().bernoulli_(p), lambda inp, alloc: (alloc, inp)),
    "Tensor.cauchy_": (lambda t: t.clone().cauchy_(), lambda inp, alloc: (alloc,)),
    "Tensor.exponential_": (lambda t: t.clone().exponential_(), lambda inp, alloc: (alloc,)),
    "Tensor.geometric_": (lambda t: t.clone().geometric_(0.3), lambda inp, alloc: (alloc,)),
    "Tensor.log_normal_": (lambda t: t.clone().log_normal_(), lambda inp, alloc: (alloc,)),
    "Tensor.normal_": (lambda t: t.clone().normal_(), lambda inp, alloc: (alloc,)),
    "Tensor.random_": (lambda t: t.clone().random_(), lambda inp, alloc: (alloc,)),
    "Tensor.uniform_": (lambda t: t.clone().uniform_(), lambda inp, alloc: (alloc,)),
}


@pytest.mark.parametrize("name", list(_RNG_CASES))
def test_graph_rng_distributions(name: str) -> None:
    """ports TestCuda.test_graph_rng_distributions: after ``manual_seed(seed)`` and one eager
    draw, a replay of two draws gives exactly the next two eager draws."""
    draw, make_args = _RNG_CASES[name]
    inp = torch.rand(_RNG_SIZE, device=DEV)
    alloc = torch.zeros(_RNG_SIZE, device=DEV)
    args = make_args(inp, alloc)

    def two_draws(*a):
        return draw(*a), draw(*a)

    g = tr.graph(two_draws, *args, device=DEV)
    for seed in (6, 314, 271):
        torch.cuda.manual_seed(seed)
        draw(*args)  # the dummy draw: replay must start where it left the RNG
        control1, control2 = two_draws(*args)
        torch.cuda.manual_seed(seed)
        draw(*args)
        t1, t2 = g(*args)
        assert torch.equal(t1, control1) and torch.equal(t2, control2), seed
        assert not torch.equal(t1, t2)


# == several graphs ===============================================================================


def _five(val: float):
    def fn(t):
        for _ in range(5):
            t = func_with_temps(t, val)
        return t

    return fn


@pytest.mark.parametrize("share", ["separate pools", "one pool"])
def test_graph_two_successive(share: str) -> None:
    """ports TestCuda.test_graph_two_successive: two graphs, alone or sharing a pool, replayed in
    turn with unrelated eager work in between."""
    size = 1000
    five = _five(1)
    a = torch.ones(size, device=DEV)
    g0 = tr.graph(five, a)
    g1 = tr.graph(five, a, pool=g0 if share == "one pool" else None)
    assert (g1.pool is g0.pool) == (share == "one pool")

    c = a.clone()
    for _ in range(2):
        c = func_with_temps(c, 3)
    b = g0(a)
    for _ in range(2):
        c = func_with_temps(c, 3)
    b = g1(b)
    for _ in range(2):
        c = func_with_temps(c, 3)
    assert b.sum().item() == size * 3070
    assert c.sum().item() == size * 442

    for _ in range(5):
        x = torch.randn(size, device=DEV)
        assert torch.equal(g1(g0(x)), five(five(x)))


def test_graph_concurrent_replay() -> None:
    """ports TestCuda.test_graph_concurrent_replay (its "Don't share" case): two graphs in their
    own pools replayed at the same time on two streams do not corrupt each other.

    Torch's shared-pool cases assert that concurrent replays *do* corrupt each other; a Pool's
    documented contract is that graphs sharing it never run concurrently, so they are not ported.
    """
    size = 1_000_000  # largeish, to expose races
    a = torch.ones(size, device=DEV)
    g0 = tr.graph(_five(1), a)
    g1 = tr.graph(_five(2), a)
    s0, s1 = torch.cuda.Stream(), torch.cuda.Stream()
    cur = torch.cuda.current_stream()
    for i in range(4):
        x = a if i == 0 else torch.randn(size, device=DEV)
        torch.cuda.synchronize()
        with torch.cuda.stream(s0):
            torch.cuda._sleep(1_000_000)  # line the two replays up on the device
            s1.wait_stream(s0)
            b = g0(x)
        with torch.cuda.stream(s1):
            c = g1(x)
        cur.wait_stream(s0)
        cur.wait_stream(s1)
        if i == 0:
            assert b.sum().item() == size * 94
            assert c.sum().item() == size * 156
        else:
            assert torch.equal(b, _five(1)(x))
            assert torch.equal(c, _five(2)(x))
        torch.cuda.synchronize()


@pytest.mark.parametrize("share", ["separate pools", "one pool"])
def test_graph_three_successive(share: str) -> None:
    """ports TestCuda.test_graph_three_successive: replaying in capture order is valid; replaying
    out of order in a shared pool is where torch silently corrupts a result (``e`` becomes
    ``f + 3``). Deliberate difference: torchreplay's results are right, or reading one raises
    ``StaleOutputError``; never a wrong value."""
    size = 1000
    a = torch.ones(size, device=DEV)
    g0 = tr.graph(lambda t: (t.clone() + 1, t.clone() + 2), a)
    c0, d0 = (t.clone() for t in g0(a))
    pool = g0 if share == "one pool" else None
    g1 = tr.graph(lambda c: c + 3, c0, pool=pool)
    g2 = tr.graph(lambda d: d + 4, d0, pool=pool)

    c, d = g0(a)
    e = g1(c)
    f = g2(d)
    assert e.sum().item() == size * 5 and f.sum().item() == size * 7

    for _ in range(3):  # capture order, fresh inputs
        x = torch.randn(size, device=DEV)
        c, d = g0(x)
        e = g1(c)
        f = g2(d)
        assert torch.equal(e, x + 1 + 3) and torch.equal(f, x + 2 + 4)

    for i in range(3):  # g0, g2, g1
        x = a if i == 0 else torch.randn(size, device=DEV)
        c, d = g0(x)
        f = g2(d)
        e = g1(c)
        assert torch.equal(e, x + 1 + 3)  # torch's shared-pool run gets f + 3 here
        if share == "separate pools":
            assert torch.equal(f, x + 2 + 4)
        else:
            value_or_stale(f, x + 2 + 4)


_AFTER_DEL_SCRIPT = r"""
import gc
import torch
import torchreplay as tr

def chain(t):
    b = t.clone()
    for _ in range(5):
        b = b.clone() + 1
    return b

# torch's cases: small pool, two small blocks, large pool, just under and just over
# kMinLargeAlloc (10 MiB)
sizes = [512 // 4, 1048576 // 4, (1048576 + 512) // 4, (10485760 - 512) // 4, (10485760 + 512) // 4]
for policy in ("checked", "static", "clone"):
    for numel in sizes:
        a = torch.ones(numel, device="cuda")
        g = tr.graph(chain, a, outputs=policy)
        b = g(a)
        assert b.sum().item() == 6 * numel, (policy, numel, "before del")
        del g
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        # New allocations may land where the graph's memory was: a silently stale read sees -7s.
        junk = [torch.full((numel,), -7.0, device="cuda") for _ in range(3)]
        try:
            value = b.sum().item()
        except RuntimeError as e:
            if policy != "checked" or not str(e).lstrip().startswith("StaleOutputError"):
                raise
            print(policy, numel, "stale", flush=True)
        else:
            assert value == 6 * numel, (policy, numel, value)
            print(policy, numel, "value", flush=True)
        torch.cuda.synchronize()
        del junk, b, a
print("DONE", flush=True)
"""


def test_graph_memory_stats_and_use_result_after_destroy_graph() -> None:
    """ports TestCuda.test_graph_memory_stats_and_use_result_after_destroy_graph (the "uses graph
    result b after graph has been deleted" part; the allocator-stat bookkeeping is internals).

    After ``del g`` and ``empty_cache``, an output must still hold its value (the ``static`` and
    ``clone`` policies, as torch's), or, for a checked output, raise a RuntimeError whose message
    starts with ``StaleOutputError``: never a wrong value, never a crash. It runs in a child
    process so that an illegal memory access cannot take this test session down with it.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run(
        [sys.executable, "-c", _AFTER_DEL_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    report = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, report
    assert "DONE" in proc.stdout, report


# == memory and failures ==========================================================================


def _used_bytes() -> int:
    gc.collect()
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def test_repeat_graph_capture_cublas_workspace_memory() -> None:
    """ports TestCuda.test_repeat_graph_capture_cublas_workspace_memory: capture and drop a small
    cuBLAS matmul 100 times; device memory (``mem_get_info``, no ``empty_cache`` by the test)
    stays flat within a few MiB after the first few. (torch.cuda.graph empties the cache on
    entry; here a graph that was dropped must not keep its memory.)"""
    a = torch.rand(1024, 512, device=DEV)
    b = torch.rand(512, 64, device=DEV)
    torch.mm(a, b)  # warm-up of the caller's stream
    base = None
    for i in range(100):
        g = tr.graph(torch.mm, a, b)
        out = g(a, b)
        if i < 3:
            torch.testing.assert_close(out, a @ b, **TOL)
        del out, g
        if i == 4:
            base = _used_bytes()
    grown = _used_bytes() - base
    assert grown <= 8 * MiB, f"device memory grew by {grown / MiB:.1f} MiB over 95 captures"


@pytest.mark.parametrize("when", ["warm-up", "capture"])
def test_graph_capture_oom(when: str) -> None:
    """ports TestCuda.test_graph_capture_oom: an allocation that cannot succeed (4 TiB) fails the
    capture with an error naming "out of memory", and the process stays usable."""

    def fn(t):
        y = t * 2
        if when == "warm-up" or torch.cuda.is_current_stream_capturing():
            y = y + torch.zeros(2**40, device=t.device)[:1]
        return y

    x = torch.randn(256, 256, device=DEV)
    gc.collect()
    allocated = torch.cuda.memory_allocated()
    with pytest.raises(tr.CaptureError, match="out of memory") as e:
        tr.graph(fn, x)
    del e
    assert not torch.cuda.is_current_stream_capturing()
    gc.collect()
    assert torch.cuda.memory_allocated() == allocated, "the failed capture kept memory"
    assert torch.equal(x + 1, x.add(1.0))
    g = tr.graph(lambda t: t * 2, x)
    for _ in range(3):
        x = torch.randn(256, 256, device=DEV)
        assert torch.equal(g(x), x * 2)


def _sync_by_tensor_index(a, b, perm):
    idx = perm[0]
    a[0] *= b[idx]  # sync-by-index
    return a


def _sync_by_item(x):
    s = x.sum().item()  # sync-by-item
    return x * s


@pytest.mark.parametrize("case", ["tensor index", "item"])
def test_cuda_graph_tensor_item_not_allowed(case: str) -> None:
    """ports TestCuda.test_cuda_graph_tensor_item_not_allowed (torch runs it in a child process:
    the failed capture breaks its process). Here it is a ``tr.CaptureError`` naming the line, and
    the next eager call and the next capture work."""
    if case == "tensor index":
        a = torch.rand(500, 500, device=DEV)
        b = torch.rand(500, 500, device=DEV)
        perm = torch.randint(0, 500, (500,), device=DEV)
        fn, args, marker = _sync_by_tensor_index, (a, b, perm), "# sync-by-index"
    else:
        x = torch.randn(64, 64, device=DEV)
        fn, args, marker = _sync_by_item, (x,), "# sync-by-item"
    with pytest.raises(tr.CaptureError) as e:
        tr.graph(fn, *args)
    msg = str(e.value)
    del e
    assert f"{__file__}:{line_of(marker)}" in msg, msg
    assert not torch.cuda.is_current_stream_capturing()
    # the next eager call works
    if case == "tensor index":
        expected = a.clone()
        expected[0] *= b[int(perm[0])]
        assert torch.equal(fn(a, b, perm), expected)
    else:
        torch.testing.assert_close(fn(x), x * x.sum())
    g = tr.graph(lambda t: t * 2, args[0])
    y = torch.randn_like(args[0])
    assert torch.equal(g(y), y * 2)


def test_graph_warn_if_has_zero_nodes() -> None:
    """ports TestCuda.test_graph_warn_if_has_zero_nodes. Deliberate difference: torch warns that
    the graph is empty and hands back a graph that does nothing; a callable that records no CUDA
    work is a ``tr.CaptureError`` here (it ran on the CPU, or did nothing)."""
    x = torch.randn(8, device=DEV)
    with pytest.raises(tr.CaptureError, match="empty graph"):
        tr.graph(lambda t: t.view(-1), x)
    g = tr.graph(lambda t: t + 1, x)
    assert torch.equal(g(x), x + 1)


@pytest.mark.parametrize("mode", ["thread_local", "relaxed"])
def test_cuda_graph_error_options(mode: str) -> None:
    """ports TestCuda.test_cuda_graph_error_options: with ``capture_error_mode="thread_local"`` or
    ``"relaxed"``, another thread allocating on its own stream during capture does not fail it."""

    def raw_malloc():
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                mem = torch.cuda.caching_allocator_alloc(1024)
            torch.cuda.caching_allocator_delete(mem)
        except Exception:  # noqa: BLE001 - as torch's test: only the capture is under test
            pass

    def fn(x):
        y = x + x + x
        thread = threading.Thread(target=raw_malloc)
        thread.start()
        thread.join()
        return y

    x = torch.randn(2000, device=DEV)
    g = tr.graph(fn, x, capture_error_mode=mode)
    for _ in range(3):
        x = torch.randn(2000, device=DEV)
        assert torch.equal(g(x), x + x + x)


def test_graph_cudnn_dropout() -> None:
    """ports TestCuda.test_graph_cudnn_dropout: a cuDNN LSTM with dropout, graphed in training
    mode, replays, and eager calls (forward and backward) before and after replays keep working
    (cuDNN's dropout state must not sync a capturing stream with a non-capturing one)."""
    torch.manual_seed(0)
    model = nn.LSTM(64, 64, 2, dropout=0.5).to(DEV)
    x = torch.ones(10, 8, 64, device=DEV)
    model(x)
    g = tr.graph(model, x)
    for _ in range(3):
        out, (h, c) = g(torch.randn(10, 8, 64, device=DEV))
        assert out.shape == (10, 8, 64) and h.shape == c.shape == (2, 8, 64)
        assert torch.isfinite(out).all()
    out, _ = model(x)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    out, _ = g(x)
    assert torch.isfinite(out).all()
    torch.cuda.synchronize()


def _sigmoid_noise(x):
    return x * torch.sigmoid(torch.randn(1, device=DEV))


@pytest.mark.parametrize("tool", ["graph", "make_graphed_callables"])
def test_graph_checkpoint_preserve_rng_state(tool: str) -> None:
    """ports TestCuda.test_graph_checkpoint_preserve_rng_state: activation checkpointing with
    ``preserve_rng_state=True`` recomputes the same random numbers inside a graph, so the
    gradient equals eager's bitwise.

    ``graph``: forward and backward in one graph, as torch's test. ``make_graphed_callables``:
    forward and backward in two graphs; refusing it (UnsupportedError or CaptureError) is
    acceptable, a silently different gradient is not."""
    _sigmoid_noise(torch.ones(1, device=DEV))

    def eager_grad(seed):
        torch.cuda.manual_seed(seed)
        x = torch.ones(1, device=DEV, requires_grad=True)
        out = checkpoint(_sigmoid_noise, x, use_reentrant=False, preserve_rng_state=True)
        return torch.autograd.grad(out, x)[0]

    if tool == "graph":

        def fwd_bwd(inp):
            with torch.enable_grad():
                x = inp.detach().requires_grad_()
                out = checkpoint(_sigmoid_noise, x, use_reentrant=False, preserve_rng_state=True)
                return torch.autograd.grad(out, x)[0]

        g = tr.graph(fwd_bwd, torch.ones(1, device=DEV))
        for seed in (42, 7, 42):
            want = eager_grad(seed)
            torch.cuda.manual_seed(seed)
            got = g(torch.ones(1, device=DEV))
            assert torch.equal(got, want), (seed, got, want)
        return

    def ckpt(x):
        return checkpoint(_sigmoid_noise, x, use_reentrant=False, preserve_rng_state=True)

    try:
        f = tr.make_graphed_callables(ckpt, (torch.ones(1, device=DEV, requires_grad=True),))
    except (tr.UnsupportedError, tr.CaptureError):
        return
    for seed in (42, 7, 42):
        want = eager_grad(seed)
        torch.cuda.manual_seed(seed)
        x = torch.ones(1, device=DEV, requires_grad=True)
        got = torch.autograd.grad(f(x), x)[0]
        assert torch.equal(got, want), (seed, got, want)


# == make_graphed_callables =======================================================================


class _MLP1(nn.Module):
    def __init__(self, d_in: int, h: int, d_out: int) -> None:
        super().__init__()
        self.net_1 = nn.Sequential(nn.Linear(d_in, h), nn.Dropout(p=0.1))
        self.net_2 = nn.Sequential(nn.Linear(h, d_out), nn.Dropout(p=0.2))

    def forward(self, input_dict: dict):
        return self.net_2(self.net_1(input_dict["x"]))


class _MLP2(nn.Module):
    def __init__(self, d_in: int, h: int, d_out: int) -> None:
        super().__init__()
        self.net_1 = nn.Sequential(nn.Linear(d_in, h), nn.Dropout(p=0.1))
        self.net_2 = nn.Sequential(nn.Linear(h, d_out), nn.Dropout(p=0.2))

    def forward(self, x):
        return self.net_2(self.net_1(x))


class _ParameterlessModule(nn.Module):
    def forward(self, x):
        idx = torch.arange(x.size(0), device=x.device).view(-1, 1).repeat(1, x.size(1))
        return {"output": torch.gather(x, 0, idx)}


class _ParameterlessDictModule(nn.Module):
    def forward(self, input_dict: dict):
        x = input_dict["x"]
        idx = torch.arange(x.size(0), device=x.device).view(-1, 1).repeat(1, x.size(1))
        return {"output": torch.gather(x, 0, idx)}


def _autocast(with_amp: bool, cache_enabled: bool):
    return torch.amp.autocast(device_type="cuda", enabled=with_amp, cache_enabled=cache_enabled)


def _assert_same_training(p0, graphed: nn.Module, control: nn.Module, rel: float) -> None:
    """Graphed and eager parameters agree to ``rel`` of how far eager training moved them (the
    updates are small next to the weights, so an absolute tolerance would hide a wrong mask)."""
    for (name, p), q, start in zip(graphed.named_parameters(), control.parameters(), p0):
        moved = (q - start).abs().max().item()
        diff = (p - q).abs().max().item()
        assert moved > 0, f"{name}: eager training did not move it"
        assert diff <= rel * moved + 1e-7, (
            f"{name}: graphed and eager differ by {diff:.3g}; eager moved it by {moved:.3g}"
        )


@pytest.mark.parametrize(
    "with_amp, cache_enabled",
    [(False, False), (True, False), (True, True)],
    ids=[
        "without_amp_allow_unused_input",
        "with_amp_cache_disabled_allow_unused_input",
        "with_amp_cache_enabled_allow_unused_input",
    ],
)
def test_graph_make_graphed_callables(with_amp: bool, cache_enabled: bool) -> None:
    """ports TestCuda.test_graph_make_graphed_callables, torch's stress test: five callables in one
    pool (a dict-taking module with dropout, a module with dropout, a dict-returning module
    without parameters, and two functions), trained 10 steps against an eager twin from the same
    seed (bitwise-equal dropout masks), then run eagerly in eval mode.

    Deliberate difference: with ``cache_enabled=True`` torch refuses (an expected failure in
    torch's suite); torchreplay turns the autocast weight cache off while it captures, so casts
    of weights stay in the graph and follow the optimizer steps.

    Under autocast, ``model[0]`` returns float16 where ``model[1]``'s sample was float32 (and so
    on down the chain): a lossless widening copy, accepted (torch's copies silently).
    """
    torch.manual_seed(5)
    torch.cuda.manual_seed(5)
    N, D_in, H, D_out = 64, 256, 128, 64  # torch's are 640, 4096, 2048, 1024
    models = [
        nn.Sequential(_MLP1(D_in, H, H), _MLP2(H, H, D_out), _ParameterlessModule()).to(DEV)
        for _ in range(2)
    ]
    model_graphed, model_control = models
    model_graphed.load_state_dict(model_control.state_dict())
    p0 = [p.detach().clone() for p in model_control.parameters()]
    opt_graphed = torch.optim.SGD(model_graphed.parameters(), lr=0.1)
    opt_control = torch.optim.SGD(model_control.parameters(), lr=0.1)

    x = torch.randn(N, D_in, device=DEV)
    h = torch.randn(N, H, device=DEV, requires_grad=True)
    h2 = torch.randn(N, D_out, device=DEV, requires_grad=True)
    unused_input = torch.randn(N, H, device=DEV, requires_grad=True)
    y_pred = torch.randn(N, D_out, device=DEV, requires_grad=True)
    y = torch.randn(N, D_out, device=DEV)
    loss_fn_control = F.mse_loss
    relu_control = F.relu

    with _autocast(with_amp, cache_enabled):
        (
            model_graphed[0],
            model_graphed[1],
            model_graphed[2],
            relu_graphed,
            loss_fn_graphed,
        ) = tr.make_graphed_callables(
            (model_graphed[0], model_graphed[1], model_graphed[2], relu_control, loss_fn_control),
            (
                ({"x": x, "unused_input": unused_input},),
                (h,),
                (h2,),
                (y_pred,),
                (y_pred, y),
            ),
            allow_unused_input=True,
        )

    real_inputs = [torch.rand_like(x) for _ in range(10)]
    real_targets = [torch.rand_like(y) for _ in range(10)]
    losses = {}
    for label, m, opt, relu, loss_fn in (
        ("graphed", model_graphed, opt_graphed, relu_graphed, loss_fn_graphed),
        ("control", model_control, opt_control, relu_control, loss_fn_control),
    ):
        # The same RNG state before each run: the dropout masks must be bitwise the same.
        torch.manual_seed(5)
        torch.cuda.manual_seed(5)
        losses[label] = []
        for data, target in zip(real_inputs, real_targets):
            opt.zero_grad(set_to_none=True)
            with _autocast(with_amp, cache_enabled):
                out = m({"x": data, "unused_input": unused_input})["output"]
                out = relu(out)
                loss = loss_fn(out, target)
                loss.backward()
            opt.step()
            losses[label].append(loss.detach().clone())
    assert unused_input.grad is None
    rel = 2e-2 if with_amp else 1e-3
    for a, b in zip(losses["graphed"], losses["control"]):
        torch.testing.assert_close(a, b, rtol=rel, atol=1e-6)
    _assert_same_training(p0, model_graphed, model_control, rel)
    stats = model_graphed[0].forward.stats
    assert (stats.replays, stats.backward_replays) == (10, 10)

    # Graphed in training mode: eval runs eagerly (no "unused_input" key: the graph is not used).
    model_graphed.eval()
    model_control.eval()
    torch.testing.assert_close(
        model_graphed({"x": real_inputs[0]}), model_control({"x": real_inputs[0]})
    )


def test_graph_make_graphed_callables_not_allow_unused_input() -> None:
    """ports TestCuda.test_graph_make_graphed_callables[without_amp_not_allow_unused_input] (an
    expected failure in torch's suite: an input that requires grad but is unused). Here graphing
    raises an error that names ``allow_unused_input=True``, leaves the module as it was, and the
    same call with ``allow_unused_input=True`` works."""
    torch.manual_seed(5)
    N, D_in, H = 32, 64, 32
    model = _MLP1(D_in, H, H).to(DEV)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(N, D_in, device=DEV)
    unused_input = torch.randn(N, H, device=DEV, requires_grad=True)
    with pytest.raises(RuntimeError, match="allow_unused_input=True"):
        tr.make_graphed_callables(model, ({"x": x, "unused_input": unused_input},))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not isinstance(model.forward, tr.GraphedCallable)
    model({"x": x}).sum().backward()  # eager still works
    model.zero_grad(set_to_none=True)

    tr.make_graphed_callables(
        model, ({"x": x, "unused_input": unused_input},), allow_unused_input=True
    )
    model({"x": torch.rand_like(x), "unused_input": unused_input}).sum().backward()
    assert unused_input.grad is None
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(
    "with_amp, cache_enabled, allow_unused_input",
    [(False, False, True), (True, False, True), (True, True, True), (False, False, False)],
    ids=[
        "without_amp_allow_unused_input",
        "with_amp_cache_disabled_allow_unused_input",
        "with_amp_cache_enabled_allow_unused_input",
        "without_amp_not_allow_unused_input",
    ],
)
def test_graph_make_graphed_callables_parameterless_nograd_module(
    with_amp: bool, cache_enabled: bool, allow_unused_input: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """ports TestCuda.test_graph_make_graphed_callables_parameterless_nograd_module: a module with
    no parameters, graphed with a dict argument whose sample tensors do not require grad, then
    called (as torch's test does) with inputs that do; every call matches eager; eval runs
    eagerly.

    Deliberate difference: torch's graph silently computes no gradient for an input whose sample
    did not require grad. torchreplay computes none either (drop-in) but warns once, naming the
    argument (README: "Where we differ from torch on purpose")."""
    torch.manual_seed(5)
    N, D_in, H = 64, 256, 128
    model_graphed = nn.Sequential(_ParameterlessDictModule()).to(DEV)
    model_control = nn.Sequential(_ParameterlessDictModule()).to(DEV)
    x = torch.randn(N, D_in, device=DEV, requires_grad=False)
    unused_input = torch.randn(N, H, device=DEV, requires_grad=False)
    with _autocast(with_amp, cache_enabled):
        model_graphed[0] = tr.make_graphed_callables(
            model_graphed[0],
            ({"x": x, "unused_input": unused_input},),
            allow_unused_input=allow_unused_input,
        )
    real_inputs = [torch.rand_like(x, requires_grad=True) for _ in range(10)]
    for i, data in enumerate(real_inputs):
        with _autocast(with_amp, cache_enabled):
            with messages(caplog) as msgs:
                got = model_graphed({"x": data, "unused_input": unused_input})["output"]
            want = model_control({"x": data, "unused_input": unused_input})["output"]
        assert torch.equal(got.detach(), want.detach())
        named = [m for m in msgs if "requires grad" in m and "['x']" in m]
        assert len(named) == (1 if i == 0 else 0), msgs  # once, naming the argument
    assert model_graphed[0].forward.stats.replays == 10
    # not-requiring-grad inputs, as the sample: no warning, same results
    for _ in range(3):
        data = torch.rand_like(x)
        with _autocast(with_amp, cache_enabled):
            got = model_graphed({"x": data, "unused_input": unused_input})["output"]
            want = model_control({"x": data, "unused_input": unused_input})["output"]
        assert torch.equal(got, want)

    # Graphed in training mode: eval runs eagerly.
    model_graphed.eval()
    model_control.eval()
    assert torch.equal(
        model_graphed({"x": real_inputs[0]})["output"], model_control({"x": real_inputs[0]})["output"]
    )


@pytest.mark.parametrize("pool_kind", ["torch.cuda.graph_pool_handle()", "tr.Pool()"])
def test_graph_make_graphed_callables_same_pool(pool_kind: str) -> None:
    """ports TestCuda.test_graph_make_graphed_callables_same_pool: three models graphed in
    separate calls into one pool; outputs, losses, parameters and gradients equal eager's.

    Deliberate difference, over three steps without zero_grad: torch's make_graphed_callables
    hands out its static gradient buffer as ``.grad`` and the next replay overwrites it, so
    ``.grad`` is not g1 + g2 + g3 there (pytorch#181723); here it accumulates as eagerly."""
    torch.manual_seed(5)
    torch.cuda.manual_seed(5)
    models = [
        nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128)).to(DEV)
        for _ in range(3)
    ]
    mempool = torch.cuda.graph_pool_handle() if pool_kind.startswith("torch") else tr.Pool()
    graphed_models = []
    for model in models:
        x = torch.randn(64, 32, device=DEV)
        graphed = tr.make_graphed_callables(copy.deepcopy(model), (x,), pool=mempool)
        graphed_models.append(graphed)
    for _ in range(3):
        for model, graphed in zip(models, graphed_models):
            x = torch.randn(64, 32, device=DEV)
            y = model(x)
            yg = graphed(x)
            loss = y.norm()
            loss_g = yg.norm()
            loss.backward()
            loss_g.backward()
            torch.testing.assert_close(yg, y, **TOL)
            torch.testing.assert_close(loss_g, loss, **TOL)
            for p, pg in zip(model.parameters(), graphed.parameters()):
                torch.testing.assert_close(pg, p, **TOL)
                torch.testing.assert_close(pg.grad, p.grad, **TOL)
                assert p.data_ptr() != pg.data_ptr()
                assert p.grad.data_ptr() != pg.grad.data_ptr()


class _BNDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 8)
        )

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("num_warmup_iters", [1, 3, 11])
def test_graph_make_graphed_callables_num_warmup_iters(num_warmup_iters: int) -> None:
    """ports TestCuda.test_graph_make_graphed_callables (torch's ``num_warmup_iters`` argument,
    passed positionally as torch's signature has it; 11 is what torch's docs advise under DDP):
    whatever the count, warm-up leaves parameters, BatchNorm statistics and the RNG as found, and
    five graphed steps equal five eager steps (statistics updated once per call)."""
    torch.manual_seed(0)
    model = _BNDropout().to(DEV)
    ref = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sample = torch.randn(16, 64, device=DEV)
    rng = torch.cuda.get_rng_state()
    tr.make_graphed_callables(model, (sample,), num_warmup_iters)
    assert torch.equal(torch.cuda.get_rng_state(), rng), "warm-up moved the RNG"
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"warm-up changed {k}"

    gen = torch.Generator(device=DEV).manual_seed(1)
    data = [
        (torch.randn(16, 64, device=DEV, generator=gen), torch.randn(16, 8, device=DEV, generator=gen))
        for _ in range(5)
    ]
    results = {}
    for label, m in (("graphed", model), ("eager", ref)):
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        torch.manual_seed(3)
        results[label] = []
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(m(x), y)
            loss.backward()
            opt.step()
            results[label].append(loss.detach().clone())
    for a, b in zip(results["graphed"], results["eager"]):
        torch.testing.assert_close(a, b, **TOL)
    for (k, v), w in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(v, w, **TOL, msg=lambda m, k=k: f"{k}: {m}")
    assert int(model.net[1].num_batches_tracked) == 5


def test_graph_make_graphed_callables_plain_leaf_tensor_gets_grad() -> None:
    """ports TestCuda.test_graph_make_graphed_callables (its function callables): a plain leaf
    tensor with ``requires_grad`` (not a module parameter) used inside a graphed function gets
    ``.grad`` after backward, accumulating over calls, as eagerly.

    Deliberate difference: torch's make_graphed_callables differentiates only a module's
    parameters and the arguments; a tensor a function closes over silently gets no gradient."""
    torch.manual_seed(0)
    w = torch.randn(32, 32, device=DEV, requires_grad=True)
    bias = torch.zeros(32, device=DEV, requires_grad=True)
    w_ref, bias_ref = (t.detach().clone().requires_grad_() for t in (w, bias))

    def f(x):
        return torch.tanh(x @ w + bias)

    def f_ref(x):
        return torch.tanh(x @ w_ref + bias_ref)

    graphed = tr.make_graphed_callables(f, (torch.randn(8, 32, device=DEV, requires_grad=True),))
    for step in range(3):
        x = torch.randn(8, 32, device=DEV, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        graphed(x).pow(2).sum().backward()
        f_ref(x_ref).pow(2).sum().backward()
        assert w.grad is not None and bias.grad is not None, "the closed-over leaf got no .grad"
        torch.testing.assert_close(w.grad, w_ref.grad, **TOL)
        torch.testing.assert_close(bias.grad, bias_ref.grad, **TOL)
        torch.testing.assert_close(x.grad, x_ref.grad, **TOL)


@pytest.mark.parametrize("tool", ["graph", "make_graphed_callables"])
def test_autocast_float16_argument_is_widened_and_float32_narrowing_refused(
    tool: str, caplog: pytest.LogCaptureFixture
) -> None:
    """ports TestCuda.test_graph_make_graphed_callables[with_amp_*] (under autocast a graphed
    module gets the float16 output of the previous one where its sample was float32): the float16
    argument is accepted as a lossless widening copy, with a warning (a UserWarning or a logged
    one) naming the argument, and results equal eager's; a float32 argument where the sample was
    float16 (narrowing, lossy) is still refused with ``ReplayInputError``."""
    torch.manual_seed(0)
    lin = nn.Linear(32, 32).to(DEV)
    ref = copy.deepcopy(lin)
    training = tool == "make_graphed_callables"

    def project(activations):
        return torch.relu(lin(activations))

    def project_ref(activations):
        return torch.relu(ref(activations))

    def build(sample):
        if training:
            return tr.make_graphed_callables(project, (sample,))
        return tr.graph(project, sample)

    def amp():
        return torch.autocast("cuda", dtype=torch.float16)

    with amp():
        f = build(torch.randn(8, 32, device=DEV, requires_grad=training))
    for i in range(3):
        base = torch.randn(8, 32, device=DEV, requires_grad=training)
        base_ref = base.detach().clone().requires_grad_(training)
        with amp():
            h16 = base.half()
            if i == 0:
                with messages(caplog) as msgs:
                    out = f(h16)
                assert any("activations" in m or "args[0]" in m for m in msgs), msgs
            else:
                out = f(h16)
            want = project_ref(base_ref.half())
        # float16 results of the same kernels; allow a last-bit difference of cuBLAS's choice
        torch.testing.assert_close(out, want, rtol=2e-3, atol=1e-3)
        if training:
            out.float().sum().backward()
            want.float().sum().backward()
            assert base.grad is not None and base.grad.dtype == torch.float32
            torch.testing.assert_close(base.grad, base_ref.grad, rtol=2e-3, atol=1e-3)
            torch.testing.assert_close(lin.weight.grad, ref.weight.grad, rtol=1e-3, atol=1e-4)

    # The outputs of the last step hold an autograd graph through lin's AccumulateGrad nodes,
    # made on the default stream; capturing a backward into them again is refused (CUDA cannot
    # make the default stream wait for a capture), so they go first. test_training covers the
    # clear error a kept graph gets.
    del out, want
    with amp():
        f16 = build(torch.randn(8, 32, device=DEV, dtype=torch.float16, requires_grad=training))
        with pytest.raises(tr.ReplayInputError):
            f16(torch.randn(8, 32, device=DEV, requires_grad=training))


# == graphed optimizers ===========================================================================

# Per optimizer with a ``capturable`` flag (and SGD, which torchreplay captures without one): a
# few of the argument sets of torch's optim_db inputs (common_optimizers.py), each run with
# foreach=False and foreach=True, as _get_optim_inputs_including_global_cliquey_kwargs does.
_OPTIM_VARIANTS = {
    "Adam": [{}, {"weight_decay": 0.1, "amsgrad": True}, {"weight_decay": 0.1, "maximize": True}],
    "AdamW": [{}, {"weight_decay": 0.1, "amsgrad": True}, {"weight_decay": 0.1, "maximize": True}],
    "Adamax": [{}, {"weight_decay": 0.1, "maximize": True}],
    "ASGD": [{}, {"weight_decay": 0.1, "maximize": True}],
    "Adadelta": [{}, {"weight_decay": 0.1, "maximize": True}, {"rho": 0.95}],
    "NAdam": [
        {},
        {"weight_decay": 0.1, "momentum_decay": 6e-3},
        {"weight_decay": 0.1, "decoupled_weight_decay": True},
    ],
    "RAdam": [{}, {"weight_decay": 0.1}, {"weight_decay": 0.1, "decoupled_weight_decay": True}],
    "RMSprop": [{}, {"weight_decay": 0.1, "maximize": True}, {"momentum": 0.9, "centered": True}],
    "Rprop": [{}, {"maximize": True}],
    "SGD": [{"momentum": 0.9}, {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1}, {}],
}
_CAPTURABLE = [name for name in _OPTIM_VARIANTS if name != "SGD"]


def _has_capturable(cls: type) -> bool:
    return "capturable" in inspect.signature(cls.__init__).parameters


def _graphed_optimizer_run(
    cls: type,
    kwargs: dict,
    *,
    steps_warmup: int = 3,
    steps_train: int = 2,
    grad_write: str = "copy_",
    bare: bool = False,
    none_at: int | None = None,
) -> None:
    """torch's ``test_graph_optims`` body: a control optimizer (``capturable=False``) and one with
    ``capturable=True`` whose step alone is captured after eager warm-up steps, the gradients
    written outside the graph before each replay; the parameters must end equal."""
    capturable = _has_capturable(cls)
    params = [torch.randn((i + 5, i + 5), device=DEV) for i in range(2)] + [
        torch.randn((), device=DEV)
    ]
    params_control = [p.clone().requires_grad_() for p in params]
    params_graphed = [p.clone().requires_grad_() for p in params]
    grads = [[torch.randn_like(p) for p in params] for _ in range(steps_warmup + steps_train)]

    # none_at: at that training step, parameter 0 has no gradient (eagerly: skipped)
    unset = -1 if none_at is None else steps_warmup + none_at
    opt = cls(params_control, **(dict(kwargs, capturable=False) if capturable else kwargs))
    for i in range(steps_warmup + steps_train):
        for j, p in enumerate(params_control):
            p.grad = None if (i, j) == (unset, 0) else grads[i][j].clone()
        opt.step()

    opt = cls(params_graphed, **(dict(kwargs, capturable=True) if capturable else kwargs))
    for i in range(steps_warmup):
        for j, p in enumerate(params_graphed):
            p.grad = grads[i][j].clone()
        opt.step()

    if bare:
        step = tr.graph_step(lambda: opt.step())
    else:
        step = tr.graph_step(lambda: opt.step(), optimizers=opt)
    for i in range(steps_train):
        for j, p in enumerate(params_graphed):
            if (i + steps_warmup, j) == (unset, 0):
                p.grad = None
            elif grad_write == "copy_" and p.grad is not None:
                p.grad.copy_(grads[i + steps_warmup][j])  # torch's: into the captured buffer
            else:
                p.grad = grads[i + steps_warmup][j].clone()  # eager style: a new tensor
        step()
    assert step.stats.replays == steps_train - (none_at is not None)
    assert step.stats.fallbacks == (none_at is not None)
    for k, (p_control, p_graphed) in enumerate(zip(params_control, params_graphed)):
        torch.testing.assert_close(
            p_graphed, p_control, msg=lambda m, k=k: f"{cls.__name__}{kwargs} param {k}: {m}"
        )


@pytest.mark.parametrize("name", list(_OPTIM_VARIANTS))
def test_graph_optims(name: str) -> None:
    """ports TestCudaOptims.test_graph_optims (every optimizer with a ``capturable`` flag, plus
    SGD): ``tr.graph_step(lambda: opt.step(), optimizers=opt)`` captures the optimizer step alone,
    gradients are written outside the graph, and N replays equal N eager steps."""
    cls = getattr(torch.optim, name)
    for variant in _OPTIM_VARIANTS[name]:
        for foreach in (False, True):
            kwargs = dict(variant, lr=0.1, foreach=foreach)
            if name in ("Adam", "AdamW"):
                kwargs["betas"] = (0.9, 0.99)
            _graphed_optimizer_run(cls, kwargs)


@pytest.mark.parametrize("name", ["Adam", "SGD"])
def test_graph_optims_grad_assigned_outside_the_graph(name: str) -> None:
    """ports TestCudaOptims.test_graph_optims with the gradients given as eager code gives them
    (``p.grad = new_tensor`` before each call, not ``p.grad.copy_``): the graphed step reads them."""
    kwargs = {"lr": 0.1, "momentum": 0.9} if name == "SGD" else {"lr": 0.1}
    _graphed_optimizer_run(getattr(torch.optim, name), kwargs, grad_write="assign")


@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD"])
def test_graph_optims_with_a_gradient_set_to_none_at_one_step(name: str) -> None:
    """Not in torch's test: one step gives parameter 0 no gradient (``p.grad = None``, as
    ``zero_grad()`` leaves a parameter the backward did not reach). Eagerly the optimizer skips
    it; a replay would step it on a zero gradient (Adam's momentum, SGD's momentum and weight
    decay would move it), so that call runs eagerly and the next ones replay; the parameters
    equal eager's throughout."""
    kwargs = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1} if name == "SGD" else {"lr": 0.1}
    _graphed_optimizer_run(getattr(torch.optim, name), kwargs, steps_train=5, grad_write="assign",
                           none_at=2)
    kwargs = dict(kwargs, fused=True)
    _graphed_optimizer_run(getattr(torch.optim, name), kwargs, steps_train=5, none_at=1)


def test_graph_optims_bare_step_lambda() -> None:
    """ports TestCudaOptims.test_graph_optims in its plainest form, ``tr.graph_step(lambda:
    opt.step())``: no arguments, no outputs, the optimizer found through the closure."""
    _graphed_optimizer_run(torch.optim.Adam, {"lr": 0.1, "betas": (0.9, 0.99)}, bare=True)


@pytest.mark.parametrize("name", _CAPTURABLE)
def test_graph_optims_with_explicitly_capturable_param_groups(name: str) -> None:
    """ports TestCuda.test_graph_optims_with_explicitly_capturable_param_groups: two param groups,
    the second capturable or not. Not capturable: torch raises "Attempting CUDA graph" from the
    capture; here ``UnsupportedError`` naming ``capturable=True``, before anything ran. Both
    capturable: the replays equal eager steps."""
    cls = getattr(torch.optim, name)
    n_warmup, n_replay = 3, 3
    for second_capturable in (True, False):
        ref_p1, param1 = (nn.Parameter(torch.ones(1, device=DEV)) for _ in range(2))
        ref_p2, param2 = (nn.Parameter(torch.ones(1, device=DEV)) for _ in range(2))
        grads1, grads2 = (
            [torch.randn_like(param1) for _ in range(n_warmup + n_replay)] for _ in range(2)
        )
        opt = cls(
            [
                {"params": [param1], "capturable": True},
                {"params": [param2], "capturable": second_capturable},
            ]
        )
        opt_ = cls(
            [{"params": [ref_p1], "capturable": False}, {"params": [ref_p2], "capturable": False}]
        )
        for i in range(n_warmup + n_replay):
            ref_p1.grad = grads1[i].clone()
            ref_p2.grad = grads2[i].clone()
            opt_.step()
        for i in range(n_warmup):
            param1.grad = grads1[i].clone()
            param2.grad = grads2[i].clone()
            opt.step()

        if not second_capturable:
            before = (param1.detach().clone(), param2.detach().clone())
            with pytest.raises(tr.UnsupportedError, match=r"capturable=True"):
                tr.graph_step(lambda: opt.step(), optimizers=opt)
            assert torch.equal(param1, before[0]) and torch.equal(param2, before[1])
            continue
        step = tr.graph_step(lambda: opt.step(), optimizers=opt)
        for i in range(n_replay):
            param1.grad.copy_(grads1[n_warmup + i])
            param2.grad.copy_(grads2[n_warmup + i])
            step()
        torch.testing.assert_close(param1, ref_p1)
        torch.testing.assert_close(param2, ref_p2)


_FUSED_VARIANTS = {
    "Adam": [{"lr": 0.1}, {"lr": 0.1, "weight_decay": 0.1, "amsgrad": True}],
    "AdamW": [{"lr": 0.1}, {"lr": 0.1, "weight_decay": 0.1, "maximize": True}],
    "SGD": [{"lr": 0.1, "momentum": 0.9}, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1}],
}


@pytest.mark.parametrize("name", list(_FUSED_VARIANTS))
def test_graph_scaling_fused_optimizers(name: str) -> None:
    """ports TestCudaOptims.test_graph_scaling_fused_optimizers: ``scaler.step(opt);
    scaler.update()`` with a fused optimizer captured alone by ``tr.graph_step``, gradients
    written outside the graph; parameters and the scale equal the eager control. One replay gets
    an inf gradient (not in torch's test): the step must be skipped and the scale halved on the
    device, as eagerly."""
    cls = getattr(torch.optim, name)
    capturable = _has_capturable(cls)
    steps_warmup, steps_train, inf_at = 3, 4, 1
    for kwargs in _FUSED_VARIANTS[name]:
        kwargs = dict(kwargs, fused=True)
        params = [torch.randn((i + 5, i + 5), device=DEV) for i in range(2)]
        params_control = [p.clone().requires_grad_() for p in params]
        params_graphed = [p.clone().requires_grad_() for p in params]
        grads = [[torch.randn_like(p) for p in params] for _ in range(steps_warmup + steps_train)]
        grads[steps_warmup + inf_at][0][0, 0] = float("inf")
        # GradScaler unscales gradients in place: each run gets its own copies.
        grads_control = [[g.clone() for g in gs] for gs in grads]
        grads_graphed = [[g.clone() for g in gs] for gs in grads]

        scaler_control = torch.amp.GradScaler("cuda", init_scale=128.0)
        scaler_graphed = torch.amp.GradScaler("cuda")
        scaler_graphed.load_state_dict(scaler_control.state_dict())
        for s in (scaler_control, scaler_graphed):
            s.scale(torch.ones((), device=DEV))  # creates the scale and growth tracker

        opt = cls(params_control, **(dict(kwargs, capturable=False) if capturable else kwargs))
        for i in range(steps_warmup + steps_train):
            for j, p in enumerate(params_control):
                p.grad = grads_control[i][j]
            scaler_control.step(opt)
            scaler_control.update()

        opt = cls(params_graphed, **(dict(kwargs, capturable=True) if capturable else kwargs))
        for i in range(steps_warmup):
            for j, p in enumerate(params_graphed):
                p.grad = grads_graphed[i][j]
            scaler_graphed.step(opt)
            scaler_graphed.update()

        def scaled_step():
            scaler_graphed.step(opt)
            scaler_graphed.update()

        step = tr.graph_step(scaled_step, optimizers=opt, scaler=scaler_graphed)
        for i in range(steps_train):
            for j, p in enumerate(params_graphed):
                p.grad.copy_(grads_graphed[i + steps_warmup][j])
            step()
        assert scaler_graphed.get_scale() == scaler_control.get_scale() == 64.0
        for k, (p_control, p_graphed) in enumerate(zip(params_control, params_graphed)):
            torch.testing.assert_close(
                p_graphed, p_control, msg=lambda m, k=k: f"{name}{kwargs} param {k}: {m}"
            )


@pytest.mark.parametrize("tool", ["graph_step", "make_graphed_callables"])
def test_graph_grad_scaling(tool: str) -> None:
    """ports TestCuda.test_graph_grad_scaling: the forward and the scaled backward are graphed,
    ``scaler.step(opt)`` and ``scaler.update()`` run eagerly; each replay reads the scale the
    last update left, so the gradients, scales and growth trackers follow torch's expected
    sequence (an overflow to inf halves the scale).

    The weight is a plain leaf tensor, not a module parameter, as in torch's test. Each call
    starts from ``zero_grad(set_to_none=True)``, so eager semantics give torch's expected
    gradients (torch's graph overwrites the gradient it allocated during capture)."""
    scaler = torch.amp.GradScaler("cuda", init_scale=4.0)
    weight = torch.ones(100, device=DEV, requires_grad=True)
    opt = torch.optim.SGD([weight], lr=0.1)
    static_input = torch.ones_like(weight)

    # warm-up, as torch's test: on a side stream, its loss kept alive (creates the scaler's
    # scale tensor and weight's AccumulateGrad node, on that stream)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        loss = (weight.half() * static_input).sum()
        scaler.scale(loss).backward()
    torch.cuda.current_stream().wait_stream(s)
    opt.zero_grad(set_to_none=True)

    if tool == "graph_step":

        def scaled_backward(inp):
            opt.zero_grad(set_to_none=True)
            loss = (weight.half() * inp).sum()
            scaler.scale(loss).backward()
            return loss

        step = tr.graph_step(scaled_backward, static_input)
    else:
        graphed = tr.make_graphed_callables(lambda inp: (weight.half() * inp).sum(), (static_input,))

        def step(inp):
            opt.zero_grad(set_to_none=True)
            loss = graphed(inp)
            scaler.scale(loss).backward()
            return loss

    ref_weight = torch.ones(100, device=DEV, requires_grad=True)
    ref_opt = torch.optim.SGD([ref_weight], lr=0.1)
    ref_scaler = torch.amp.GradScaler("cuda", init_scale=4.0)

    input_vals = [5, 20000, 5, 40000]
    expected_scales = [4, 2, 2, 1]
    expected_growth_trackers = [1, 0, 1, 0]
    expected_grad_vals = [5 * 4, float("inf"), 5 * 2, float("inf")]
    for data, scale, growth_tracker, grad_val in zip(
        input_vals, expected_scales, expected_growth_trackers, expected_grad_vals
    ):
        step(torch.full_like(weight, data))
        assert weight.grad is not None, "the graphed backward left no .grad"
        assert torch.equal(weight.grad, torch.full_like(weight, grad_val)), weight.grad[:4]
        scaler.step(opt)
        scaler.update()
        assert scaler._scale.item() == scale
        assert scaler._growth_tracker.item() == growth_tracker

        ref_opt.zero_grad(set_to_none=True)
        ref_scaler.scale((ref_weight.half() * torch.full_like(weight, data)).sum()).backward()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
    assert torch.equal(weight, ref_weight)
