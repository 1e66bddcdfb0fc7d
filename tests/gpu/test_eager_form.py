"""``copy.deepcopy`` and ``torch.save`` of models graphed on a real GPU (core/eager_form.py): an EMA
copy of a model graphed for training computes with its own weights, eagerly; the original keeps
replaying its graphs; a saved model loads as the eager model. Each against eager, fresh inputs."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn

import torchreplay as tr
from hf_trainer import train_graphed_and_eager

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.usefixtures("full_fp32_matmul"),
]

DEV = "cuda"
CLOSE = {"rtol": 1e-5, "atol": 1e-5}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)).to(DEV)


def test_an_ema_copy_of_a_model_graphed_for_training_uses_its_own_weights() -> None:
    model, ref = mlp(), mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    tr.make_graphed_callables(model, (torch.randn(16, 32, device=DEV),))
    ema = copy.deepcopy(model)
    ema_ref = copy.deepcopy(ref)
    for _ in range(6):
        x = torch.randn(16, 32, device=DEV)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
        with torch.no_grad():
            for e, m in ((ema, model), (ema_ref, ref)):
                for pe, pm in zip(e.parameters(), m.parameters()):
                    pe.mul_(0.9).add_(pm, alpha=0.1)
        x = torch.randn(16, 32, device=DEV)
        with torch.no_grad():
            torch.testing.assert_close(ema(x), ema_ref(x), **CLOSE)
            torch.testing.assert_close(model(x), ref(x), **CLOSE)
            assert not torch.allclose(ema(x), model(x))
    assert model.forward.stats.replays == 18 and model.forward.stats.fallbacks == 0


def test_a_model_graphed_for_training_saves_and_loads_as_the_eager_model() -> None:
    model = mlp()
    tr.make_graphed_callables(model, (torch.randn(16, 32, device=DEV),))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert not isinstance(loaded.forward, tr.GraphedCallable)
    for _ in range(4):
        x = torch.randn(16, 32, device=DEV)
        with torch.no_grad():
            torch.testing.assert_close(loaded(x), model(x), **CLOSE)


def test_hugging_face_trainer_trains_a_model_graphed_for_training(tmp_path) -> None:
    """The Trainer keeps the columns the graphed forward's signature names and trains through the
    graphs, equal to the eager model trained alike. The sample holds what the Trainer passes to a
    forward with ``**kwargs`` (``num_items_in_batch``), as seen in the eager model's run."""
    model, ref, loss, want = train_graphed_and_eager(DEV, str(tmp_path), steps=6, hidden=64)
    assert loss == pytest.approx(want, rel=1e-4)
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, msg=n, rtol=1e-4, atol=1e-5)
    assert model.forward.stats.replays == 6 and model.forward.stats.backward_replays == 6
    n = torch.cuda.device_count()  # several: the Trainer runs nn.DataParallel over them
    if n <= 2:  # (batches of 4 per GPU: with two, each step's other half is the replica's)
        assert model.forward.stats.fallbacks == 6 * (n - 1)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("front", ["training", "graph", "sizes", "breaks", "breaks-training"])
def test_data_parallel_over_a_graphed_model_equals_eager_data_parallel(front: str) -> None:
    """nn.DataParallel replicates the model on each GPU at every call, and each replica calls the
    forward the model holds: the graph. The replica on the graph's GPU replays it (its weights
    are the model's own memory); one on another GPU ran the original's forward there (a device
    error) and now runs its own, eagerly, with its copies of the weights. Outputs and gradients
    equal eager DataParallel's, over many calls with fresh inputs."""
    training = front in ("training", "breaks-training")
    model, ref = mlp().train(training), mlp().train(training)
    sample = torch.randn(8, 32, device=DEV)  # a GPU's half of a batch of 16
    breaks = [model[1]] if front.startswith("breaks") else None
    if training:
        tr.make_graphed_callables(model, (sample,), breaks=breaks)
    else:
        model.forward = tr.graph(model.forward, sample, sizes=[4, 8] if front == "sizes" else None, breaks=breaks)
    graph = model.forward
    data_parallel_equals_eager(model, ref, rows=16 if front != "sizes" else 14, training=training)  # (sizes: 7 a GPU, padded)
    assert graph.stats.replays == 6 and graph.stats.fallbacks == 6  # (the replica on cuda:1)


def data_parallel_equals_eager(model: nn.Module, ref: nn.Module, *, rows: int, training: bool) -> None:
    """nn.DataParallel over cuda:0 and cuda:1 of ``model`` and of its eager twin ``ref``, 6 calls
    with fresh inputs of ``rows`` rows: outputs equal, and in training the gradients too, each
    call followed by an SGD step of both."""
    dp, dp_ref = nn.DataParallel(model, device_ids=[0, 1]), nn.DataParallel(ref, device_ids=[0, 1])
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    for _ in range(6):
        x = torch.randn(rows, 32, device=DEV)
        with torch.set_grad_enabled(training):
            got, want = dp(x), dp_ref(x)
        torch.testing.assert_close(got, want, **CLOSE)
        if training:
            for o, m in ((got, opt), (want, ref_opt)):
                m.zero_grad()
                o.square().mean().backward()
            for (n, a), b in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(a.grad, b.grad, msg=n, **CLOSE)
            opt.step()
            ref_opt.step()


class Positions(nn.Module):
    """A learned position table: a view of its weight, no kernel (a ``Launchless`` layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight[: x.shape[0]]


class Positioned(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = Positions()
        self.body = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x + self.pos(x))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_data_parallel_over_a_tuple_of_graphed_layers_with_a_position_table_equals_eager() -> None:
    """``make_graphed_callables`` of (a position table, an MLP): the table launches no kernel
    and runs eagerly at each call. Under nn.DataParallel the replica on cuda:1 got a view of
    the original's weight on cuda:0 (a device error in its add); it gets its own replica's now.
    Outputs, gradients and SGD steps equal eager DataParallel's over 6 calls."""
    torch.manual_seed(0)
    model = Positioned().to(DEV).train()
    ref = copy.deepcopy(model)
    sample = torch.randn(8, 32, device=DEV, requires_grad=True)
    # (the table reads only its argument's shape: no gradient reaches the argument)
    tr.make_graphed_callables((model.pos, model.body), ((sample,), (sample,)), allow_unused_input=True)
    data_parallel_equals_eager(model, ref, rows=16, training=True)
    assert model.body.forward.stats.replays == 6


def test_a_graph_made_the_forward_of_its_own_module_runs_eagerly_without_calling_itself() -> None:
    """``layer.forward = tr.graph(layer, x)`` keeps the layer in its model. A call the graph
    cannot serve (train mode: the graph was captured in eval) runs eagerly; that run called the
    layer, whose forward is the graph, without end (RecursionError). It runs the layer's class
    forward now, equal to eager; back in eval mode the graph replays; a deep copy is eager."""
    model = mlp().eval()
    ref = copy.deepcopy(model)
    layer = model[0]
    layer.forward = tr.graph(layer, torch.randn(16, 32, device=DEV))
    for mode in ("eval", "train", "eval"):
        model.train(mode == "train")
        ref.train(mode == "train")
        for _ in range(4):
            x = torch.randn(16, 32, device=DEV)
            with torch.no_grad():
                torch.testing.assert_close(model(x), ref(x), **CLOSE)
    assert layer.forward.stats.replays == 8 and layer.forward.stats.fallbacks == 4
    twin = copy.deepcopy(model)
    x = torch.randn(16, 32, device=DEV)
    with torch.no_grad():
        torch.testing.assert_close(twin(x), ref(x), **CLOSE)
