"""Training with breaks (``tr.make_graphed_callables(model, args, breaks=...)``), on the CPU: the
program one eager run records (segments between the breaks, what each reads and gives, where
each break's arguments come from) for each way of naming a break, run eagerly (each segment's
ops again, through autograd) against the model over fresh inputs, outputs and gradients;
what is refused at record time; option errors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import torchreplay as tr
from torchreplay.breaks.program import Call, record
from torchreplay.breaks.training import BreakTraining, record_checked
from torchreplay.core.args import CallArgs
from torchreplay.core.snapshot import StateSnapshot
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


@torch.library.custom_op("trbreakstrain::host_scale", mutates_args=())
def host_scale(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """host_mask as a custom op with its own backward."""
    return host_mask(x, lengths)


@host_scale.register_fake
def _(x, lengths):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    x, lengths = inputs
    ctx.keep = (torch.arange(x.shape[1])[None, :] < lengths[:, None]).to(x.dtype)[..., None]


host_scale.register_autograd(lambda ctx, grad: (grad * ctx.keep, None), setup_context=_setup)


class OpAttention(Attention):
    def forward(self, h, lengths):
        return torch.ops.trbreakstrain.host_scale(self.q(h), lengths)


class Layer(nn.Module):
    def __init__(self, attention: type = Attention) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(8)
        self.attn = attention()
        self.norm2 = nn.LayerNorm(8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.act = nn.Tanh()  # called twice per forward

    def forward(self, h, lengths):
        h = h + self.act(self.attn(self.norm1(h), lengths))
        return h + self.act(self.mlp(self.norm2(h)))


class Model(nn.Module):
    def __init__(self, attention: type = Attention) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.layers = nn.ModuleList([Layer(attention), Layer(attention)])
        self.bn = nn.BatchNorm1d(4)
        self.unused = nn.Linear(8, 8)  # never called
        self.head = nn.Linear(8, 32)

    def forward(self, ids, lengths):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h, lengths)
        return self.head(self.bn(h))


def _sample(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32, (2, 4), generator=g), torch.randint(1, 5, (2,), generator=g)


def _eager_program(model, breaks, *sample):
    """The recorded program run without graphs: each segment is its own function. The
    recording ran the model for real: its state is put back, as the build does."""
    snapshot = StateSnapshot(model, CPU, large="copy")
    program, reads, _ = record_checked(model, CallArgs(model, sample, {}), breaks, CPU)
    snapshot.restore()
    return program, BreakTraining(model, program, [s.function() for s in program.segments], model.forward, CPU, reads)


def same_grads(model, ref, nonzero: bool = False) -> None:
    """Every parameter's gradient of ``model`` equals ``ref``'s (and is not all zero, with
    ``nonzero``); then both are zeroed."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert not nonzero or q.grad.abs().sum() > 0, name
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)


@pytest.mark.parametrize("how", ["class", "instances", "function", "op"])
def test_the_program_runs_like_the_model_over_fresh_inputs_outputs_and_gradients(how):
    torch.manual_seed(0)
    model = Model(OpAttention if how == "op" else Attention)
    ref = copy.deepcopy(model)
    breaks = {
        "class": [Attention],
        "instances": [model.layers[0].attn, model.layers[1].attn],
        "function": [host_mask],
        "op": ["trbreakstrain.host_scale"],
    }[how]
    program, run = _eager_program(model, breaks, *_sample())
    kinds = [type(s).__name__ for s in program.steps]
    assert kinds == ["Segment", "Call"] * 2 + ["Segment"]
    first = program.steps[0]
    assert first.name == "segment 0 (first)" and program.steps[2].name.startswith("segment 1 (after ")
    # the first segment reads the ids and gives what the break and the residual read
    assert first.inputs == [program.inputs[0]] and len(first.outputs) >= 1
    brk = program.steps[1]
    assert isinstance(brk, Call)
    for step in range(4):
        ids, lengths = _sample(step + 1)
        out, want = run(ids, lengths), ref(ids, lengths)
        torch.testing.assert_close(out, want)
        out.square().mean().backward()
        want.square().mean().backward()
        same_grads(model, ref)
    for name, b in model.bn.named_buffers():  # BatchNorm statistics moved at every call, as eager
        torch.testing.assert_close(b, dict(ref.bn.named_buffers())[name])


