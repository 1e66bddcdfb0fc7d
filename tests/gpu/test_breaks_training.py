"""Training with breaks (``tr.make_graphed_callables(model, args, breaks=...)``) on a real GPU,
each against an eager twin from the same weights over many steps with fresh random inputs: an
attention that reads host-side lengths changing every step, HF Llama with its attention as the
break, ``breaks="auto"`` at an ``.item()``, a break whose output changes shape, and two
micro-batches before one backward."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchreplay as tr

import blocks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEV = "cuda"
H, T, V, B = 64, 8, 96, 4
STEPS = 12
TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(autouse=True)
def full_fp32_matmul():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


class HostAttention(nn.Module):
    """Row ``b`` attends to its first ``lengths[b]`` positions; ``lengths`` is a CPU tensor read
    with ``tolist`` (a graph would freeze it), different at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(H, 3 * H)
        self.o = nn.Linear(H, H)
        self.calls = 0

    def forward(self, x, lengths):
        self.calls += 1
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        rows = []
        for b, n in enumerate(lengths.tolist()):
            s = (q[b] @ k[b, :n].transpose(0, 1)) / math.sqrt(H)
            rows.append(s.softmax(-1) @ v[b, :n])
        return self.o(torch.stack(rows))


class Block(blocks.Block):
    def __init__(self) -> None:
        super().__init__(HostAttention, H)


class Model(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.blocks = nn.ModuleList([Block() for _ in range(layers)])
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, V)

    def forward(self, ids, lengths):
        h = self.embed(ids)
        for blk in self.blocks:
            h = blk(h, lengths)
        return self.head(self.norm(h))


def _batch(g: torch.Generator):
    ids = torch.randint(0, V, (B, T), device=DEV, generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=torch.Generator().manual_seed(int(ids.sum())))
    return ids, lengths


def _assert_same(a: nn.Module, b: nn.Module, what: str, grads: bool = True) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, msg=lambda m: f"{what}: {name}: {m}", **TOL)
        if grads:
            assert (p.grad is None) == (q.grad is None), f"{what}: {name}.grad"
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{what}: {name}.grad: {m}", **TOL)


def _step(model, opt, ids, lengths, targets):
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(ids, lengths).flatten(0, 1), targets.flatten())
    loss.backward()
    return loss


def _twin_step(model, ref, opts, g: torch.Generator, step: int):
    """One SGD step of the graphed model and of its eager twin on a fresh batch: loss, weights
    and gradients equal. Returns the batch's lengths."""
    ids, lengths = _batch(g)
    targets = torch.randint(0, V, (B, T), device=DEV, generator=g)
    loss = _step(model, opts[0], ids, lengths, targets)
    loss_ref = _step(ref, opts[1], ids, lengths, targets)
    torch.testing.assert_close(loss, loss_ref, **TOL)
    _assert_same(model, ref, f"step {step}")
    for opt in opts:
        opt.step()
    return lengths


def test_host_lengths_attention_trains_like_eager_around_the_graphed_segments():
    torch.manual_seed(0)
    model = Model().to(DEV)
    ref = copy.deepcopy(model)
    g = torch.Generator(device=DEV).manual_seed(1)
    sample = _batch(g)
    tr.make_graphed_callables(model, sample, breaks=[HostAttention])
    report = tr.explain(model)
    assert "4 segment(s)" in report and report.count("break HostAttention at ") == 3, report
    runtime = model.forward
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    _assert_same(model, ref, "after graphing", grads=False)  # the build left the weights as they were
    seen_lengths = set()
    for step in range(STEPS):
        seen_lengths.add(tuple(_twin_step(model, ref, (opt, opt_ref), g, step).tolist()))
    assert len(seen_lengths) > 1
    for seg in runtime.segments:  # every step replayed every segment, forward and backward
        assert seg.stats.replays == STEPS and seg.stats.fallbacks == 0, seg
        assert seg.stats.backward_replays == STEPS, seg
    assert all(b.attn.calls == STEPS + 2 for b in model.blocks)  # each step, eagerly (+ the build's two runs)


