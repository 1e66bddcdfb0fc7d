"""A plain function that runs modules (``tr.graph(lambda x: model(x) + 1, x)``, a decode step
closing over its model) is graphed as the module would be (core/args.py ``called_module``):
the modules it ran at capture are watched for train/eval switches, hooks added afterwards and
weights replaced, and building the graph leaves their buffers as they were. Before, a function
was watched for nothing of it: every such change gave the captured result silently. Each test
compares with eager over many calls with fresh inputs, for ``tr.graph`` with one shape,
``sizes=`` and ``breaks=``."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn

import torchreplay as tr
from torchreplay.errors import ReplayInputError, UnsupportedError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEV = "cuda"
CALLS = 6
FRONTS = ["one shape", "sizes", "breaks"]
SIZES = [2, 4, 8]


class Counted(nn.Module):
    """A layer with state its forward writes: a call counter that scales the output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x) * self.calls


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Dropout(0.5), nn.Linear(128, 64)).to(DEV).eval()


def graphed(front: str, fn, m: nn.Module, x: torch.Tensor):
    """``fn`` (which runs ``m``, whose ``[1]`` may be a break) graphed by ``front``."""
    if front == "sizes":
        return tr.graph(fn, x, sizes=SIZES)
    if front == "breaks":
        return tr.graph(fn, x, breaks=[m[1]])
    return tr.graph(fn, x)


def rows(front: str) -> int:
    return 3 if front == "sizes" else 4


@pytest.mark.parametrize("front", FRONTS)
def test_a_function_whose_model_is_switched_to_training_runs_eagerly(front, caplog) -> None:
    """Captured in eval mode (dropout off); after ``model.train()`` eager drops units, so calls
    run eagerly (same random numbers as eager), and replay again after ``model.eval()``."""
    m = model()

    def fn(x):
        return m(x).relu() + 1

    n = rows(front)
    with caplog.at_level(logging.WARNING, logger="torchreplay"), torch.no_grad():
        g = graphed(front, fn, m, torch.randn(n, 64, device=DEV))
        replays = g.stats.replays
        m.train()
        for k in range(CALLS):
            x = torch.randn(n, 64, device=DEV)
            torch.manual_seed(k)
            got = g(x)
            torch.manual_seed(k)
            torch.testing.assert_close(got, fn(x), rtol=0, atol=0)
        assert g.stats.fallbacks == CALLS and g.stats.replays == replays
        assert sum("mode" in r.getMessage() for r in caplog.records) == 1
        m.eval()
        for _ in range(CALLS):
            x = torch.randn(n, 64, device=DEV)
            torch.testing.assert_close(g(x), fn(x), rtol=2e-5, atol=2e-5)
        assert g.stats.replays - replays == CALLS


def test_a_function_of_two_models_sees_either_switched() -> None:
    """Two separate modules (a body and a head): switching only the head is seen."""
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(64, 64), nn.GELU()).to(DEV).eval()
    head = nn.Sequential(nn.Dropout(0.5), nn.Linear(64, 8)).to(DEV).eval()

    def fn(x):
        return head(body(x))

    with torch.no_grad():
        g = tr.graph(fn, torch.randn(4, 64, device=DEV))
        head.train()
        for k in range(CALLS):
            x = torch.randn(4, 64, device=DEV)
            torch.manual_seed(k)
            got = g(x)
            torch.manual_seed(k)
            torch.testing.assert_close(got, fn(x), rtol=0, atol=0)
        assert g.stats.fallbacks == CALLS
        head.eval()
        x = torch.randn(4, 64, device=DEV)
        torch.testing.assert_close(g(x), fn(x), rtol=2e-5, atol=2e-5)
        assert g.stats.replays == 1


@pytest.mark.parametrize("front", FRONTS)
def test_a_hook_added_to_a_functions_model_runs_eagerly_until_removed(front) -> None:
    m = model()

    def fn(x):
        return m(x) * 2

    n = rows(front)
    with torch.no_grad():
        g = graphed(front, fn, m, torch.randn(n, 64, device=DEV))
        seen: list[torch.Tensor] = []
        handle = m[3].register_forward_hook(lambda mod, i, o: seen.append(o.clone()))
        for k in range(CALLS):
            x = torch.randn(n, 64, device=DEV)
            got = g(x)
            torch.testing.assert_close(got, fn(x), rtol=0, atol=0)
            assert len(seen) == 2 * (k + 1)  # the hook ran for the graph's call too
            torch.testing.assert_close(seen[-2], seen[-1], rtol=0, atol=0)
        assert g.stats.fallbacks == CALLS
        handle.remove()
        replays = g.stats.replays
        for _ in range(CALLS):
            x = torch.randn(n, 64, device=DEV)
            torch.testing.assert_close(g(x), fn(x), rtol=2e-5, atol=2e-5)
        assert g.stats.replays - replays == CALLS and len(seen) == 2 * CALLS