def test_host_lengths_reach_the_break_from_each_call():
    """A CPU tensor the caller passes goes to the break as it is, each call; a Python int only a
    break reads is taken from each call too, one a segment reads is guarded."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.attn = Attention()

        def forward(self, h, lengths, scale: float, rows: int):
            return self.lin(self.attn(h, lengths)) * scale + rows

    torch.manual_seed(0)
    model = M()
    h = torch.randn(2, 4, 8)
    program, run = _eager_program(model, [Attention], h, torch.tensor([3, 2]), 0.5, 7)
    assert set(program.guarded) == {2, 3}  # scale and rows: read between breaks
    for lengths in ([1, 4], [4, 1], [2, 2]):
        lengths = torch.tensor(lengths)
        torch.testing.assert_close(run(h, lengths, 0.5, 7), model(h, lengths, 0.5, 7))
    with pytest.raises(tr.ReplayInputError, match="args\\[2\\] 'scale' is 0.25, but the model was graphed around its breaks with 0.5"):
        run(h, lengths, 0.25, 7)


def test_a_break_whose_output_changes_shape_raises_naming_it_and_both_shapes():
    class Pick(nn.Module):
        def forward(self, h, lengths):
            return h[: int(lengths.max())]

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pick = Pick()
            self.lin = nn.Linear(8, 8)

        def forward(self, h, lengths):
            return self.lin(self.pick(self.lin(h), lengths))

    model = M()
    h = torch.randn(4, 8)
    _, run = _eager_program(model, [Pick], h, torch.tensor([3]))
    run(h, torch.tensor([3]))
    with pytest.raises(tr.ReplayInputError, match=r"break Pick \(at .*\) returned \(\(2, 8\).*where it returned \(\(3, 8\)"):
        run(h, torch.tensor([2]))


class InPlaceResidual(nn.Module):
    """``h += attn(...)`` after the break, h made before it: written through itself or through
    a view made after the break, the attention given ``h * 1``; or (``"saved"``) the attention
    given ``h`` itself, which its first Linear saves for the backward."""

    def __init__(self, through: str) -> None:
        super().__init__()
        self.lin1 = nn.Linear(8, 8)
        self.attn = Attention()
        self.lin2 = nn.Linear(8, 8)
        self.through = through

    def forward(self, x, lengths):
        h = self.lin1(x)
        if self.through == "saved":
            h += self.attn(h, lengths)
            return self.lin2(h)
        a = self.attn(h * 1, lengths)
        if self.through == "itself":
            h += a
        else:
            h.view(-1, 8)[1:].add_(a.view(-1, 8)[1:])  # (the view made after the break)
        return self.lin2(h), h


@pytest.mark.parametrize("through", ["itself", "a view"])
def test_a_value_written_in_place_after_a_break_is_written_on_a_copy_the_segment_returns(through):
    """``h += attn(h)``: h, made before the break, is a graph input of the segment after it, a
    leaf that autograd lets no in-place op change; the segment writes a copy and returns it.
    The same when the write goes through a view the segment makes of h."""
    torch.manual_seed(0)
    model = InPlaceResidual(through)
    ref = copy.deepcopy(model)
    x = torch.randn(2, 4, 8)
    program, run = _eager_program(model, [Attention], x, torch.tensor([3, 2]))
    after = program.segments[1]
    (h,) = after.copied
    assert h in after.inputs and h in after.outputs
    leaves = [program.samples[i] for i in after.inputs]
    out = after.function()(*leaves)  # as the graph's warm-up calls it: leaves that want grad
    sum(o.sum() for o in out if o.requires_grad).backward()
    assert all(t.grad is not None for t in leaves if t.requires_grad)
    model.zero_grad(set_to_none=True)  # (that backward reached lin2's parameters)
    lengths = torch.tensor([1, 4])
    (y, hy), (want, hwant) = run(x, lengths), ref(x, lengths)
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(hy, hwant)
    (y.sum() + hy.sum()).backward()
    (want.sum() + hwant.sum()).backward()
    same_grads(model, ref, nonzero=True)


def test_a_value_a_break_saved_and_written_in_place_after_it_is_refused_as_eager_backward_fails():
    """``h += attn(h)`` where the attention saves ``h`` for its backward (its first Linear):
    eagerly the backward raises; the segment after the break would write a copy and not."""
    x, lengths = torch.randn(2, 4, 8), torch.tensor([3, 2])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        InPlaceResidual("saved")(x, lengths).sum().backward()
    with pytest.raises(CaptureError, match=r"break Attention \(at .*\) saves a tensor of shape \(2, 4, 8\) .*segment 1 .* writes in place"):
        record(InPlaceResidual("saved"), (x, lengths), {}, [Attention], CPU)


def test_the_record_leaves_no_autograd_graph_alive():
    """What a break saves for its backward is seen through saved-tensor hooks at record time.
    A pack hook that keeps the live tensor keeps the graph of the record's eager run alive
    for good when the tensor is the output of the node saving it (``sigmoid`` saves its
    result): no backward ever frees it, no collector can. Its parameters' AccumulateGrad nodes,
    made on the record's stream, then break the capture of the backward on the GPU."""
    import gc
    import weakref

    made: list[weakref.ref] = []

    def gate(h: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        out = torch.sigmoid(h)  # (saves out itself)
        made.append(weakref.ref(out))
        return out * lengths.view(-1, 1, 1)

    class Gated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin1, self.lin2 = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x, lengths):
            return self.lin2(gate(self.lin1(x), lengths))

    record(Gated(), (torch.randn(2, 4, 8), torch.tensor([3, 2])), {}, [gate], CPU)
    gc.collect()
    assert made and made[0]() is None


