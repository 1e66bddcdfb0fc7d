"""Calls a graph cannot serve as eager would (core/modes.py), on a real GPU: under another CUDA
autocast setting than the capture's, and with autograd on and an argument that requires grad.
``tr.graph`` (one shape, ``sizes=``, ``breaks=``) runs them eagerly, each equal to eager (dtypes,
values, gradients) over many calls with fresh inputs, and replays again in the captured setting;
``graph_step`` runs a step eagerly under another autocast; ``make_graphed_callables`` raises."""

from __future__ import annotations

import contextlib
import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchreplay as tr
from torchreplay.errors import ReplayInputError
from fronts import build, rows
from twin_steps import twin_steps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEV = "cuda"
CALLS = 6
FRONTS = ["one shape", "sizes", "breaks"]


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).to(DEV).eval()


def autocast(dtype):
    return torch.autocast("cuda", dtype=dtype) if dtype is not None else contextlib.nullcontext()


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("captured", [None, torch.bfloat16], ids=["captured plain", "captured bf16"])
def test_a_call_under_another_autocast_setting_runs_eagerly(front, captured, caplog) -> None:
    model = mlp()
    other = torch.bfloat16 if captured is None else None
    n = rows(front)
    with torch.no_grad(), autocast(captured):
        g = build(front, model, torch.randn(n, 64, device=DEV))
    replays, fallbacks = g.stats.replays, g.stats.fallbacks
    with caplog.at_level(logging.WARNING, logger="torchreplay"), torch.no_grad():
        for _ in range(CALLS):
            for setting in (captured, other, torch.float16):
                x = torch.randn(n, 64, device=DEV)
                with autocast(setting):
                    got = g(x)
                    want = model(x)
                assert got.dtype == want.dtype
                if setting == captured:  # replayed: the captured kernels
                    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
                else:  # eagerly: the very kernels eager runs
                    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert g.stats.replays - replays == CALLS
    assert g.stats.fallbacks - fallbacks == 2 * CALLS
    said = [r.getMessage() for r in caplog.records if "autocast" in r.getMessage()]
    assert len(said) == 1, said  # once per reason, not per setting or call
    assert "run eagerly" in said[0]


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("frozen", [True, False], ids=["frozen weights", "trained weights"])
def test_autograd_to_an_argument_runs_eagerly_with_eager_gradients(front, frozen, caplog) -> None:
    """A frozen network used as a loss (or an input attribution): eager backpropagates through it
    to the argument, and to its weights when they require grad; a replay could not."""
    model, ref = mlp(), mlp()
    for p in (*model.parameters(), *ref.parameters()):
        p.requires_grad_(not frozen)
    n = rows(front)
    with torch.no_grad():
        g = build(front, model, torch.randn(n, 64, device=DEV))
    replays = g.stats.replays
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        for _ in range(CALLS):
            x = torch.randn(n, 64, device=DEV)
            a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
            loss, ref_loss = g(a).square().mean(), ref(b).square().mean()
            loss.backward()
            ref_loss.backward()
            torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
            with torch.no_grad():  # the same argument under no_grad: the graph replays
                torch.testing.assert_close(g(a), ref(b), rtol=1e-5, atol=1e-5)
            plain = g(x)  # nothing requires grad, autograd on: replays; no history
            assert plain.grad_fn is None
            torch.testing.assert_close(plain, ref(x).detach(), rtol=1e-5, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        if frozen:
            assert p.grad is None and q.grad is None
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    assert g.stats.replays - replays == 2 * CALLS
    said = [r.getMessage() for r in caplog.records if "requiring grad" in r.getMessage()]
    assert len(said) == 1 and "args[0]" in said[0], said


def test_graph_step_under_another_autocast_runs_the_step_eagerly() -> None:
    model, ref, train_step, ref_step = twin_steps(DEV)
    data = [(torch.randn(8, 64, device=DEV), torch.randn(8, 64, device=DEV)) for _ in range(8)]
    step = tr.graph_step(train_step, *data[0])
    for k, (x, y) in enumerate(data):
        setting = torch.bfloat16 if k % 2 else None
        with autocast(setting):
            loss = step(x, y).clone()
            ref_loss = ref_step(x, y).detach()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-3, atol=1e-4)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)
    assert step.stats.replays == 4 and step.stats.fallbacks == 4


