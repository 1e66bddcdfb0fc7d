"""Graphs under ``torch.inference_mode`` (the usual serving context), on a real GPU.

Eagerly a model runs the same kernels under ``inference_mode`` as under ``no_grad``; what
differs is the tensors: those made inside are inference tensors (no version counter, no
autograd, no in-place write outside the mode). Each front end is captured in one mode and called
in the other, equal to eager over many calls with fresh inputs, with eager's kind of output
tensor; an argument the callable writes (a KV cache) reaches the caller in either mode; a model
built under the mode is graphed outside it; the training front ends refuse to capture under it
(tests/cpu/test_inference_mode.py), and a graphed step called with autograd off runs eagerly,
where eager's error is raised."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchreplay as tr
from fronts import build, rows
from twin_steps import twin_steps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEV = "cuda"
CALLS = 8
MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}
FRONTS = ["one shape", "sizes", "breaks", "breaks, sizes", "compile", "compile, split"]


class Split(nn.Module):
    """An MLP whose middle Dynamo cannot trace: the backend replays two pieces around it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.a(x))
        torch._dynamo.graph_break()
        return self.b(h) + 1


def model_for(front: str) -> nn.Module:
    torch.manual_seed(0)
    if front == "compile, split":
        return Split().to(DEV).eval()
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).to(DEV).eval()


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("captured", list(MODES))
@pytest.mark.parametrize("called", list(MODES))
def test_each_front_end_captured_in_one_mode_and_called_in_the_other_equals_eager(
    front, captured, called
) -> None:
    model = model_for(front)
    n = rows(front)
    with MODES[captured]():
        g = build(front, model, torch.randn(n, 64, device=DEV))
    for _ in range(CALLS):
        with MODES[called]():
            x = torch.randn(n, 64, device=DEV)
            got = g(x)
            want = model(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert got.is_inference() == want.is_inference() == (called == "inference_mode")
        assert not got.requires_grad
    if hasattr(g, "stats"):
        assert g.stats.fallbacks == 0


def test_outputs_kept_across_calls_under_inference_mode_hold_or_raise_as_under_no_grad() -> None:
    """The checked policy, in the mode: an output dropped before the next call is handed out
    again (unless its layout was changed in place); one kept across a call is stale (it
    raises), never silently overwritten; each output is of the kind eager's is."""
    model = model_for("one shape")
    with torch.inference_mode():
        g = tr.graph(model, torch.randn(4, 64, device=DEV))
        x1, x2 = torch.randn(4, 64, device=DEV), torch.randn(4, 64, device=DEV)
        kept = g(x1)
        torch.testing.assert_close(kept, model(x1))
        second = g(x2)
        torch.testing.assert_close(second, model(x2))
        with pytest.raises(RuntimeError, match="StaleOutputError"):
            kept.sum()
        value, second_id = second.clone(), id(second)
        del second
        third = g(x2)  # nobody can reach the last one: the same tensor again, no new object
        assert id(third) == second_id and torch.equal(third, value) and third.is_inference()
        third.unsqueeze_(0)  # an in-place change of layout, which no version counter shows
        del third
        fourth = g(x2)
        assert fourth.shape == (4, 64) and torch.equal(fourth, value)
    with torch.no_grad():  # out of the mode: a normal tensor, as eager's
        fifth = g(x1)
        torch.testing.assert_close(fifth, model(x1))
    assert not fifth.is_inference()
    del fifth
    with torch.inference_mode():
        assert g(x1).is_inference()


def step(cache: torch.Tensor, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    cache.index_copy_(0, pos, x)
    return cache.sum(0) * 2


@pytest.mark.parametrize("sizes", [None, [1, 2, 4]], ids=["one shape", "sizes"])
@pytest.mark.parametrize("captured", list(MODES))
@pytest.mark.parametrize("called", list(MODES))
@pytest.mark.parametrize("cache_made", list(MODES))
def test_a_written_argument_reaches_the_caller_in_either_mode(sizes, captured, called, cache_made) -> None:
    """A KV-cache write into the caller's tensor, as eager's; an inference-tensor cache written
    outside inference_mode raises what eager raises."""
    with MODES[cache_made]():
        cache = torch.randn(16, 8, device=DEV)
    rows = 1 if sizes is None else 2
    with MODES[captured]():
        sample = cache.clone()
        g = tr.graph(step, sample, torch.randn(rows, 8, device=DEV), torch.arange(rows, device=DEV),
                     sizes=sizes, dim=None if sizes is None else {"cache": None, "x": 0, "pos": 0})
    for k in range(CALLS):
        with MODES[called]():
            x = torch.randn(rows, 8, device=DEV)
            pos = torch.arange(rows, device=DEV) + 2 * k
            with torch.inference_mode(cache.is_inference()):  # the same kind as the caller's
                ref_cache = cache.clone()
            if cache_made == "inference_mode" and called == "no_grad":
                with pytest.raises(RuntimeError, match="inference tensor"):
                    step(ref_cache, x, pos)  # eager
                with pytest.raises(RuntimeError, match="inference tensor"):
                    g(cache, x, pos)
                return
            want = step(ref_cache, x, pos)
            got = g(cache, x, pos)
        torch.testing.assert_close(got, want)
        assert torch.equal(cache, ref_cache)


def test_a_model_built_under_inference_mode_is_graphed_and_called_outside_it() -> None:
    """Its weights and BatchNorm statistics are inference tensors: warm-up's put-back must not
    write them outside the mode (nothing could have), and calls in either mode replay."""
    torch.manual_seed(0)
    with torch.inference_mode():
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()).to(DEV).eval()
        model[1].running_mean.normal_()
    with torch.no_grad():
        g = tr.graph(model, torch.randn(2, 3, 16, 16, device=DEV))
    replays = g.stats.replays
    for mode in ("no_grad", "inference_mode") * (CALLS // 2):
        with MODES[mode]():
            x = torch.randn(2, 3, 16, 16, device=DEV)
            torch.testing.assert_close(g(x), model(x))
    assert g.stats.fallbacks == 0 and g.stats.replays - replays == CALLS


def test_make_graphed_callables_called_under_inference_mode_runs_the_forward() -> None:
    torch.manual_seed(0)
    model = model_for("one shape").train()
    ref = copy.deepcopy(model)
    graphed = tr.make_graphed_callables(model, (torch.randn(4, 64, device=DEV, requires_grad=True),))
    for _ in range(CALLS):
        with torch.inference_mode():
            x = torch.randn(4, 64, device=DEV)
            got, want = graphed(x), ref(x)
        torch.testing.assert_close(got, want)
        assert got.is_inference() and got.grad_fn is None
        x = torch.randn(4, 64, device=DEV, requires_grad=True)  # training calls still replay
        x_ref = x.detach().clone().requires_grad_()
        graphed(x).square().sum().backward()
        ref(x_ref).square().sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
            p.grad = q.grad = None


@pytest.mark.parametrize("mode", list(MODES))
def test_a_graphed_step_called_with_autograd_off_runs_eagerly_and_raises_as_eager(mode) -> None:
    model, ref, train_step, ref_step = twin_steps(DEV)
    data = [(torch.randn(8, 64, device=DEV), torch.randn(8, 64, device=DEV)) for _ in range(CALLS)]
    graphed = tr.graph_step(train_step, *data[0])
    for k, (x, y) in enumerate(data):
        if k % 2:
            with MODES[mode]():
                with pytest.raises(RuntimeError) as eager_error:
                    ref_step(x, y)
                with pytest.raises(RuntimeError) as ours:
                    graphed(x, y)
            assert str(ours.value) == str(eager_error.value)
        else:
            loss, ref_loss = graphed(x, y).clone(), ref_step(x, y).detach()
            torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    assert graphed.stats.replays == CALLS // 2 and graphed.stats.fallbacks == CALLS // 2


@pytest.mark.parametrize("sizes", [None, [2, 4, 8]], ids=["one shape", "sizes"])
def test_hf_bert_graphed_and_called_under_inference_mode_equals_eager(sizes) -> None:
    """A model nobody here wrote, with keyword arguments and an attention mask, all under the
    mode as a serving loop runs it."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=1000, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=256, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    with torch.inference_mode():
        model = transformers.BertModel(cfg).to(DEV).eval()

        def batch(n: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(0, 1000, (n, 16), device=DEV)
            mask = (torch.rand(n, 16, device=DEV) > 0.2).long()
            mask[:, 0] = 1
            return {"input_ids": ids, "attention_mask": mask}

        g = tr.graph(model, **batch(4 if sizes is None else 3), sizes=sizes)
        for k in range(CALLS):
            b = batch(4 if sizes is None else 1 + k % 8)
            got, want = g(**b), model(**b)
            torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, rtol=1e-4, atol=1e-4)
            assert got.last_hidden_state.is_inference()
    assert g.stats.fallbacks == 0


def test_torchvision_resnet_graphed_under_inference_mode_equals_eager() -> None:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).to(DEV).eval()
    with torch.inference_mode():
        g = tr.graph(model, torch.randn(2, 3, 64, 64, device=DEV))
        for _ in range(CALLS):
            x = torch.randn(2, 3, 64, 64, device=DEV)
            torch.testing.assert_close(g(x), model(x), rtol=1e-4, atol=1e-4)
    assert g.stats.fallbacks == 0