@pytest.mark.parametrize("front", FRONTS)
def test_a_functions_model_reloaded_with_assign_raises(front) -> None:
    """``load_state_dict(..., assign=True)`` puts new tensors in the model: the graph would read
    the old ones. Reloading in place keeps the graph, and it computes with the new weights."""
    m = model()

    def fn(x):
        return m(x) - 1

    n = rows(front)
    with torch.no_grad():
        g = graphed(front, fn, m, torch.randn(n, 64, device=DEV))
        new = {k: torch.randn_like(v) for k, v in m.state_dict().items()}
        m.load_state_dict(new)  # in place
        for _ in range(CALLS):
            x = torch.randn(n, 64, device=DEV)
            torch.testing.assert_close(g(x), fn(x), rtol=2e-5, atol=2e-5)
        m.load_state_dict({k: v.clone() for k, v in new.items()}, assign=True)
        with pytest.raises(ReplayInputError, match="moved, or its weights or submodules replaced"):
            g(torch.randn(n, 64, device=DEV))


@pytest.mark.parametrize("front", FRONTS)
def test_graphing_a_function_leaves_its_models_buffers_as_they_were(front) -> None:
    """Warm-up runs the function for real; a buffer its model writes (a counter, a cache) is
    put back, as for a module: after N calls it holds what N eager calls leave."""
    torch.manual_seed(0)
    m = nn.Sequential(Counted(), nn.GELU(), nn.Linear(64, 64)).to(DEV).eval()
    twin = copy.deepcopy(m)
    n = rows(front)
    with torch.no_grad():
        g = graphed(front, lambda x: m(x) + 1, m, torch.randn(n, 64, device=DEV))
        assert m[0].calls.item() == 0
        for _ in range(CALLS):
            x = torch.randn(n, 64, device=DEV)
            torch.testing.assert_close(g(x), twin(x) + 1, rtol=2e-5, atol=2e-5)
        assert m[0].calls.item() == twin[0].calls.item() == CALLS


def test_sizes_refuse_a_function_whose_model_mixes_rows() -> None:
    """With ``sizes=`` padding rows would change batch statistics: refused for a function's
    BatchNorm in training mode as for a module's, and the probe's writes are put back."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64)).to(DEV).train()
    before = m[1].running_mean.clone()
    with torch.no_grad(), pytest.raises(UnsupportedError, match="BatchNorm1d"):
        tr.graph(lambda x: m(x), torch.randn(4, 64, device=DEV), sizes=SIZES)
    torch.testing.assert_close(m[1].running_mean, before, rtol=0, atol=0)


def test_make_graphed_callables_of_a_function_watches_the_modules_it_runs() -> None:
    """A training graph of a function closing over its model: switched to training, or given
    a forward hook, its calls run eagerly (eager values and gradients); its weights reloaded
    with ``assign=True`` raise."""
    m = model()
    ref = copy.deepcopy(m)
    graphed = tr.make_graphed_callables(lambda x: m(x) * 2, (torch.randn(4, 64, device=DEV, requires_grad=True),))

    def check(k: int) -> None:
        x = torch.randn(4, 64, device=DEV, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_(True)
        torch.manual_seed(k)
        out = graphed(x)
        torch.manual_seed(k)
        want = ref(x_ref) * 2
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        out.square().sum().backward()
        want.square().sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
            p.grad = q.grad = None

    for k in range(CALLS):
        check(k)
    assert graphed.stats.replays == CALLS and graphed.stats.fallbacks == 0
    m.train(), ref.train()
    for k in range(CALLS):
        check(k)
    assert graphed.stats.fallbacks == CALLS
    m.eval(), ref.eval()
    handles = [mod[3].register_forward_hook(lambda mod_, i, o: o + 1) for mod in (m, ref)]
    for k in range(CALLS):
        check(k)
    assert graphed.stats.fallbacks == 2 * CALLS
    for h in handles:
        h.remove()
    check(0)
    assert graphed.stats.replays == CALLS + 1
    m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()}, assign=True)
    with pytest.raises(ReplayInputError, match="replaced"):
        graphed(torch.randn(4, 64, device=DEV, requires_grad=True))


def test_make_graphed_callables_of_two_functions_over_one_model_both_watch_it() -> None:
    """Each callable finds the modules it runs at its own first warm-up: a model the first
    one ran is watched by the second too."""
    m = model()
    ref = copy.deepcopy(m)
    samples = tuple((torch.randn(4, 64, device=DEV, requires_grad=True),) for _ in range(2))
    f1, f2 = tr.make_graphed_callables((lambda x: m(x) * 2, lambda x: m(x) + 1), samples)
    refs = (lambda x: ref(x) * 2, lambda x: ref(x) + 1)
    for mode in ("eval", "train"):
        getattr(m, mode)(), getattr(ref, mode)()
        for k in range(CALLS):
            for f, r in zip((f1, f2), refs):
                x = torch.randn(4, 64, device=DEV)
                torch.manual_seed(k)
                out = f(x)
                torch.manual_seed(k)
                torch.testing.assert_close(out, r(x), rtol=1e-5, atol=1e-5)
    assert f1.stats.fallbacks == f2.stats.fallbacks == CALLS
    assert f1.stats.replays == f2.stats.replays == CALLS
