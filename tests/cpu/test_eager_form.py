"""``copy.deepcopy``, ``pickle`` and ``inspect.signature`` of graphed callables
(core/eager_form.py), through the emulated captures of test_buckets and test_training: a deep
copy is the eager copy (its own weights, never the original's graphs), a module whose forward was
graphed pickles as the eager module, what has no eager form to save raises ``UnsupportedError``,
and the signature is the eager callable's."""

from __future__ import annotations

import copy
import inspect
import io
import logging
import pickle

import pytest
import torch
from torch import nn

import torchreplay as tr
from hf_trainer import train_graphed_and_eager
from torchreplay.errors import UnsupportedError
from torchreplay.training import callables as training


@pytest.fixture
def graphs(monkeypatch):
    import test_buckets
    import test_training

    test_buckets.install_cpu_graphs(monkeypatch.setattr)
    monkeypatch.setattr(training, "_capture_pairs", test_training._emulated_capture_pairs)
    monkeypatch.setattr(training, "infer_device", lambda fn, call, device=None: torch.device("cpu"))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))


def test_a_deep_copy_of_a_model_graphed_for_training_runs_its_own_weights_eagerly(graphs, caplog) -> None:
    """timm's ModelEmaV2 deep-copies the model: with torch's tool the copy keeps the original's
    graphed forward and evaluates the live weights, silently."""
    model = _mlp()
    tr.make_graphed_callables(model, (torch.randn(3, 6),))
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        ema = copy.deepcopy(model)
        copy.deepcopy(model)
    assert [r.getMessage() for r in caplog.records if "copy.deepcopy" in r.getMessage()] == [
        "torchreplay: copy.deepcopy of 'Sequential': the copy runs eagerly (a CUDA graph replays "
        "the memory of the original, its weights included). Graph the copy to have it graphed"
    ]
    assert not isinstance(ema.forward, tr.GraphedCallable) and ema.forward.__self__ is ema
    with torch.no_grad():
        for p in ema.parameters():
            p.mul_(0.5)
    x = torch.randn(3, 6)
    want = nn.Sequential(*ema)(x)  # the copy's own layers, run as a fresh module
    torch.testing.assert_close(ema(x), want)
    assert not torch.allclose(ema(x), model(x))
    replays = model.forward.stats.replays
    model(x).sum().backward()  # the original stays graphed
    assert model.forward.stats.replays == replays + 1


def test_torchs_averaged_model_of_a_model_graphed_for_training_averages_its_own_copy(graphs) -> None:
    model = _mlp()
    tr.make_graphed_callables(model, (torch.randn(3, 6),))
    swa = torch.optim.swa_utils.AveragedModel(model)  # a deep copy inside
    swa.update_parameters(model)  # (the first: a copy)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    swa.update_parameters(model)  # the mean of the first weights and these
    x = torch.randn(3, 6)
    with torch.no_grad():
        torch.testing.assert_close(swa(x), nn.Sequential(*swa.module)(x))
        assert not torch.allclose(swa(x), model(x))


def test_a_model_graphed_for_training_pickles_as_the_eager_model(graphs, caplog) -> None:
    model = _mlp()
    tr.make_graphed_callables(model, (torch.randn(3, 6),))
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        assert b"torchreplay" not in pickle.dumps(model)  # loads where torchreplay is not installed
    assert "pickle (torch.save) of 'Sequential': saved as the eager forward" in caplog.text
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = torch.randn(3, 6)
    assert not isinstance(loaded.forward, tr.GraphedCallable)
    torch.testing.assert_close(loaded(x), model(x))


def test_a_forward_replaced_by_tr_graph_copies_and_pickles_as_the_eager_forward(graphs) -> None:
    model = _mlp().eval()
    model.forward = tr.graph(model.forward, torch.randn(3, 6))
    ema = copy.deepcopy(model)
    assert ema.forward.__self__ is ema
    x = torch.randn(3, 6)
    with torch.no_grad():
        torch.testing.assert_close(ema(x), model(x))
        torch.testing.assert_close(pickle.loads(pickle.dumps(model))(x), model(x))
    assert model.forward.stats.replays == 2