def test_a_value_written_in_place_after_a_break_through_which_another_is_read_is_refused():
    """``h`` and its view ``v`` made before the break, ``v`` written after it and ``h`` read: the
    copy the segment writes would not carry the write to ``h``."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin1 = nn.Linear(8, 8)
            self.attn = Attention()

        def forward(self, x, lengths):
            h = self.lin1(x)
            v = h[:, :2]
            a = self.attn(x, lengths)
            v.mul_(2)
            return h + a

    with pytest.raises(CaptureError, match="shares its memory with another that is read after it"):
        _eager_program(M(), [Attention], torch.randn(2, 4, 8), torch.tensor([3, 2]))


def test_a_number_a_break_returns_must_stay_the_same():
    class Count(nn.Module):
        def forward(self, h, lengths):
            return h * 2, int(lengths.max())

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.count = Count()
            self.lin = nn.Linear(8, 8)

        def forward(self, h, lengths):
            h, n = self.count(h, lengths)
            return self.lin(h)[:, :n]

    model = M()
    h = torch.randn(2, 4, 8)
    _, run = _eager_program(model, [Count], h, torch.tensor([3, 2]))
    torch.testing.assert_close(run(h, torch.tensor([1, 3])), model(h, torch.tensor([1, 3])))
    with pytest.raises(tr.ReplayInputError, match=r"break Count \(at .*\) returned 2 where it returned 3"):
        run(h, torch.tensor([2, 1]))


def test_record_refuses_what_a_graph_would_freeze_naming_the_line():
    class HostRead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = Attention()

        def forward(self, h, lengths):
            h = self.attn(h, lengths)
            return h * h.abs().max().item()  # a host read between breaks

    with pytest.raises(CaptureError, match=r"_local_scalar_dense.*test_breaks_training.py:\d+.*breaks='auto'"):
        record(HostRead(), (torch.randn(2, 4, 8), torch.tensor([3, 2])), {}, [Attention], CPU)

    class Keeps(nn.Module):
        """A break that keeps a tensor for the model's code to read."""

        def forward(self, h):
            self.kept = h * 2
            return h + 1

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.keeps = Keeps()

        def forward(self, h):
            return self.keeps(h) + self.keeps.kept

    with pytest.raises(CaptureError, match="a break made and did not return"):
        record(M(), (torch.randn(3),), {}, [Keeps], CPU)


def test_a_branch_on_a_tensors_truth_value_is_taken_as_it_went_and_listed():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = Attention()
            self.lin = nn.Linear(8, 8)

        def forward(self, h, lengths):
            h = self.attn(h, lengths)
            if (h > -1e9).all():  # HF's packed-sequence check is of this kind
                h = self.lin(h)
            return h

    torch.manual_seed(0)
    model = M()
    program, run = _eager_program(model, [Attention], torch.randn(2, 4, 8), torch.tensor([3, 2]))
    assert len(program.branches) == 1 and "test_breaks_training.py:" in program.branches[0]
    # the condition's ops are left out: nothing reads their result
    funcs = {str(op.func) for s in program.segments for op in s.ops}
    assert "aten.all.default" not in funcs and "aten.gt.Scalar" not in funcs, funcs
    assert "aten.addmm.default" in funcs or "aten.mm.default" in funcs, funcs
    h, lengths = torch.randn(2, 4, 8), torch.tensor([1, 4])
    torch.testing.assert_close(run(h, lengths), model(h, lengths))