def test_make_graphed_callables_under_another_autocast_raises() -> None:
    model = mlp().train()
    x = torch.randn(4, 64, device=DEV, requires_grad=True)
    graphed = tr.make_graphed_callables(model, (x,))
    graphed(x).sum().backward()
    with autocast(torch.bfloat16), pytest.raises(ReplayInputError, match="no autocast.*autocast\\(bfloat16\\)"):
        graphed(torch.randn(4, 64, device=DEV, requires_grad=True))


@pytest.mark.parametrize("front", FRONTS)
def test_a_call_under_a_dispatch_mode_runs_eagerly_so_the_mode_sees_every_op(front) -> None:
    """``FlopCounterMode`` counts what eager counts; a trace (``make_fx``) records the model's
    ops, so the traced program follows its inputs (a replay would have handed the trace its
    output buffer as a constant). Outside any mode the graph replays."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils.flop_counter import FlopCounterMode

    model = mlp()
    n = rows(front)
    with torch.no_grad():
        g = build(front, model, torch.randn(n, 64, device=DEV))
        x = torch.randn(n, 64, device=DEV)
        with FlopCounterMode(display=False) as eager_count:
            model(x)
        with FlopCounterMode(display=False) as graph_count:
            y = g(x)
        assert graph_count.get_total_flops() == eager_count.get_total_flops() > 0
        torch.testing.assert_close(y, model(x), rtol=0, atol=0)
        traced = make_fx(lambda t: g(t))(x)
        assert any(node.target is torch.ops.aten.addmm.default for node in traced.graph.nodes)
        replays = g.stats.replays
        for _ in range(CALLS):
            x = torch.randn(n, 64, device=DEV)
            torch.testing.assert_close(traced(x), model(x), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(g(x), model(x), rtol=1e-5, atol=1e-5)
        assert g.stats.replays - replays == CALLS


def gelu_break(x):
    return F.gelu(x)


class BrokenNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, x):
        return self.b(gelu_break(self.a(x)))


def test_make_graphed_callables_and_training_with_breaks_under_a_dispatch_mode_run_eagerly(caplog) -> None:
    """A training step under ``FlopCounterMode`` counts eager's flops, forward and backward
    (a replay would hide them), for ``make_graphed_callables`` of a module and of a module
    around its breaks; outside the mode they replay again, with eager's gradients."""
    from torch.utils.flop_counter import FlopCounterMode

    for breaks in (None, [gelu_break]):
        torch.manual_seed(0)
        model = BrokenNet().to(DEV)
        ref = copy.deepcopy(model)
        x = torch.randn(4, 64, device=DEV, requires_grad=True)
        graphed = tr.make_graphed_callables(model, (x,), breaks=breaks)
        stats = graphed.forward.stats
        with FlopCounterMode(display=False) as eager:
            ref(x).sum().backward()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="torchreplay"), FlopCounterMode(display=False) as ours:
            graphed(x).sum().backward()
        assert ours.get_total_flops() == eager.get_total_flops() > 0, breaks
        assert "torchreplay" not in caplog.text, breaks  # the mode's reason, not its hooks
        assert stats.fallbacks == 1, breaks
        for _ in range(CALLS):
            for m in (model, ref):
                m.zero_grad(set_to_none=True)
            x = torch.randn(4, 64, device=DEV)
            graphed(x).square().mean().backward()
            ref(x).square().mean().backward()
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
        assert stats.replays >= CALLS and stats.fallbacks == 1, breaks


# -- a graph called inside another graph's capture -------------------------------------------


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("outer", ["tr.graph", "torch.cuda.graph"])
def test_a_graph_called_inside_another_capture_is_recorded_into_it(front, outer) -> None:
    """A graphed block inside a model that is then graphed whole: CUDA allows no replay inside
    a capture, so the block runs its callable there and its kernels become part of the outer
    graph. The outer graph equals eager over fresh inputs; the block still replays alone."""
    block = mlp()
    n = rows(front)
    with torch.no_grad():
        inner = build(front, block, torch.randn(n, 64, device=DEV))

        def model(x):
            return inner(x * 0.5).relu() + x

        def eager(x):
            return block(x * 0.5).relu() + x

        if outer == "tr.graph":
            g = tr.graph(model, torch.randn(n, 64, device=DEV))
            run = g
        else:  # torch's recipe: warm up on a side stream, capture, copy in, replay
            static = torch.randn(n, 64, device=DEV)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    model(static)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = model(static)

            def run(x):
                static.copy_(x)
                graph.replay()
                return out.clone()

        for _ in range(CALLS):
            x = torch.randn(n, 64, device=DEV)
            torch.testing.assert_close(run(x), eager(x), rtol=1e-5, atol=1e-5)
        replays = inner.stats.replays
        for _ in range(CALLS):  # alone, outside any capture: it replays again
            x = torch.randn(n, 64, device=DEV)
            torch.testing.assert_close(inner(x), block(x), rtol=1e-5, atol=1e-5)
        assert inner.stats.replays - replays == CALLS


