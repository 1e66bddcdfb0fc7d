"""Training with breaks (``tr.make_graphed_callables(model, args, breaks=...)``), on the CPU:
which submodules one eager run chooses to graph and which run eagerly around the breaks, for
each way of naming a break; state put back after the run; option errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchreplay as tr
from torchreplay.breaks.training import plan_modules
from torchreplay.errors import CaptureError

CPU = torch.device("cpu")


def host_mask(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    keep = torch.arange(x.shape[1])[None, :] < lengths[:, None]  # reads host lengths
    return x * keep[..., None].to(x.dtype)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, h, lengths):
        return host_mask(self.q(h), lengths)


class Router(nn.Module):
    """A MoE-style router: a data-dependent count (``nonzero``) between two linears."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 1)
        self.expert = nn.Linear(8, 8)

    def forward(self, h):
        picked = (self.gate(h)[..., 0] > 0).nonzero()
        out = h.clone()
        out[picked[:, 0], picked[:, 1]] = 0
        return self.expert(out)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(8)
        self.attn = Attention()
        self.norm2 = nn.LayerNorm(8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.act = nn.Tanh()  # called twice per forward

    def forward(self, h, lengths):
        h = h + self.act(self.attn(self.norm1(h), lengths))
        return h + self.act(self.mlp(self.norm2(h)))


class Model(nn.Module):
    def __init__(self, router: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.router = Router() if router else None
        self.bn = nn.BatchNorm1d(4)
        self.unused = nn.Linear(8, 8)  # never called
        self.head = nn.Linear(8, 32)

    def forward(self, ids, lengths):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h, lengths)
        if self.router is not None:
            h = self.router(h)
        return self.head(self.bn(h))


def _sample():
    torch.manual_seed(0)
    return torch.randint(0, 32, (2, 4)), torch.tensor([3, 2])


def _paths(seen):
    return [s.path for s in seen]


@pytest.mark.parametrize("how", ["class", "instances", "function"])
def test_the_largest_break_free_submodules_are_graphed_in_the_order_they_ran(how):
    model = Model()
    breaks = {
        "class": [Attention],
        "instances": [model.layers[0].attn, model.layers[1].attn],
        "function": [host_mask],
    }[how]
    graphed, eager = plan_modules(model, _sample(), {}, breaks, CPU)
    # Inside each layer: its norms and MLP (not the MLP's linears: the MLP is whole); not the
    # attention (a break) nor its q (inside it), not the Tanh (ran twice), not `unused`. A
    # function break makes the attention hold it: its q, which runs before it, is graphed.
    want = ["embed"]
    for i in range(2):
        q = [f"layers.{i}.attn.q"] if how == "function" else []
        want += [f"layers.{i}.norm1", *q, f"layers.{i}.norm2", f"layers.{i}.mlp"]
    assert _paths(graphed) == want + ["bn", "head"]
    # The layers hold a break and run eagerly; a function break makes its caller hold it
    assert {"layers", "layers.0", "layers.1", "layers.0.attn", "layers.1.attn"} - {"layers"} <= set(_paths(eager))
    mlp = next(s for s in graphed if s.path == "layers.1.mlp")
    (h,) = mlp.args
    assert h.requires_grad and h.grad_fn is None  # a detached sample that wants its gradient
    embed = graphed[0]
    assert not embed.args[0].requires_grad and embed.args[0].dtype == torch.int64


def test_an_op_break_leaves_its_modules_children_graphed():
    model = Model(router=True)
    graphed, eager = plan_modules(model, _sample(), {}, ["aten.nonzero", Attention], CPU)
    paths = _paths(graphed)
    assert "router.gate" in paths and "router.expert" in paths and "router" not in paths
    assert "router" in _paths(eager)


def test_the_run_puts_module_state_and_rng_back():
    model = Model()
    model.train()
    before = {k: v.clone() for k, v in model.bn.state_dict().items()}
    sample = _sample()
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    plan_modules(model, sample, {}, [Attention], CPU)
    for k, v in model.bn.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(torch.get_rng_state(), rng)
    # and no hook or forward of ours is left on the model
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
        assert "forward" not in m.__dict__


def test_a_break_never_reached_and_nothing_left_to_graph_are_errors():
    model = Model()
    with pytest.raises(CaptureError, match="Router never ran"):
        plan_modules(model, _sample(), {}, [Router], CPU)

    class Whole(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = Attention()

        def forward(self, h, lengths):
            return self.attn(h, lengths)

    with pytest.raises(CaptureError, match="nothing is left to graph"):
        plan_modules(Whole(), (torch.randn(2, 4, 8), torch.tensor([3, 2])), {}, [Attention], CPU)


def test_a_submodule_that_gives_no_tensor_is_not_graphed():
    class Count(nn.Module):
        def forward(self, h):
            return int(h.shape[0])

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.count = Count()
            self.attn = Attention()
            self.lin = nn.Linear(8, 8)

        def forward(self, h, lengths):
            return self.lin(self.attn(h, lengths)) * self.count(h)

    graphed, _ = plan_modules(M(), (torch.randn(2, 4, 8), torch.tensor([3, 2])), {}, [Attention], CPU)
    assert _paths(graphed) == ["lin"]


def test_options_with_breaks():
    with pytest.raises(TypeError, match="pass the model"):
        tr.make_graphed_callables(host_mask, (torch.randn(2, 4, 8),), breaks=[host_mask])
    with pytest.raises(TypeError, match="sample_args must be a tuple"):
        tr.make_graphed_callables(Model(), torch.randn(2), breaks=[Attention])
    assert "breaks:" in (tr.make_graphed_callables.__doc__ or "")
