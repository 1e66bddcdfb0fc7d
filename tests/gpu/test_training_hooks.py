"""Hooks added after a training graph's capture (core/modes.py ``Hooks``, with ``backward``): a
replay of ``make_graphed_callables`` or ``graph_step`` runs none of their code, eagerly they
run. So while they differ from the capture's, calls run eagerly (counted, one warning), equal to
an eager twin with the same hooks, and replay again once they are removed. Before, such hooks
were silently skipped: a gradient scaled by a hook was not scaled."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchreplay as tr

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEV = "cuda"
STEPS = 5


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).to(DEV)


def close(a, b) -> None:
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("hook", ["forward", "full backward", "gradient of a parameter"])
def test_make_graphed_callables_runs_eagerly_while_a_new_hook_is_there(hook, caplog) -> None:
    model = mlp()
    ref = copy.deepcopy(model)
    graphed = tr.make_graphed_callables(model, (torch.randn(8, 64, device=DEV, requires_grad=True),))
    stats = graphed.forward.stats
    seen: list[int] = []

    def add(m: nn.Module):
        if hook == "forward":  # changes the output: a replay would return the unscaled one
            return m[2].register_forward_hook(lambda mod, i, o: o * 2)
        if hook == "full backward":  # sees the gradient flowing through the layer
            return m[2].register_full_backward_hook(lambda mod, gi, go: seen.append(1))
        return m[0].weight.register_hook(lambda g: g * 0.5)  # runs eagerly anyway: accumulated outside

    handles = [add(model), add(ref)]

    def train(calls: int) -> None:
        for _ in range(calls):
            x = torch.randn(8, 64, device=DEV, requires_grad=True)
            x_ref = x.detach().clone().requires_grad_(True)
            out, want = graphed(x), ref(x_ref)
            close(out, want)
            out.square().sum().backward()
            want.square().sum().backward()
            close(x.grad, x_ref.grad)
            for p, q in zip(model.parameters(), ref.parameters()):
                close(p.grad, q.grad)
                p.grad = q.grad = None

    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        train(STEPS)
    replays = stats.replays
    if hook == "gradient of a parameter":  # its hook runs where the graph's gradient lands
        assert stats.fallbacks == 0 and replays == STEPS
    else:
        assert stats.fallbacks == STEPS
        said = [r.getMessage() for r in caplog.records if "changed since capture" in r.getMessage()]
        assert len(said) == 1 and "Linear" in said[0]
        if hook == "full backward":
            assert len(seen) == 2 * STEPS  # the graphed callable's call ran it too
    for h in handles:
        h.remove()
    train(STEPS)
    assert stats.replays - replays == STEPS


@pytest.mark.parametrize("hook", ["gradient of a parameter", "optimizer step", "forward"])
def test_graph_step_runs_eagerly_while_a_new_hook_is_there(hook) -> None:
    model = mlp()
    ref = copy.deepcopy(model)
    counted: list[int] = []

    def make(m: nn.Module):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, capturable=True)

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(m(x), y)
            loss.backward()
            opt.step()
            return loss

        return step, opt

    (step, opt), (ref_step, ref_opt) = make(model), make(ref)
    data = [(torch.randn(8, 64, device=DEV), torch.randn(8, 64, device=DEV)) for _ in range(3 * STEPS)]
    graphed = tr.graph_step(step, *data[0])

    def add(m: nn.Module, o: torch.optim.Optimizer):
        if hook == "gradient of a parameter":  # halves a gradient: the captured step would not
            return m[2].weight.register_hook(lambda g: g * 0.5)
        if hook == "optimizer step":
            return o.register_step_post_hook(lambda *a: counted.append(1))
        return m[0].register_forward_hook(lambda mod, i, o_: o_ + 1)

    def run(batch) -> None:
        for x, y in batch:
            close(graphed(x, y).detach().clone(), ref_step(x, y).detach())
        for p, q in zip(model.parameters(), ref.parameters()):
            close(p, q)

    run(data[:STEPS])
    assert graphed.stats.replays == STEPS
    handles = [add(model, opt), add(ref, ref_opt)]
    run(data[STEPS:2 * STEPS])
    assert graphed.stats.fallbacks == STEPS and graphed.stats.replays == STEPS
    if hook == "optimizer step":
        assert len(counted) == 2 * STEPS
    for h in handles:
        h.remove()
    run(data[2 * STEPS:])
    assert graphed.stats.replays == 2 * STEPS