def _replica(model: nn.Module) -> nn.Module:
    """What ``nn.DataParallel`` calls on another GPU: a replica sharing the model's ``__dict__``
    (its graphed forward), each layer's weights its own copies (here: other values)."""
    replica = model._replicate_for_data_parallel()
    for name, layer in model.named_children():
        copied = layer._replicate_for_data_parallel()
        for key, p in layer._parameters.items():
            setattr(copied, key, torch.randn_like(p))  # (replicate() sets them so, not as Parameters)
        replica._modules[name] = copied
    return replica


@pytest.mark.parametrize("front", ["training", "graph", "sizes"])
def test_an_eager_call_of_a_data_parallel_replica_runs_the_replicas_own_weights(graphs, front) -> None:
    """nn.DataParallel (Hugging Face's Trainer on several GPUs) replicates the module at every
    call, sharing its graphed forward: a call the graph does not serve ran the original's
    weights (on the original's GPU: a device error, or the wrong weights). It runs the replica's."""
    model = _mlp()
    x = torch.randn(4, 6)
    if front == "training":
        tr.make_graphed_callables(model, (x,))
    else:
        model.eval()
        model.forward = tr.graph(model.forward, x, sizes=[4, 8] if front == "sizes" else None)
    graph = model.forward
    model.train(front != "training")  # (train/eval changed since capture: the calls run eagerly)
    replica = _replica(model)
    assert tr._compat.replica_calling(graph) is None
    with torch.no_grad():
        got, want = replica(x), nn.Sequential(*replica.children())(x)
        torch.testing.assert_close(got, want)
        own = model(x)  # the original's call: its own weights
        torch.testing.assert_close(own, nn.Sequential(*model.children())(x))
        assert not torch.allclose(got, own)
    assert graph.stats.fallbacks == 2


def test_a_data_parallel_replica_is_found_through_the_frame_torch_runs_hooks_in(graphs) -> None:
    """With hooks, ``Module._call_impl`` calls the forward from a function it defines (``inner``),
    a frame further down: the replica is found there too (here asked from a hook, which runs in
    that function), and the original's call finds none."""
    model = _mlp().eval()
    x = torch.randn(4, 6)
    model.forward = tr.graph(model.forward, x)
    seen = []
    model.register_forward_pre_hook(lambda m, a: seen.append(tr._compat.replica_calling(model.forward)))
    replica = _replica(model)
    with torch.no_grad():
        torch.testing.assert_close(replica(x), nn.Sequential(*replica.children())(x))
        model(x)
    assert seen[0] is replica and seen[1] is None
    assert model.forward.stats.fallbacks == 2  # (hooks changed since capture)


def test_a_data_parallel_replica_of_a_forward_that_is_no_method_is_refused_naming_the_fix(graphs) -> None:
    """A forward that is a plain function (accelerate's hooks make one) cannot be bound to the
    replica: its call would run the original's weights on the replica's inputs."""
    model = _mlp().eval()
    layers = list(model.children())
    model.forward = tr.graph(lambda x: layers[2](layers[1](layers[0](x))), torch.randn(4, 6))
    model.train()  # (the graph was captured in eval mode: calls run eagerly)
    with pytest.raises(UnsupportedError, match=r"nn.DataParallel replica.*not a method.*DistributedDataParallel"):
        _replica(model)(torch.randn(4, 6))


@pytest.mark.parametrize("sizes", [None, [4, 8]], ids=["one_shape", "sizes"])
def test_a_graph_deep_copies_as_its_eager_callable_and_refuses_pickle(graphs, sizes) -> None:
    model = _mlp().eval()
    g = tr.graph(model, torch.randn(4, 6), sizes=sizes)
    assert copy.copy(g) is g
    twin = copy.deepcopy(g)
    assert isinstance(twin, nn.Sequential) and twin is not model
    x = torch.randn(4, 6)
    with torch.no_grad():
        torch.testing.assert_close(twin(x), g(x))
    with pytest.raises(UnsupportedError, match=r"'Sequential' \((Graphed|BucketedGraph)\) cannot be pickled.*state_dict"):
        pickle.dumps(g)