@pytest.mark.parametrize("compiler", ["torch.compile", "tr.compile"])
def test_a_compiled_block_inside_a_graph_runs_its_compiled_code_in_the_capture(compiler) -> None:
    """A function that calls a compiled block, graphed with ``tr.graph``: the capture's write
    watch (a dispatch mode) no longer makes Dynamo compile the block again inside the capture,
    which failed; the block's compiled code is recorded into the graph (core/writes.py)."""
    block = mlp()
    inner = torch.compile(block) if compiler == "torch.compile" else tr.compile(block, cache_dir=None)
    with torch.no_grad():
        inner(torch.randn(4, 64, device=DEV))
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        g = tr.graph(lambda x: inner(x * 0.5).relu() + x, torch.randn(4, 64, device=DEV))
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
        for _ in range(CALLS):
            x = torch.randn(4, 64, device=DEV)
            torch.testing.assert_close(g(x), block(x * 0.5).relu() + x, rtol=1e-5, atol=1e-5)


def test_make_graphed_callables_inside_a_graphed_training_step() -> None:
    """A block graphed for training, then the whole step graphed with ``graph_step``: inside
    the step's capture the block runs as is, forward and backward, recorded into the step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).to(DEV)
    ref = copy.deepcopy(model)
    x0 = torch.randn(8, 64, device=DEV)
    graphed = tr.make_graphed_callables(model[0], (x0,))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, capturable=True)

    def make(first, rest, o):
        def step(x, y):
            o.zero_grad(set_to_none=True)
            loss = F.mse_loss(rest(first(x)), y)
            loss.backward()
            o.step()
            return loss
        return step

    rest = nn.Sequential(model[1], model[2])
    data = [(torch.randn(8, 64, device=DEV), torch.randn(8, 64, device=DEV)) for _ in range(8)]
    step = tr.graph_step(make(graphed, rest, opt), *data[0])
    ref_step = make(ref[0], nn.Sequential(ref[1], ref[2]), ref_opt)
    for x, y in data:
        torch.testing.assert_close(step(x, y).clone(), ref_step(x, y).detach(), rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    assert step.stats.replays == len(data)


@pytest.mark.parametrize("front", FRONTS)
def test_a_forward_hook_added_after_capture_runs_eagerly_until_removed(front, caplog) -> None:
    """Eagerly a hook registered after capture runs at every call (features collected from a
    layer, say); a replay would run none of its code. Calls run eagerly while it is there, equal
    to eager, the hook seeing eager's values; after its removal calls replay again. A hook present
    at capture that changes the output replays its tensor work."""
    model = mlp()
    model[0].register_forward_hook(lambda m, i, o: o * 2)  # present at capture: in the graph
    n = rows(front)
    with caplog.at_level(logging.WARNING, logger="torchreplay"), torch.no_grad():
        g = build(front, model, torch.randn(n, 64, device=DEV))
        assert any("forward hooks" in r.getMessage() for r in caplog.records)  # named once
        caplog.clear()
        seen: list[torch.Tensor] = []
        handle = model[2].register_forward_hook(lambda m, i, o: seen.append(o.clone()))
        replays, fallbacks = g.stats.replays, g.stats.fallbacks
        for k in range(CALLS):
            x = torch.randn(n, 64, device=DEV)
            got = g(x)
            want = model(x)  # the hook sees eager's output too
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            assert len(seen) == 2 * (k + 1)
            torch.testing.assert_close(seen[-2], seen[-1], rtol=0, atol=0)
        assert g.stats.fallbacks - fallbacks == CALLS and g.stats.replays == replays
        said = [r.getMessage() for r in caplog.records if "changed since capture" in r.getMessage()]
        assert len(said) == 1 and "Linear" in said[0]
        handle.remove()
        for _ in range(CALLS):
            x = torch.randn(n, 64, device=DEV)
            torch.testing.assert_close(g(x), model(x), rtol=2e-5, atol=2e-5)
        assert g.stats.replays - replays == CALLS and len(seen) == 2 * CALLS