def test_two_micro_batches_before_one_backward_match_eager():
    torch.manual_seed(0)
    model = Model(layers=2).to(DEV)
    ref = copy.deepcopy(model)
    g = torch.Generator(device=DEV).manual_seed(2)
    tr.make_graphed_callables(model, _batch(g), breaks=[HostAttention])
    for _ in range(3):
        (a, la), (b, lb) = _batch(g), _batch(g)
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            loss = m(a, la).square().mean() + m(b, lb).square().mean()
            loss.backward()
        _assert_same(model, ref, "accumulated")
    a, la = _batch(g)
    with torch.no_grad():  # forward graphs alone
        torch.testing.assert_close(model(a, la), ref(a, la), **TOL)
    model.eval()
    ref.eval()
    torch.testing.assert_close(model(a, la), ref(a, la), **TOL)  # the other mode: eagerly
    assert model.forward.stats.fallbacks == 1


class TwoHeads(nn.Module):
    """``Model`` with one block and a second output: ``aux`` of the embedding, made in the first
    segment (before the break), beside the head's, made in the last."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.aux = nn.Linear(H, V)
        self.block = Block()
        self.head = nn.Linear(H, V)

    def forward(self, ids, lengths):
        h = self.embed(ids)
        return self.head(self.block(h, lengths)), self.aux(h)


def test_an_output_the_loss_leaves_unused_gives_no_gradient_across_the_breaks_as_eagerly():
    """A loss over one of the two outputs: what only the other reaches (``aux``; or the block
    and the head, past the break) keeps ``.grad`` None, as eagerly, over steps that use the
    head, the aux output or both; gradients equal eager's."""
    torch.manual_seed(0)
    model = TwoHeads().to(DEV)
    ref = copy.deepcopy(model)
    g = torch.Generator(device=DEV).manual_seed(5)
    tr.make_graphed_callables(model, _batch(g), breaks=[HostAttention])
    for step in range(9):
        ids, lengths = _batch(g)
        t1, t2 = torch.randn(B, T, V, device=DEV), torch.randn(B, T, V, device=DEV)
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            y, a = m(ids, lengths)
            ((y * t1).sum(), (a * t2).sum(), (y * t1).sum() + (a * t2).sum())[step % 3].backward()
        _assert_same(model, ref, f"step {step}")
        if step % 3 == 0:
            assert model.aux.weight.grad is None
        if step % 3 == 1:
            assert model.head.weight.grad is None and model.block.mlp[0].weight.grad is None
    assert all(s.stats.fallbacks == 0 for s in model.forward.segments)


def test_hf_llama_with_its_attention_as_the_break_trains_like_eager():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(DEV).train()
    ref = copy.deepcopy(model)
    g = torch.Generator(device=DEV).manual_seed(3)
    ids = torch.randint(0, 128, (2, 16), device=DEV, generator=g)
    tr.make_graphed_callables(model, (ids,), sample_kwargs={"labels": ids}, breaks=[modeling_llama.LlamaAttention])
    report = tr.explain(model)
    assert "3 segment(s)" in report and report.count("break LlamaAttention at ") == 2, report
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for step in range(6):
        ids = torch.randint(0, 128, (2, 16), device=DEV, generator=g)
        for m, o in ((model, opt), (ref, opt_ref)):
            o.zero_grad(set_to_none=True)
            m(ids, labels=ids).loss.backward()
        _assert_same(model, ref, f"step {step}")
        opt.step()
        opt_ref.step()
    assert all(s.stats.fallbacks == 0 and s.stats.replays == 6 for s in model.forward.segments)


class Clip(nn.Module):
    """Clips at half the largest magnitude, read on the host (``.item()``)."""

    def forward(self, h):
        return h.clamp(-0.5 * h.detach().abs().max().item(), 0.5 * h.detach().abs().max().item())