class Straight(torch.autograd.Function):
    """A straight-through round: its backward is not its forward's ops'."""

    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_a_replaced_weight_raises_and_a_weight_loaded_in_place_is_read():
    torch.manual_seed(0)
    model = Model()
    _, run = _eager_program(model, [Attention], *_sample())
    ids, lengths = _sample(1)
    with torch.no_grad():
        model.head.weight.mul_(2)  # in place: the program reads it
        model.layers[0].attn.q.weight.mul_(2)
    torch.testing.assert_close(run(ids, lengths), model(ids, lengths))
    model.layers[0].attn.q = nn.Linear(8, 8)  # inside a break: its own business
    torch.testing.assert_close(run(ids, lengths), model(ids, lengths))
    model.head.weight = nn.Parameter(model.head.weight.detach().clone())
    with pytest.raises(tr.ReplayInputError, match="head.weight"):
        run(ids, lengths)


class Counted(Attention):
    def forward(self, h, lengths):
        self.calls = getattr(self, "calls", 0) + 1  # a break's own Python: runs at every call
        return super().forward(h, lengths)


def test_python_state_the_code_between_breaks_changes_is_refused_and_a_breaks_is_its_own():
    class Steps(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = Counted()
            self.steps = 0

        def forward(self, h, lengths):
            self.steps += 1  # between breaks: it would run once, at record time
            return self.attn(h, lengths)

    sample = (torch.randn(2, 4, 8), torch.tensor([3, 2]))
    model = Steps()
    with pytest.raises(CaptureError, match="changes Python state.*steps"):
        _eager_program(model, [Counted], *sample)

    class Fine(Steps):
        def forward(self, h, lengths):
            return self.attn(h, lengths) * 2

    model = Fine()
    _, run = _eager_program(model, [Counted], *sample)
    before = model.attn.calls
    run(*sample)
    run(*sample)
    assert model.attn.calls == before + 2


def test_a_tensor_in_python_state_read_between_breaks_and_replaced_raises():
    class Table(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = Attention()
            self.scale = torch.full((8,), 0.5)  # a plain attribute: neither parameter nor buffer

        def forward(self, h, lengths):
            return self.attn(h, lengths) * self.scale

    model = Table()
    sample = (torch.randn(2, 4, 8), torch.tensor([3, 2]))
    _, run = _eager_program(model, [Attention], *sample)
    model.scale.mul_(2)  # in place: read where it is
    torch.testing.assert_close(run(*sample), model(*sample))
    model.scale = torch.full((8,), 3.0)
    with pytest.raises(tr.ReplayInputError, match="scale"):
        run(*sample)


def test_a_break_never_reached_is_an_error_and_the_model_is_left_as_it_was():
    model = Model()
    with pytest.raises(CaptureError, match="OpAttention never ran"):
        record(model, _sample(), {}, [OpAttention], CPU)
    for m in model.modules():
        assert "forward" not in m.__dict__


def test_options_with_breaks():
    with pytest.raises(TypeError, match="pass the model"):
        tr.make_graphed_callables(host_mask, (torch.randn(2, 4, 8),), breaks=[host_mask])
    with pytest.raises(TypeError, match="sample_args must be a tuple"):
        tr.make_graphed_callables(Model(), torch.randn(2), breaks=[Attention])
    assert "breaks:" in (tr.make_graphed_callables.__doc__ or "")


@pytest.mark.parametrize("where", ["module", "kernel op"])
def test_hf_llama_program_trains_like_the_model(where):
    """HF Llama's training forward (loss included), recorded with its attention module or only
    SDPA's CPU kernel op as the break: loss and every gradient equal the model's over fresh
    batches; its packed-sequence check is the one branch taken as recorded."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

    model = _tiny_llama(transformers)
    breaks = [modeling_llama.LlamaAttention] if where == "module" else ["aten._scaled_dot_product_flash_attention_for_cpu"]
    program = _program_trains_like(model, breaks, _tokens(128))
    assert [type(s).__name__ for s in program.steps] == ["Segment", "Call"] * 2 + ["Segment"]
    assert len(program.branches) == 1 and "masking_utils.py" in program.branches[0]


def _tiny_llama(transformers):
    """A 2-layer HF Llama (hidden 64, vocab 128), seeded, in training mode."""
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).train()


def _program_trains_like(model, breaks, batch, steps=3):
    """Record ``model``'s program on ``batch(0)`` and run it against a copy on ``batch(1)``,
    ``batch(2)``, ... from the same seeds (dropout draws the same masks): loss and every
    gradient equal. ``batch(i)`` gives ``(args, kwargs)``, fresh random tokens."""
    ref = copy.deepcopy(model)
    args, kwargs = batch(0)
    snapshot = StateSnapshot(model, CPU, large="copy")
    program, reads, _ = record_checked(model, CallArgs(model, args, kwargs), breaks, CPU)
    snapshot.restore()
    run = BreakTraining(model, program, [s.function() for s in program.segments], model.forward, CPU, reads)
    for step in range(1, steps + 1):
        args, kwargs = batch(step)
        torch.manual_seed(step)
        loss = run(*args, **kwargs).loss
        torch.manual_seed(step)
        want = ref(*args, **kwargs).loss
        torch.testing.assert_close(loss, want)
        loss.backward()
        want.backward()
        same_grads(model, ref)
    return program


def _tokens(vocab, mask=False):
    def batch(i):
        ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(i))
        kwargs = {"labels": ids}
        if mask:
            m = torch.ones(2, 16, dtype=torch.long)
            m[1, 8 + i:] = 0  # another padding at each call
            kwargs["attention_mask"] = m
        return (ids,), kwargs
    return batch


def test_hf_gpt2_with_dropout_and_bert_with_a_padding_mask_train_like_the_model():
    transformers = pytest.importorskip("transformers")
    from transformers.models.bert import modeling_bert
    from transformers.models.gpt2 import modeling_gpt2

    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32, use_cache=False,
        bos_token_id=0, eos_token_id=0,
    )).train()
    _program_trains_like(gpt2, [modeling_gpt2.GPT2Attention], _tokens(100))
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=100,
    )).train()
    _program_trains_like(bert, [modeling_bert.BertSelfAttention], _tokens(100, mask=True))


def test_an_object_the_model_makes_at_each_call_and_hands_a_break_is_refused():
    """HF GPT-2 with its cache on makes a DynamicCache in each forward, which the attention
    fills: as a constant, every call would get the recorded call's, keys and all."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2 import modeling_gpt2

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32, use_cache=True,
        bos_token_id=0, eos_token_id=0,
    )).train()
    ids = torch.randint(0, 100, (2, 16))
    with pytest.raises(CaptureError, match=r"break GPT2Attention gets a DynamicCache the model makes anew at each call.*use_cache=False"):
        record_checked(gpt2, CallArgs(gpt2, (ids,), {"labels": ids}), [modeling_gpt2.GPT2Attention], CPU)