class Named(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, input_ids, attention_mask=None, *, scale: float = 2.0):
        return self.lin(input_ids) * scale


def test_a_graphed_callable_has_the_eager_signature(graphs) -> None:
    """Hugging Face's Trainer keeps only the dataset columns ``inspect.signature(model.forward)``
    names (every column dropped for ``(*args, **kwargs)``: "No columns in the dataset match");
    ``generate`` passes ``cache_position`` only to a forward that names it."""
    want = inspect.signature(Named().forward)
    model = Named()
    tr.make_graphed_callables(model, (torch.randn(2, 4),))
    assert isinstance(model.forward, tr.GraphedCallable)
    assert inspect.signature(model.forward) == want
    eval_model = Named().eval()
    for g in (tr.graph(eval_model, torch.randn(2, 4)), tr.graph(eval_model.forward, torch.randn(2, 4)),
              tr.graph(eval_model, torch.randn(2, 4), sizes=[2, 4])):
        assert inspect.signature(g) == want, type(g).__name__
    step = tr.graph(lambda x, y=1: x * y, torch.randn(2, 4))
    assert list(inspect.signature(step).parameters) == ["x", "y"]
    # the classes themselves keep their constructors' signatures
    assert "fn" in inspect.signature(tr.GraphedCallable).parameters


def test_hugging_face_trainer_trains_a_model_graphed_for_training(graphs, tmp_path) -> None:
    """The Trainer keeps the dataset columns the graphed forward names and trains through its
    graphs (with ``(*args, **kwargs)`` as the signature it dropped ``input_ids``). The sample
    holds what the Trainer passes to a forward that takes ``**kwargs`` (``num_items_in_batch``), as
    seen in the eager model's run."""
    model, ref, loss, want = train_graphed_and_eager("cpu", str(tmp_path), steps=4, hidden=32)
    assert loss == pytest.approx(want, rel=1e-5)
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, msg=n)
    assert model.forward.stats.replays == 4 and model.forward.stats.backward_replays == 4
    assert model.forward.stats.fallbacks == 0


def test_a_graphed_step_deep_copies_as_its_function_and_refuses_pickle(monkeypatch) -> None:
    """``graph_step``'s step stands for the step function, whose deep copy is itself (as eagerly:
    a function is not copied); a closure cannot be pickled, so neither can the step."""
    import test_training

    monkeypatch.setattr(test_training.step_mod, "capture", test_training._emulated_step_capture)
    monkeypatch.setattr(test_training.step_parts_mod, "infer_device", lambda fn, call, device=None: torch.device("cpu"))
    monkeypatch.setattr(test_training.step_mod, "side_stream", lambda device: None)
    model, opt = test_training._make_training()
    train_step = test_training._sgd_step(model, opt)
    step = tr.graph_step(train_step, torch.randn(5, 6), torch.randn(5, 3))
    assert copy.deepcopy(step) is train_step and copy.copy(step) is step
    assert list(inspect.signature(step).parameters) == ["x", "y"]
    with pytest.raises(UnsupportedError, match=r"'.*train_step' \(GraphedStep\) cannot be pickled"):
        pickle.dumps(step)