def test_auto_breaks_at_the_item_and_trains_like_eager(caplog):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(H, H), nn.Tanh(), Clip(), nn.Linear(H, H), nn.ReLU(), nn.Linear(H, 8)).to(DEV)
    ref = copy.deepcopy(model)
    x = torch.randn(B, H, device=DEV)
    with caplog.at_level(logging.INFO, logger="torchreplay"):
        tr.make_graphed_callables(model, (x,), breaks="auto")
    assert any("breaks at 2 (Clip)" in r.getMessage() for r in caplog.records), caplog.text
    report = tr.explain(model)
    assert "2 segment(s)" in report and "break Clip at " in report, report
    for _ in range(STEPS):
        x = torch.randn(B, H, device=DEV)
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            m(x).square().sum().backward()
        _assert_same(model, ref, "auto")
    # nothing to break at: the whole model is one graph
    plain = nn.Sequential(nn.Linear(H, H), nn.ReLU()).to(DEV)
    tr.make_graphed_callables(plain, (x,), breaks="auto")
    assert isinstance(plain.__dict__["forward"], tr.GraphedCallable)


class Experts(nn.Module):
    """Rows picked by a router (``nonzero``) go through one linear: their count changes."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(H, 1)
        self.expert = nn.Linear(H, H)

    def forward(self, h):
        picked = (self.gate(h)[:, 0] > 0).nonzero()[:, 0]
        out = h.clone()
        out[picked] = self.expert(h[picked])
        return out


def test_a_break_whose_output_changes_shape_raises_naming_it_and_both_shapes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(H, H), Experts(), nn.Linear(H, 8)).to(DEV)
    tr.make_graphed_callables(model, (torch.randn(64, H, device=DEV),), breaks=["aten.nonzero"])
    with pytest.raises(tr.ReplayInputError, match=r"break aten.nonzero \(at .*\) returned \(\(\d+, 1\).* where it returned \(\(\d+, 1\)"):
        for _ in range(20):  # another count of picked rows
            model(torch.randn(64, H, device=DEV)).sum().backward()


class NormedBlock(nn.Module):
    """BatchNorm statistics (written in place between breaks) and a break that reads host lengths."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(H, H)
        self.bn = nn.BatchNorm1d(T)
        self.attn = HostAttention()
        self.out = nn.Linear(H, 8)

    def forward(self, x, lengths):
        h = self.bn(self.inp(x))
        return self.out(h + self.attn(h, lengths))


def _normed_batches(g: torch.Generator):
    """A maker of NormedBlock's batches: fresh inputs from ``g``, and host lengths."""

    def batch():
        x = torch.randn(B, T, H, device=DEV, generator=g)
        return x, torch.randint(1, T + 1, (B,), generator=torch.Generator().manual_seed(int(x.sum().abs() * 1000)))

    return batch


def test_batchnorm_statistics_move_once_per_step_and_a_replaced_weight_raises():
    torch.manual_seed(0)
    model = NormedBlock().to(DEV)
    ref = copy.deepcopy(model)
    g = torch.Generator(device=DEV).manual_seed(4)
    batch = _normed_batches(g)
    tr.make_graphed_callables(model, batch(), breaks=[HostAttention])
    for name, b in model.bn.named_buffers():  # the record and the captures left them as they were
        torch.testing.assert_close(b, dict(ref.bn.named_buffers())[name])
    for step in range(STEPS):
        x, lengths = batch()
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            m(x, lengths).square().mean().backward()
        _assert_same(model, ref, f"step {step}")
        for name, b in model.bn.named_buffers():
            torch.testing.assert_close(b, dict(ref.bn.named_buffers())[name], msg=f"step {step}: bn.{name}")
    model.out.weight = nn.Parameter(model.out.weight.detach().clone())
    with pytest.raises(tr.ReplayInputError, match="out.weight"):
        model(*batch())