class _Basic(nn.Module):
    """torchvision's BasicBlock: BatchNorm, ReLU(inplace=True), ``out += identity``."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class _HostPool(nn.Module):
    """Pools over the first ``k`` rows, ``k`` read on the host at each call."""

    def forward(self, x, k):
        return x[:, :, : int(k)].mean(dim=2, keepdim=True).expand_as(x).contiguous() + x


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.b1 = _Basic(8)
        self.pool = _HostPool()
        self.b2 = _Basic(8)
        self.head = nn.Linear(8, 5)

    def forward(self, x, k):
        h = self.b2(self.pool(self.b1(self.stem(x)), k))
        return self.head(h.mean(dim=(2, 3)))


def test_a_resnet_style_net_with_batchnorm_and_in_place_adds_trains_like_the_model():
    torch.manual_seed(0)
    model = _Net().train()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 8, 8, generator=g)
    _, run = _eager_program(model, [_HostPool], x, torch.tensor(3))
    for step in range(4):
        x = torch.randn(4, 3, 8, 8, generator=g)
        k = torch.tensor(step + 2)
        out, want = run(x, k), ref(x, k)
        torch.testing.assert_close(out, want)
        out.square().mean().backward()
        want.square().mean().backward()
        same_grads(model, ref)
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):  # statistics, step counts
        torch.testing.assert_close(b, c, msg=name)


def _labels(n: int):
    """batch(i): 2 x 16 random tokens and a class label per row (a sequence classifier)."""
    def batch(i):
        g = torch.Generator().manual_seed(i)
        return (torch.randint(0, 100, (2, 16), generator=g),), {"labels": torch.randint(0, n, (2,), generator=g)}
    return batch


def _hf_models(transformers):
    """name -> (model, breaks, batch(i) -> (args, kwargs)): decoders (one with mixture-of-experts
    routing, one with a ``torch.autograd.Function`` between breaks), an encoder-decoder, a vision transformer, each with its attention as the break."""
    from transformers.models.albert import modeling_albert
    from transformers.models.bloom import modeling_bloom
    from transformers.models.falcon import modeling_falcon
    from transformers.models.gemma import modeling_gemma
    from transformers.models.mixtral import modeling_mixtral
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.t5 import modeling_t5
    from transformers.models.vit import modeling_vit

    lm = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)

    def seq2seq(i):
        g = torch.Generator().manual_seed(i)
        return (torch.randint(0, 100, (2, 12), generator=g),), {"labels": torch.randint(0, 100, (2, 8), generator=g)}

    def images(i):
        g = torch.Generator().manual_seed(i)
        return (torch.randn(2, 3, 32, 32, generator=g),), {"labels": torch.randint(0, 5, (2,), generator=g)}

    return {
        "qwen2": lambda: (transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**lm)),
                          [modeling_qwen2.Qwen2Attention], _tokens(100)),
        "gemma": lambda: (transformers.GemmaForCausalLM(transformers.GemmaConfig(**lm, head_dim=16)),
                          [modeling_gemma.GemmaAttention], _tokens(100)),
        "t5": lambda: (transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=100, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, use_cache=False,
            decoder_start_token_id=0)), [modeling_t5.T5Attention], seq2seq),
        "mixtral": lambda: (transformers.MixtralForCausalLM(transformers.MixtralConfig(  # MoE routing
            **lm, num_local_experts=4, num_experts_per_tok=2)), [modeling_mixtral.MixtralAttention], _tokens(100)),
        "falcon": lambda: (transformers.FalconForCausalLM(transformers.FalconConfig(
            vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, use_cache=False)),
            [modeling_falcon.FalconAttention], _tokens(100)),
        "bloom": lambda: (transformers.BloomForCausalLM(transformers.BloomConfig(  # GeLUFunction in training
            vocab_size=100, hidden_size=64, n_layer=2, n_head=4, use_cache=False)),
            [modeling_bloom.BloomAttention], _tokens(100)),
        "albert": lambda: (transformers.AlbertForSequenceClassification(transformers.AlbertConfig(  # one
            # layer's modules called at every depth
            vocab_size=100, hidden_size=64, embedding_size=32, num_hidden_layers=3, num_attention_heads=4,
            intermediate_size=128, num_labels=3, max_position_embeddings=64)), [modeling_albert.AlbertAttention],
            _labels(3)),
        "vit": lambda: (transformers.ViTForImageClassification(transformers.ViTConfig(
            image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=128, num_labels=5)), [modeling_vit.ViTAttention], images),
    }


@pytest.mark.parametrize("name", ["qwen2", "gemma", "t5", "vit", "mixtral", "falcon", "bloom", "albert"])
def test_more_hf_architectures_train_like_the_model(name):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, breaks, batch = _hf_models(transformers)[name]()
    program = _program_trains_like(model.train(), breaks, batch)
    assert len(program.segments) >= 3


def test_a_state_tensor_advanced_in_place_between_breaks_counts_the_calls_not_the_build():
    """A position counter kept as a plain tensor attribute, advanced in place between breaks:
    each call advances it once, as eagerly; the build's own runs (the first eager call, the
    record, the graphs' warm-ups) leave it where it was."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = Attention()
            self.lin = nn.Linear(8, 8)
            self.position = [torch.zeros((), dtype=torch.long)]  # Python state, not a buffer

        def forward(self, h, lengths):
            self.position[0].add_(1)
            return self.lin(self.attn(h, lengths)) * self.position[0]

    model = M()
    ref = copy.deepcopy(model)
    sample = (torch.randn(2, 4, 8), torch.tensor([3, 2]))
    _, run = _eager_program(model, [Attention], *sample)
    assert int(model.position[0]) == 0
    for _ in range(3):
        torch.testing.assert_close(run(*sample), ref(*sample))
    assert int(model.position[0]) == int(ref.position[0]) == 3


