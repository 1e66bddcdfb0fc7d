"""Eager semantics on a real GPU: in-place writes to arguments reach the caller's tensors (one
shape, sizes=, make_graphed_callables, graph_step), what cannot be made eager-equal raises, outputs
of a dropped graph never read freed memory, a dropped graph's memory goes back, a function with no
tensor argument, and an optimizer step captured alone.

Every test compares with eager on fresh random inputs, over several calls, and checks the
caller's tensors after every call.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch
import torch.nn as nn

import torchreplay as tr

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEV = "cuda"
CALLS = 6


def test_the_issue_example_writes_reach_the_caller() -> None:
    def step(x):
        x.add_(1)
        return x * 2

    g = tr.graph(step, torch.zeros(8, device=DEV))
    assert g.stats.written_inputs == ["args[0] 'x'"]
    assert "writes args[0] 'x'" in repr(g)
    for _ in range(CALLS):
        w = torch.randn(8, device=DEV)
        w_eager = w.clone()
        want = step(w_eager)
        y = g(w)
        torch.testing.assert_close(y, want, rtol=0, atol=0)
        torch.testing.assert_close(w, w_eager, rtol=0, atol=0)


def test_running_statistics_passed_as_arguments_reach_the_caller() -> None:
    """``F.batch_norm(x, running_mean, running_var, training=True)`` with the statistics passed
    in: cuDNN's kernel updates them though its schema does not say so; they were silently
    left as they were (found in session 59)."""
    bn = torch.nn.functional.batch_norm

    def step(x, rm, rv):
        return bn(x, rm, rv, training=True, momentum=0.1)

    rm, rv = torch.randn(16, device=DEV), torch.rand(16, device=DEV) + 0.5
    g = tr.graph(step, torch.randn(16, 16, device=DEV), rm.clone(), rv.clone())
    assert g.stats.written_inputs == ["args[1] 'rm'", "args[2] 'rv'"]
    rm_e, rv_e = rm.clone(), rv.clone()
    for _ in range(CALLS):
        x = torch.randn(16, 16, device=DEV)
        want = step(x, rm_e, rv_e)
        torch.testing.assert_close(g(x, rm, rv), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rm, rm_e, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rv, rv_e, rtol=1e-5, atol=1e-6)


def test_a_kv_cache_argument_written_with_index_copy() -> None:
    torch.manual_seed(0)
    proj = nn.Linear(16, 16).to(DEV).eval()

    def decode(x, pos, cache):  # x: [B, 1, D]; cache: [B, S, D]
        k = proj(x)
        cache.index_copy_(1, pos, k)
        return (cache.softmax(-1) * k).sum(1)

    cache = torch.zeros(4, 32, 16, device=DEV)
    g = tr.graph(decode, torch.randn(4, 1, 16, device=DEV), torch.tensor([0], device=DEV), cache)
    assert g.stats.written_inputs == ["args[2] 'cache'"]
    mine, ref = torch.randn(4, 32, 16, device=DEV), None
    ref = mine.clone()
    with torch.no_grad():
        for t in range(CALLS):
            x = torch.randn(4, 1, 16, device=DEV)
            pos = torch.tensor([t], device=DEV)
            want = decode(x, pos, ref)
            torch.testing.assert_close(g(x, pos, mine), want)
            torch.testing.assert_close(mine, ref)


def test_writes_with_sizes_reach_only_the_real_rows() -> None:
    def fn(x, state):  # x: [N, 8] varying; state: [N, 8] varying, written per row
        state.mul_(0.5).add_(x)
        return state.sum(-1)

    g = tr.graph(fn, torch.randn(4, 8, device=DEV), torch.randn(4, 8, device=DEV), sizes=[2, 4, 8])
    assert g.stats.written_inputs == ["args[1] 'state'"]
    for n in [3, 8, 1, 5, 2, 7]:
        x, state = torch.randn(n, 8, device=DEV), torch.randn(n, 8, device=DEV)
        ref = state.clone()
        want = fn(x, ref)
        torch.testing.assert_close(g(x, state), want)
        torch.testing.assert_close(state, ref)  # the caller's n rows, nothing more


def test_writes_with_sizes_to_a_static_argument() -> None:
    def fn(x, counter):  # counter: static (dim None), written whole
        counter.add_(1)
        return x * counter

    g = tr.graph(fn, torch.randn(4, 3, device=DEV), torch.zeros(3, device=DEV), sizes=[4, 8],
                 dim={"x": 0, "counter": None})
    counter, ref = torch.zeros(3, device=DEV), torch.zeros(3, device=DEV)
    for n in [2, 8, 5]:
        x = torch.randn(n, 3, device=DEV)
        want = fn(x, ref)
        torch.testing.assert_close(g(x, counter), want)
        torch.testing.assert_close(counter, ref)


def test_a_graph_that_writes_nothing_has_no_write_back() -> None:
    g = tr.graph(lambda x: x * 2, torch.randn(4, device=DEV))
    assert g.stats.written_inputs == [] and g._writes is False


def test_writes_that_cannot_be_eager_equal_raise() -> None:
    def fn(x):
        x.add_(1)
        return x

    with pytest.raises(tr.CaptureError, match="writes args\\[0\\] 'x' in place and returns it"):
        tr.graph(fn, torch.randn(4, device=DEV), outputs="static")
    g = tr.graph(fn, torch.randn(4, device=DEV))  # checked: the value is eager's
    w = torch.randn(4, device=DEV)
    want = w + 1
    torch.testing.assert_close(g(w), want)
    torch.testing.assert_close(w, want)

    g2 = tr.graph(lambda x, y: x.add_(y), torch.randn(4, device=DEV), torch.randn(4, device=DEV))
    base = torch.randn(8, device=DEV)
    with pytest.raises(tr.ReplayInputError, match="share memory"):
        g2(base[:4], base[2:6])
    with pytest.raises(tr.CaptureError, match="share memory"):
        t = torch.randn(4, device=DEV)
        tr.graph(lambda x, y: x.add_(y), t, t)


def test_make_graphed_callables_forward_writes_reach_the_caller() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(8, 8).to(DEV)

    def fn(x, stat):
        stat.mul_(0.9).add_(x.detach().mean(0), alpha=0.1)  # a running statistic passed in
        return lin(x)

    g = tr.make_graphed_callables(fn, (torch.randn(4, 8, device=DEV, requires_grad=True),
                                       torch.zeros(8, device=DEV)))
    stat, ref = torch.zeros(8, device=DEV), torch.zeros(8, device=DEV)
    for _ in range(CALLS):
        x = torch.randn(4, 8, device=DEV, requires_grad=True)
        y = g(x, stat)
        with torch.no_grad():
            ref.mul_(0.9).add_(x.mean(0), alpha=0.1)
        torch.testing.assert_close(stat, ref)
        y.sum().backward()
        torch.testing.assert_close(x.grad, lin.weight.sum(0).expand(4, 8))


def test_graph_step_writes_to_an_argument_reach_the_caller() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 1).to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step(x, y, seen):
        opt.zero_grad(set_to_none=False)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        seen.add_(x.shape[0])
        return loss.detach()

    sample = (torch.randn(4, 8, device=DEV), torch.randn(4, 1, device=DEV), torch.zeros((), device=DEV))
    step = tr.graph_step(train_step, *sample)
    seen = torch.zeros((), device=DEV)
    for i in range(CALLS):
        step(torch.randn(4, 8, device=DEV), torch.randn(4, 1, device=DEV), seen)
        assert seen.item() == 4 * (i + 1)


def test_a_kept_output_of_a_dropped_graph_raises_instead_of_reading_freed_memory() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU()).to(DEV).eval()
    x = torch.randn(8, 64, device=DEV)
    g = tr.graph(model, x)
    y = g(x)
    want = model(x).detach().clone()
    torch.testing.assert_close(y, want)
    del g
    gc.collect()
    # Memory of the dropped pool is reused by new allocations; a read must not see them.
    junk = [torch.full((8, 64), 7.0, device=DEV) for _ in range(64)]
    with pytest.raises(RuntimeError, match="^StaleOutputError: .*has been destroyed"):
        y.sum().item()
    del junk
    # outputs="static" hands out tensors that own their memory, as torch's graphs do: they hold.
    g2 = tr.graph(model, x, outputs="static")
    y2 = g2(x)
    del g2
    gc.collect()
    junk = [torch.full((8, 64), 7.0, device=DEV) for _ in range(64)]
    torch.testing.assert_close(y2, want)
    del junk
    torch.cuda.synchronize()


def test_dropped_graphs_give_their_memory_back() -> None:
    """100 capture-and-drop cycles of a small cuBLAS matmul: the device's used memory stays flat
    (torch's TestCuda.test_graph_cudnn_dropout-style check with mem_get_info), no empty_cache by
    the test."""
    a = torch.randn(512, 512, device=DEV)

    def used() -> int:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return total - free

    samples = []
    for i in range(100):
        g = tr.graph(lambda m: (m @ m).relu() @ m, a)
        g(a)
        del g
        if i in (5, 99):
            samples.append(used())
    assert samples[1] - samples[0] < 8 * 2**20, f"grew by {(samples[1] - samples[0]) / 2**20:.1f} MiB"


def test_a_function_without_tensor_arguments_with_device() -> None:
    def noise(scale):
        return torch.randn(16, device=DEV) * scale

    with pytest.raises(tr.CaptureError, match="device='cuda'"):
        tr.graph(noise, 2.0)
    g = tr.graph(noise, 2.0, device=DEV)
    a, b = g(2.0).clone(), g(2.0).clone()
    assert a.device.type == "cuda" and not torch.equal(a, b)  # fresh numbers every replay
    assert 0.5 < float(a.std()) / 2.0 < 2.0


@pytest.mark.parametrize("kind", ["adam", "adamw", "adam_fused", "sgd_fused"])
def test_an_optimizer_step_captured_alone_equals_eager(kind: str) -> None:
    torch.manual_seed(0)
    params = [torch.randn(32, 16, device=DEV, requires_grad=True), torch.randn(16, device=DEV, requires_grad=True)]
    ref = [p.detach().clone().requires_grad_(True) for p in params]

    def make(ps):
        if kind == "adam":
            return torch.optim.Adam(ps, lr=1e-2, capturable=True)
        if kind == "adamw":
            return torch.optim.AdamW(ps, lr=1e-2, capturable=True)
        if kind == "adam_fused":
            return torch.optim.Adam(ps, lr=1e-2, fused=True, capturable=True)
        return torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True)

    opt, ref_opt = make(params), make(ref)
    for p in params:
        p.grad = torch.zeros_like(p)
    step = tr.graph_step(lambda: opt.step(), optimizers=opt)
    for _ in range(CALLS):
        grads = [torch.randn_like(p) for p in params]
        for p, r, gr in zip(params, ref, grads):
            p.grad.copy_(gr)  # gradients written outside the graph, as torch's test_graph_optims
            r.grad = gr.clone()
        step()
        ref_opt.step()
        for p, r in zip(params, ref):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


def test_a_cache_argument_passed_at_every_call_is_named_and_its_buffer_serves_instead(caplog) -> None:
    """A 64 MiB KV cache passed as an argument at every step: each call copies it into the
    graph's buffer and back out. One warning names it and the way around; following it (the
    graph's buffer used as the cache) gives eager's results with nothing copied."""
    def step(x: torch.Tensor, kv: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        kv.index_copy_(0, pos, x[:1].expand(1, 64, 1024))
        return x * kv[:8].sum()

    cache = torch.zeros(256, 64, 1024, device="cuda")
    ref = cache.clone()
    g = tr.graph(step, torch.randn(4, 1, device="cuda"), cache, torch.tensor([0], device="cuda"))
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        for p in range(4):
            x, pos = torch.randn(4, 1, device="cuda"), torch.tensor([p], device="cuda")
            torch.testing.assert_close(g(x, cache, pos), step(x, ref, pos))
            torch.testing.assert_close(cache, ref)
    assert len([r for r in caplog.records if "args[1]" in r.getMessage() and "every call" in r.getMessage()]) == 1
    buf = g.static_args[1]
    buf.copy_(cache)
    for p in range(4, 8):
        x, pos = torch.randn(4, 1, device="cuda"), torch.tensor([p], device="cuda")
        torch.testing.assert_close(g(x, buf, pos), step(x, ref, pos))
    torch.testing.assert_close(buf, ref)


@pytest.mark.parametrize("shapes", ["one", "sizes"])
def test_a_cache_marked_with_mark_static_address_is_read_and_written_where_it_is(shapes, caplog) -> None:
    """torch._dynamo.mark_static_address(cache), as for torch.compile's graphs: the graph adopts
    the caller's 64 MiB cache as its buffer. No copy at capture (the build's peak stays far under
    the cache's size) or at calls; what the build wrote into it is put back; replays equal eager;
    a call with another tensor raises instead of copying into the caller's first one."""
    import torch._dynamo

    def step(x: torch.Tensor, kv: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        kv.index_copy_(0, pos, x[:1].expand(1, 64, 1024))
        return x * kv[:8].sum()

    cache = torch.zeros(256, 64, 1024, device="cuda")
    cache[:6] = torch.randn(6, 64, 1024, device="cuda")  # a prompt at rows 0..5
    torch._dynamo.mark_static_address(cache)
    ref = cache.clone()
    kw = {"sizes": [2, 4], "dim": {"x": 0, "kv": None, "pos": None}} if shapes == "sizes" else {}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    g = tr.graph(step, torch.randn(4, 1, device="cuda"), cache, torch.tensor([0], device="cuda"), **kw)
    assert torch.cuda.max_memory_allocated() - base < cache.nbytes // 4
    assert g.static_args[1] is cache
    torch.testing.assert_close(cache, ref, rtol=0, atol=0)
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        for p in range(6, 6 + 8):
            x, pos = torch.randn(3 if kw else 4, 1, device="cuda"), torch.tensor([p], device="cuda")
            torch.testing.assert_close(g(x, cache, pos), step(x, ref, pos))
            torch.testing.assert_close(cache, ref)
    assert not [r for r in caplog.records if "every call" in r.getMessage()]
    with pytest.raises(tr.ReplayInputError, match=r"args\[1\].*mark_static_address"):
        g(torch.randn(4, 1, device="cuda"), ref.clone(), torch.tensor([20], device="cuda"))
    torch.testing.assert_close(cache, ref)


@pytest.mark.parametrize("shapes", ["one", "sizes"])
def test_every_warm_up_starts_from_the_callers_adopted_position(shapes) -> None:
    """An adopted position (mark_static_address) advanced in place by each call: every warm-up
    and the capture start where the caller left it, as with a copied argument. The warm-ups ran
    on from each other's writes: a cache near its end was written past it."""
    import torch._dynamo

    starts: list[torch.Tensor] = []

    def step(x: torch.Tensor, kv: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if not torch.cuda.is_current_stream_capturing():  # (the warm-ups: where each began)
            starts.append(pos.clone())
        kv.index_copy_(0, pos, x[:1])
        pos.add_(1)
        return x * kv.sum()

    kv, pos = torch.randn(16, 32, device=DEV), torch.tensor([3], device=DEV)
    for t in (kv, pos):
        torch._dynamo.mark_static_address(t)
    ref_kv, ref_pos = kv.clone(), pos.clone()
    kw = {"sizes": [2, 4], "dim": {"x": 0, "kv": None, "pos": None}} if shapes == "sizes" else {}
    g = tr.graph(step, torch.randn(4, 32, device=DEV), kv, pos, **kw)
    warmups = [int(s) for s in starts[-3:]]  # (sizes= probes two sizes eagerly first)
    assert len(starts) >= 3 and warmups == [3, 3, 3], [int(s) for s in starts]
    assert torch.equal(kv, ref_kv) and torch.equal(pos, ref_pos)  # the build's writes put back
    for _ in range(CALLS):
        x = torch.randn(3 if kw else 4, 32, device=DEV)
        torch.testing.assert_close(g(x, kv, pos), step(x, ref_kv, ref_pos))
        assert torch.equal(kv, ref_kv) and torch.equal(pos, ref_pos)