def test_higher_order_and_second_backwards_through_segments_equal_eager(caplog):
    """A gradient penalty (create_graph=True) and two losses of one output (retain_graph=True)
    through a model trained with breaks: each segment runs its ops again for what its backward
    graph cannot compute (training/recompute.py), the breaks' own autograd does the rest. The
    BatchNorm statistics, which the segment's recorded ops write, move once per forward."""
    torch.manual_seed(0)
    model = NormedBlock().to(DEV)
    ref = copy.deepcopy(model)
    batch = _normed_batches(torch.Generator(device=DEV).manual_seed(5))
    tr.make_graphed_callables(model, batch(), breaks=[HostAttention])
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        for step in range(6):
            x, lengths = batch()
            for m in (model, ref):
                m.zero_grad(set_to_none=True)
                if step % 2 == 0:
                    loss = m(x, lengths).square().mean()
                    gs = torch.autograd.grad(loss, list(m.parameters()), create_graph=True)
                    (loss + sum(gg.square().sum() for gg in gs)).backward()
                else:
                    y = m(x, lengths)
                    y.square().mean().backward(retain_graph=True)
                    y.sin().mean().backward()
            _assert_same(model, ref, f"step {step}")
            for name, b in model.bn.named_buffers():
                torch.testing.assert_close(b, dict(ref.bn.named_buffers())[name], msg=f"step {step}: bn.{name}")
    assert sum(seg.stats.recomputed for seg in model.forward.segments) >= 6


class DropBlock(Block):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Dropout(0.2), nn.Linear(4 * H, H))


def test_dropout_between_breaks_draws_the_masks_eager_draws_from_the_same_seed():
    torch.manual_seed(0)
    model = nn.ModuleList([DropBlock(), DropBlock()]).to(DEV)

    class Two(nn.Module):
        def __init__(self, blocks):
            super().__init__()
            self.blocks = blocks

        def forward(self, x, lengths):
            for b in self.blocks:
                x = b(x, lengths)
            return x

    graphed, ref = Two(model), Two(copy.deepcopy(model))
    g = torch.Generator(device=DEV).manual_seed(5)
    x = torch.randn(B, T, H, device=DEV, generator=g)
    tr.make_graphed_callables(graphed, (x, torch.tensor([T] * B)), breaks=[HostAttention])
    outs = []  # a mask frozen at capture would differ from eager's from the second step on
    for step in range(6):
        x = torch.randn(B, T, H, device=DEV, generator=g)
        lengths = torch.randint(1, T + 1, (B,), generator=torch.Generator().manual_seed(step))
        for m in (graphed, ref):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(100 + step)
            out = m(x, lengths)
            out.square().mean().backward()
            outs.append(out.detach().clone())
        torch.testing.assert_close(outs[-2], outs[-1], **TOL)
        _assert_same(graphed, ref, f"step {step}")


def test_bf16_autocast_trains_like_eager(caplog):
    torch.manual_seed(0)
    model = Model(layers=2).to(DEV)
    ref = copy.deepcopy(model)
    g = torch.Generator(device=DEV).manual_seed(6)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        tr.make_graphed_callables(model, _batch(g), breaks=[HostAttention])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(6):
        ids, lengths = _batch(g)
        targets = torch.randint(0, V, (B, T), device=DEV, generator=g)
        for m, o in ((model, opt), (ref, opt_ref)):
            o.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = m(ids, lengths)
            F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-3, msg=lambda m: f"step {step}: {name}: {m}")
        opt.step()
        opt_ref.step()
    assert model.forward.stats.fallbacks == 0
    ids, lengths = _batch(g)  # without autocast: eagerly, in fp32 as eager (counted, warned)
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        out = model(ids, lengths)
    assert out.dtype == torch.float32 and model.forward.stats.fallbacks == 1
    assert "captured under autocast(bfloat16) but is called under no autocast" in caplog.text
    torch.testing.assert_close(out, ref(ids, lengths), rtol=2e-2, atol=2e-3)  # (weights after bf16 steps)


class InPlaceResidual(nn.Module):
    """``h += attn(...)`` after the break: h, made before it, is written in place, itself or
    through a view made after the break."""

    def __init__(self, through: str = "itself") -> None:
        super().__init__()
        self.lin1 = nn.Linear(H, H)
        self.attn = HostAttention()
        self.lin2 = nn.Linear(H, 8)
        self.through = through

    def forward(self, x, lengths):
        h = self.lin1(x)
        a = self.attn(h * 1, lengths)
        if self.through == "itself":
            h += a
        else:
            h.view(-1, H)[1:].add_(a.view(-1, H)[1:])
        return self.lin2(h)