def test_hooks_added_after_the_build_run_the_model_eagerly_until_removed(caplog):
    """A forward hook added to a module between breaks would run at no call: while the hooks
    differ from the build's, calls run the model eagerly (counted, one warning). One inside a
    break runs with the break, so calls keep replaying."""
    torch.manual_seed(0)
    model = Model()
    _, run = _eager_program(model, [Attention], *_sample())
    seen = []

    def double(module, args, out):
        seen.append(out.shape)
        return out * 2

    ids, lengths = _sample(1)
    handle = model.layers[0].mlp.register_forward_hook(double)
    with caplog.at_level("WARNING", logger="torchreplay"):
        out = run(ids, lengths)
    assert len(seen) == 1 and run.stats.fallbacks == 1 and run.stats.replays == 0
    assert "hooks of 'Model' changed since capture (on Sequential)" in caplog.text
    torch.testing.assert_close(out, model(ids, lengths))  # the hook doubled both
    handle.remove()
    inner = model.layers[0].attn.q.register_forward_hook(double)  # inside the break
    out = run(ids, lengths)
    assert run.stats.fallbacks == 1 and run.stats.replays == 1 and len(seen) == 3  # ran in the break
    torch.testing.assert_close(out, model(ids, lengths))
    inner.remove()
    torch.testing.assert_close(run(ids, lengths), model(ids, lengths))
    assert run.stats.replays == 2