@pytest.mark.parametrize("sizes", [None, [2, 4]], ids=["one_shape", "sizes"])
def test_a_graph_made_the_forward_of_its_own_module_runs_eagerly_without_calling_itself(graphs, sizes) -> None:
    """``layer.forward = tr.graph(layer, x)``: a call that runs eagerly (here the layer is put in
    train mode) called the layer, whose forward is the graph: a RecursionError. It runs the
    layer's class forward now; its hooks ran around the call, once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)).eval()
    layer = model[0]
    g = tr.graph(layer, torch.randn(2, 4), sizes=sizes)
    layer.forward = g
    calls = []
    hook = layer.register_forward_hook(lambda m, a, out: calls.append(1))
    layer.train()
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(model(x), model[2](model[1](nn.functional.linear(x, layer.weight, layer.bias))))
    assert calls == [1] and g.stats.fallbacks == 1
    assert inspect.signature(layer.forward) == inspect.signature(nn.Linear(4, 4).forward)
    hook.remove()  # (a lambda: not picklable)
    twin = copy.deepcopy(model)  # the copy's layer runs its own class forward, eagerly
    with torch.no_grad():
        torch.testing.assert_close(twin(x), model(x))
        torch.testing.assert_close(pickle.loads(pickle.dumps(model))(x), model(x))


@pytest.mark.parametrize("sizes", [None, [2, 4]], ids=["one_shape", "sizes"])
def test_a_graph_inside_torch_func_transforms_runs_eagerly_as_the_transform_expects(graphs, sizes) -> None:
    """vmap, jvp and forward-mode AD over a graph raised a ReplayInputError that called the
    same shape a mismatch (or torch's "no batching rule for _foreach_copy_"): a replay can
    neither batch nor carry tangents. Such calls run the callable eagerly now, inside the
    transform, counted as fallbacks."""
    import torch.autograd.forward_ad as fw_ad

    torch.manual_seed(0)
    model = nn.Linear(4, 4).eval().requires_grad_(False)
    g = tr.graph(model, torch.randn(2, 4), sizes=sizes)
    xs, x, t = torch.randn(3, 2, 4), torch.randn(2, 4), torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(torch.func.vmap(g)(xs), model(xs))
        out, tangent = torch.func.jvp(g, (x,), (t,))
        torch.testing.assert_close(tangent, t @ model.weight.T)
        with fw_ad.dual_level():
            dual = g(fw_ad.make_dual(x, t))
            torch.testing.assert_close(fw_ad.unpack_dual(dual).tangent, t @ model.weight.T)
        torch.testing.assert_close(g(x), model(x))  # and replays again after
    assert g.stats.fallbacks == 3


def test_a_model_graphed_for_training_inside_torch_func_grad_runs_eagerly(graphs) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    ref = copy.deepcopy(model)
    tr.make_graphed_callables(model, (torch.randn(2, 4, requires_grad=True),))
    x = torch.randn(2, 4)
    got = torch.func.grad(lambda v: model(v).pow(2).sum())(x)
    torch.testing.assert_close(got, torch.func.grad(lambda v: ref(v).pow(2).sum())(x))
    params = dict(model.named_parameters())
    grads = torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).sum())(params)
    ref_grads = torch.func.grad(lambda p: torch.func.functional_call(ref, p, (x,)).sum())(dict(ref.named_parameters()))
    for name in params:
        torch.testing.assert_close(grads[name], ref_grads[name], msg=name)
    assert model.forward.stats.fallbacks == 2 and model.forward.stats.replays == 0


def test_a_launchless_layer_called_by_a_data_parallel_replica_elsewhere_returns_the_replicas_weights(monkeypatch) -> None:
    """A layer of make_graphed_callables that launches no kernel (a learned position table
    returning a view of its weight) runs eagerly at every call; called by an nn.DataParallel
    replica on another GPU it ran the original's forward, handing that replica a view of the
    original's weight (on the original's GPU). It runs the replica's own forward."""
    from torchreplay.training.callables import Launchless

    class Table(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, 4))

        def forward(self, n: torch.Tensor) -> torch.Tensor:
            return self.weight[: n.shape[0]]

    model = Table()
    layer = Launchless.__new__(Launchless)  # (no GPU here to capture on: made as _build makes it)
    layer.fn, layer.name, layer.device, layer._run_fn = model, "Table", torch.device("cuda", 0), model.forward
    layer._multi = 0  # (as on a machine with two GPUs)
    model.forward = layer
    replica = model._replicate_for_data_parallel()
    replica.weight = torch.randn(8, 4)  # (replicate() sets the copies so, not as Parameters)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # the replica's thread, on cuda:1
    n = torch.zeros(3)
    assert replica(n).data_ptr() == replica.weight.data_ptr()  # the replica's weight
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert model(n).data_ptr() == model.weight.data_ptr()  # the original's, on its own GPU