@pytest.mark.parametrize("through", ["itself", "a view"])
def test_a_value_written_in_place_after_a_break_trains_like_eager(through):
    torch.manual_seed(0)
    model = InPlaceResidual(through).to(DEV)
    ref = copy.deepcopy(model)
    g = torch.Generator(device=DEV).manual_seed(7)
    x = torch.randn(B, T, H, device=DEV, generator=g)
    tr.make_graphed_callables(model, (x, torch.tensor([T] * B)), breaks=[HostAttention])
    for step in range(6):
        x = torch.randn(B, T, H, device=DEV, generator=g)
        lengths = torch.randint(1, T + 1, (B,), generator=torch.Generator().manual_seed(step))
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            m(x, lengths).square().mean().backward()
        _assert_same(model, ref, f"step {step}")


class HostScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = HostAttention()

    def forward(self, x, lengths, scale):
        return self.attn(x, lengths) * scale  # a 0-dim host tensor, read between breaks


def test_a_host_scalar_the_code_between_breaks_reads_is_refused():
    """A graph would take a CPU scalar's value at capture and keep it: refused, naming it."""
    model = HostScale().to(DEV)
    x = torch.randn(B, T, H, device=DEV)
    with pytest.raises(tr.CaptureError, match=r"reads the caller's cpu tensor of shape \(\).*test_breaks_training.py:\d+"):
        tr.make_graphed_callables(model, (x, torch.tensor([T] * B), torch.tensor(0.5)), breaks=[HostAttention])


def test_a_hook_added_after_the_build_runs_eagerly_and_a_backward_hook_is_refused(caplog):
    """A forward hook (feature collector that also scales) added after the build to a module
    between breaks runs at every call, as eagerly, while it is there; removed, the segments
    replay again. A backward hook between breaks is refused at the build."""
    torch.manual_seed(0)
    model = Model(layers=2).to(DEV)
    ref = copy.deepcopy(model)
    g = torch.Generator(device=DEV).manual_seed(5)
    sample = _batch(g)
    handle = model.blocks[0].mlp.register_full_backward_hook(lambda m, gi, go: None)
    with pytest.raises(tr.CaptureError, match="backward hooks"):
        tr.make_graphed_callables(model, sample, breaks=[HostAttention])
    handle.remove()
    tr.make_graphed_callables(model, sample, breaks=[HostAttention])
    runtime = model.forward
    feats, feats_ref = [], []

    def collect(into):
        def hook(module, args, out):
            into.append(out.detach().clone())
            return out * 1.5
        return hook

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    handles = []
    for step in range(6):
        if step == 2:
            handles = [model.blocks[1].n2.register_forward_hook(collect(feats)),
                       ref.blocks[1].n2.register_forward_hook(collect(feats_ref))]
        if step == 4:
            for h in handles:
                h.remove()
        with caplog.at_level(logging.WARNING, logger="torchreplay"):
            _twin_step(model, ref, (opt, opt_ref), g, step)
    assert len(feats) == len(feats_ref) == 2
    for a, b in zip(feats, feats_ref):
        torch.testing.assert_close(a, b, **TOL)
    assert runtime.stats.fallbacks == 2 and runtime.stats.replays == 4
    assert "hooks of 'Model' changed since capture (on LayerNorm)" in caplog.text
    assert all(seg.stats.replays == 4 and seg.stats.backward_replays == 4 for seg in runtime.segments)


class TritonBlock(Block):
    """The MLP's activation is a Triton kernel: through a ``torch.autograd.Function`` whose
    backward is another Triton kernel (twice SiLU's derivative), or launched raw."""

    def __init__(self, act) -> None:
        super().__init__()
        self.act = act

    def forward(self, x, lengths):
        x = x + self.attn(self.n1(x), lengths)
        mlp = self.mlp
        return x + mlp[2](self.act(mlp[0](self.n2(x))))