def test_a_parameter_frozen_at_the_build_and_unfrozen_since_runs_the_model_eagerly(caplog):
    """A segment's backward graph was captured without a gradient for a frozen parameter: once
    unfrozen, calls run the model eagerly (one warning naming it) and it gets eager's gradient.
    One inside a module break is the break's business: calls keep replaying."""
    torch.manual_seed(0)
    model = Model()
    model.layers[0].mlp[0].weight.requires_grad_(False)
    model.layers[1].attn.q.weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    _, run = _eager_program(model, [Attention], *_sample())
    ids, lengths = _sample(1)
    model.layers[1].attn.q.weight.requires_grad_(True)  # inside the break
    ref.layers[1].attn.q.weight.requires_grad_(True)
    run(ids, lengths).sum().backward()
    ref(ids, lengths).sum().backward()
    assert run.stats.replays == 1 and run.stats.fallbacks == 0
    same_grads(model, ref)
    model.layers[0].mlp[0].weight.requires_grad_(True)
    ref.layers[0].mlp[0].weight.requires_grad_(True)
    with caplog.at_level("WARNING", logger="torchreplay"):
        run(ids, lengths).sum().backward()
    assert run.stats.fallbacks == 1 and "layers.0.mlp.0.weight (False -> True)" in caplog.text
    ref(ids, lengths).sum().backward()
    assert model.layers[0].mlp[0].weight.grad is not None
    same_grads(model, ref)