def test_a_triton_kernel_in_an_autograd_function_trains_like_eager_and_a_raw_launch_is_refused():
    pytest.importorskip("triton")
    from triton_kernels import TritonSiLU, silu

    torch.manual_seed(0)
    model = Model(layers=2).to(DEV)
    for i, blk in enumerate(model.blocks):
        model.blocks[i] = TritonBlock(TritonSiLU.apply).to(DEV)
        model.blocks[i].load_state_dict(blk.state_dict())
    ref = copy.deepcopy(model)
    g = torch.Generator(device=DEV).manual_seed(5)
    tr.make_graphed_callables(model, _batch(g), breaks=[HostAttention])
    report = tr.explain(model)
    assert "3 segment(s)" in report and report.count("Functions: TritonSiLU") == 2, report
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(STEPS):
        _twin_step(model, ref, (opt, opt_ref), g, step)
    # the first MLP weight gets its gradient through the Function's own backward kernel
    assert all(b.mlp[0].weight.grad is not None and b.mlp[0].weight.grad.abs().sum() > 0 for b in model.blocks)

    raw = Model(layers=1).to(DEV)
    raw.blocks[0] = TritonBlock(silu).to(DEV)
    with pytest.raises(tr.CaptureError, match=r"Triton kernel silu_forward was launched.*triton_kernels.py:\d+"):
        tr.make_graphed_callables(raw, _batch(g), breaks=[HostAttention])


def test_hf_llama_with_liger_kernels_between_its_attention_breaks_trains_like_eager():
    """Liger's Triton RMSNorm and SwiGLU (``torch.autograd.Function``s, the norm's backward in
    place on its incoming gradient) in every decoder layer, put in by hand (Liger's own
    ``apply_liger_kernel_to_llama`` patches transformers for the whole process); the attention
    is the break. Needs the ``liger_kernel`` package (carried to the GPU machine as a wheel)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("liger_kernel")
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
    from transformers.models.llama import modeling_llama

    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        for name in ("input_layernorm", "post_attention_layernorm"):
            norm = LigerRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
            norm.weight.data.uniform_(0.5, 1.5)
            setattr(layer, name, norm)
        mlp = LigerSwiGLUMLP(cfg)
        mlp.load_state_dict(layer.mlp.state_dict())
        layer.mlp = mlp
    model = model.to(DEV).train()
    ref = copy.deepcopy(model)
    g = torch.Generator(device=DEV).manual_seed(4)
    ids = torch.randint(0, 128, (2, 16), device=DEV, generator=g)
    tr.make_graphed_callables(model, (ids,), sample_kwargs={"labels": ids}, breaks=[modeling_llama.LlamaAttention])
    report = tr.explain(model)
    assert "3 segment(s)" in report and "Functions: LigerRMSNormFunction x2, LigerSiLUMulFunction" in report, report
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for step in range(6):
        ids = torch.randint(0, 128, (2, 16), device=DEV, generator=g)
        losses = []
        for m, o in ((model, opt), (ref, opt_ref)):
            o.zero_grad(set_to_none=True)
            loss = m(ids, labels=ids).loss
            loss.backward()
            losses.append(loss)
        torch.testing.assert_close(losses[0], losses[1], **TOL)
        _assert_same(model, ref, f"step {step}")
        opt.step()
        opt_ref.step()
    assert all(s.stats.fallbacks == 0 and s.stats.replays == 6 for s in model.forward.segments)
    norms = [layer.input_layernorm.weight.grad for layer in model.model.layers]
    assert all(n is not None and n.abs().sum() > 0 for n in norms)


def test_breaks_with_a_graphed_optimizer_step_train_like_eager():
    """The fastest recipe for a model that needs breaks: the forward and backward graphed
    around them, then the optimizer step graphed alone (``tr.graph_step(opt.step,
    optimizers=opt)``), fresh gradients each step (``zero_grad(set_to_none=True)``)."""
    torch.manual_seed(0)
    model = Model(layers=2).to(DEV)
    ref = copy.deepcopy(model)
    g = torch.Generator(device=DEV).manual_seed(6)
    tr.make_graphed_callables(model, _batch(g), breaks=[HostAttention])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True, fused=True)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    step = None
    for n in range(STEPS):
        ids, lengths = _batch(g)
        targets = torch.randint(0, V, (B, T), device=DEV, generator=g)
        loss = _step(model, opt, ids, lengths, targets)
        loss_ref = _step(ref, opt_ref, ids, lengths, targets)
        torch.testing.assert_close(loss, loss_ref, **TOL)
        _assert_same(model, ref, f"step {n}")
        if n == 0:  # the first step eagerly: the optimizer's state exists before the capture
            opt.step()
            step = tr.graph_step(opt.step, optimizers=opt)
        else:
            step()
        opt_ref.step()
    _assert_same(model, ref, "after the last step", grads=False)
    assert step is not None and step.stats.replays == STEPS - 1


def test_a_layer_frozen_at_the_build_and_unfrozen_later_trains_like_eager(caplog):
    """Fine-tuning's freeze-then-unfreeze: a segment's backward graph was captured without the
    frozen layer's gradient. Unfrozen, the model runs eagerly (one warning), so the layer gets
    eager's gradient and update instead of none."""
    torch.manual_seed(0)
    model = Model(layers=2).to(DEV)
    model.blocks[0].mlp.requires_grad_(False)
    ref = copy.deepcopy(model)
    g = torch.Generator(device=DEV).manual_seed(7)
    tr.make_graphed_callables(model, _batch(g), breaks=[HostAttention])
    opts = (torch.optim.SGD(model.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05))
    for step in range(3):
        _twin_step(model, ref, opts, g, step)
    assert model.forward.stats.fallbacks == 0
    for m in (model, ref):
        m.blocks[0].mlp.requires_grad_(True)
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        for step in range(3, 6):
            _twin_step(model, ref, opts, g, step)
    assert model.blocks[0].mlp[0].weight.grad is not None
    assert model.forward.stats.fallbacks == 3 and "changed since capture" in caplog.text