class Hooked(nn.Module):
    """Registers a gradient hook on a value it makes: ``where`` says between breaks or inside
    the break."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.attn = HookedAttention() if where == "break" else Attention()
        self.lin = nn.Linear(8, 8)

    def forward(self, h, lengths):
        h = self.lin(h)
        if self.where == "between" and h.requires_grad:
            h.register_hook(lambda g: g * 3)
        return self.attn(h, lengths).sum(-1)


class HookedAttention(Attention):
    def forward(self, h, lengths):
        out = super().forward(h, lengths)
        if out.requires_grad:
            out.register_hook(lambda g: g * 3)  # the break's own: it runs at every call
        return out


def test_backward_hooks_and_hooks_registered_between_breaks_are_refused(caplog):
    """A segment's backward is graphed from the recorded ops: a module's backward hook, or a
    gradient hook the code between breaks registers, would never run. Refused at the build,
    naming it; the same inside a break is the break's own (it runs eagerly). A forward hook with
    Python side effects at the build is said once."""
    sample = _sample()
    model = Model()
    handle = model.layers[1].mlp.register_full_backward_hook(lambda m, gi, go: None)
    with pytest.raises(CaptureError, match=r"backward hooks \(on Sequential\).*inside a break"):
        record_checked(model, CallArgs(model, sample, {}), [Attention], CPU)
    handle.remove()
    model.layers[1].attn.q.register_full_backward_hook(lambda m, gi, go: None)  # inside the break
    features = []
    model.head.register_forward_hook(lambda m, a, out: features.append(out))
    with caplog.at_level("WARNING", logger="torchreplay"):
        _eager_program(model, [Attention], *sample)
    assert "'Model' has forward hooks (on Linear)" in caplog.text

    h = torch.randn(2, 4, 8)
    lengths = torch.tensor([3, 2])
    with pytest.raises(CaptureError, match=r"a hook was registered while the code between breaks ran .* \(at .*test_breaks_training.py:\d+\)"):
        record_checked(Hooked("between"), CallArgs(None, (h, lengths), {}), [Attention], CPU)
    torch.manual_seed(0)
    model = Hooked("break")
    ref = copy.deepcopy(model)
    _, run = _eager_program(model, [HookedAttention], h, lengths)
    for _ in range(2):
        x = torch.randn(2, 4, 8, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_(True)
        run(x, lengths).sum().backward()
        ref(x_ref, lengths).sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad)  # the break's hook tripled both
        torch.testing.assert_close(model.lin.weight.grad, ref.lin.weight.grad)


def test_hf_activation_checkpointing_reentrant_is_refused_by_name_and_non_reentrant_trains_with_a_warning(caplog):
    """HF's gradient_checkpointing_enable(): with use_reentrant=True the checkpoint is a
    torch.autograd.Function, refused naming it and the fix; without, the program trains like the
    model (gradients equal) and a warning says the memory it would save is not saved."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

    model = _tiny_llama(transformers)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    args, kwargs = _tokens(128)(0)
    with pytest.raises(CaptureError, match="torch.autograd.Function CheckpointFunction.*use_reentrant=False"):
        record_checked(model, CallArgs(model, args, kwargs), [modeling_llama.LlamaAttention], CPU)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with caplog.at_level("WARNING", logger="torchreplay"):
        program = _program_trains_like(model, [modeling_llama.LlamaAttention], _tokens(128))
    assert program.saved_hooks is not None and "modeling_llama.py" in program.saved_hooks[1]
    assert "saved-tensor hooks were active between breaks" in caplog.text


def test_a_view_of_a_weight_made_under_no_grad_is_not_taken_for_an_autograd_function():
    """``w.t()`` under no_grad requires grad with no history; eager's autograd ends there, and so
    does the program's: gradients equal, nothing refused."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.attn = Attention()

        def forward(self, h, lengths):
            with torch.no_grad():
                frozen = self.lin.weight.t()
            return self.attn(self.lin(h) @ frozen, lengths)

    torch.manual_seed(0)
    model = M()
    ref = copy.deepcopy(model)
    h = torch.randn(2, 4, 8)
    _, run = _eager_program(model, [Attention], h, torch.tensor([3, 2]))
    for lengths in ([1, 4], [4, 2]):
        lengths = torch.tensor(lengths)
        run(h, lengths).sum().backward()
        ref(h, lengths).sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)


def test_a_call_under_a_dispatch_mode_runs_the_model_so_the_mode_sees_every_op(caplog):
    """Under a TorchDispatchMode (one that adds no hooks, then FlopCounterMode, which adds
    global module hooks) the call runs the model, counted and not warned about; outside the
    mode the program runs again."""
    from torch.utils.flop_counter import FlopCounterMode

    from test_training import OpCount

    torch.manual_seed(0)
    model = Model()
    _, run = _eager_program(model, [Attention], *_sample())
    ids, lengths = _sample(1)
    with OpCount() as count:
        run(ids, lengths).sum().backward()
    assert count.ops > 0 and run.stats.fallbacks == 1 and run.stats.replays == 0
    with FlopCounterMode(display=False) as eager:
        model(ids, lengths).sum().backward()
    with caplog.at_level("WARNING", logger="torchreplay"), FlopCounterMode(display=False) as ours:
        run(ids, lengths).sum().backward()
    assert ours.get_total_flops() == eager.get_total_flops() > 0
    assert run.stats.fallbacks == 2 and "torchreplay" not in caplog.text
    torch.testing.assert_close(run(ids, lengths), model(ids, lengths))
    assert run.stats.replays == 1
    model.eval()
    run(ids, lengths)
    for segment in run.segments:  # (plain functions here, not graphed callables with counters)
        segment.stats = tr.stats.TrainingStats()
    assert "calls=1 fallbacks=3 (a TorchDispatchMode: 2, train/eval mode: 1)" in run.explain()