class ViewsBetweenBreaks(nn.Module):
    """Between its two breaks only a view (``unflatten``): that segment launches no kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.clip1, self.clip2 = nn.Linear(H, H), nn.Linear(H, H), Clip(), Clip()  # (above)

    def forward(self, x):
        h = self.clip1(self.a(x)).unflatten(0, (2, B // 2))
        return self.b(self.clip2(h).flatten(0, 1)).tanh()


def test_a_segment_that_launches_nothing_trains_like_eager():
    """The code between two breaks is a view: its segment's capture recorded nothing, and the
    build was refused ("an empty graph"). That segment now runs as it is, eagerly (a view of
    the break's output, as eagerly), and the model trains as its eager twin."""
    torch.manual_seed(0)
    model = ViewsBetweenBreaks().to(DEV)
    ref = copy.deepcopy(model)
    tr.make_graphed_callables(model, (torch.randn(B, H, device=DEV, requires_grad=True),), breaks=[Clip])
    runtime = model.forward
    assert any("launches no kernel" in repr(seg) for seg in runtime.segments), runtime.segments
    assert "launches no kernel, so every call runs it eagerly" in tr.explain(model)
    for step in range(STEPS):
        x = torch.randn(B, H, device=DEV, requires_grad=True)
        xr = x.detach().clone().requires_grad_(True)
        y, yr = model(x), ref(xr)
        torch.testing.assert_close(y, yr, **TOL)
        t = torch.randn_like(y)
        (y * t).sum().backward()
        (yr * t).sum().backward()
        torch.testing.assert_close(x.grad, xr.grad, **TOL)
        _assert_same(model, ref, f"step {step}")
    assert model.forward.stats.fallbacks == 0
    graphed = [seg for seg in runtime.segments if "launches no kernel" not in repr(seg)]
    assert graphed and all(seg.stats.backward_replays == STEPS for seg in graphed)
