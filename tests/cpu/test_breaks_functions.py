"""Training with breaks around ``torch.autograd.Function``s called between the breaks
(``torchreplay/breaks/functions.py``), on the CPU: each call is recorded as one call of the
Function, so a segment runs its own forward and backward again. The Functions here have a
backward that is not their forward's ops' derivative, so a program that replayed the forward's
ops would give other gradients than the model's; a custom op's ``register_autograd``; what is
refused, naming the line."""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch
import torch.nn as nn

from torchreplay.breaks.functions import function_calls
from torchreplay.breaks.program import record
from torchreplay.errors import CaptureError

from test_breaks_training import CPU, Attention, Straight, _eager_program, _sample, same_grads


class ScaledGrad(torch.autograd.Function):
    """``x * k`` forward, a gradient scaled by ``3 * k`` backward; with a ``setup_context``
    (its forward gets no ctx); returns two tensors, the second not differentiable, and calls
    another Function inside (only the outer call is recorded)."""

    @staticmethod
    def forward(x, k):
        return Straight.apply(x * k), (x > 0).to(x.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.k = inputs[1]
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, grad, _):
        return grad * 3 * ctx.k, None


class Noisy(torch.autograd.Function):
    """Dropout-like: draws random numbers in its forward, saves the mask for its backward,
    which doubles the gradient."""

    @staticmethod
    def forward(ctx, x):
        mask = (torch.rand_like(x) > 0.3).to(x.dtype)
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return 2 * grad * mask


@torch.library.custom_op("trbreaksfn::ste", mutates_args=())
def ste(x: torch.Tensor) -> torch.Tensor:
    return x.round()


@ste.register_fake
def _(x):
    return torch.empty_like(x)


ste.register_autograd(lambda ctx, grad: grad * 5)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.lin = nn.Linear(8, 8)
        self.attn = Attention()
        self.out = nn.Linear(8, 8)

    def forward(self, ids, lengths):
        h = self.lin(self.embed(ids))
        h, positive = ScaledGrad.apply(h, 0.5)
        h = Noisy.apply(torch.ops.trbreaksfn.ste(h) + h)
        h = self.attn(h, lengths) * positive
        with torch.no_grad():
            g = Straight.apply(h)  # (under no_grad: no gradient through it, as eagerly)
        return self.out(Straight.apply(h) + h + g)


def test_functions_between_breaks_train_like_the_model_with_their_own_backward():
    torch.manual_seed(0)
    model = Model()
    ref = copy.deepcopy(model)
    program, run = _eager_program(model, [Attention], *_sample())
    ops = [op.func for s in program.segments for op in s.ops]
    applied = [getattr(f, "__self__", None) for f in ops]
    assert applied.count(ScaledGrad) == 1 and applied.count(Noisy) == 1 and applied.count(Straight) == 2
    assert torch.ops.trbreaksfn.ste.default in ops  # the custom op itself, not its Function
    listed = [function_calls(s.ops) for s in program.segments]  # (what explain() says)
    assert listed == ["; Functions: ScaledGrad, Noisy", "; Functions: Straight x2"], listed
    for step in range(4):
        ids, lengths = _sample(step + 1)
        torch.manual_seed(100 + step)
        out = run(ids, lengths)
        torch.manual_seed(100 + step)
        want = ref(ids, lengths)
        torch.testing.assert_close(out, want)
        out.square().mean().backward()
        want.square().mean().backward()
        same_grads(model, ref, nonzero=True)


def _model(forward):
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = Attention()
            self.lin = nn.Linear(8, 8)

    M.forward = forward
    return M()


def _args():
    return (torch.randn(2, 4, 8), torch.tensor([3, 2])), {}


def test_a_function_that_returns_its_argument_as_it_is_is_refused_naming_it():
    class Same(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad

    model = _model(lambda self, h, lengths: Same.apply(self.lin(self.attn(h, lengths))))
    with pytest.raises(CaptureError, match=r"Function .*Same returns one of its arguments.*test_breaks_functions.py:\d+"):
        record(model, *_args(), [Attention], CPU)


def test_a_function_defined_while_the_model_runs_is_refused_as_before():
    def forward(self, h, lengths):
        class Late(torch.autograd.Function):
            forward = staticmethod(lambda ctx, x: x.round())
            backward = staticmethod(lambda ctx, grad: grad)

        return Late.apply(self.lin(self.attn(h, lengths)))

    with pytest.raises(CaptureError, match=r"autograd off but its result requires grad: a torch.autograd.Function Late"):
        record(_model(forward), *_args(), [Attention], CPU)


def test_a_triton_launch_between_breaks_is_refused_and_inside_a_break_runs(monkeypatch):
    """Triton's launch is seen by its Python code (here a stand-in module under Triton's name:
    a real kernel is in the GPU tests)."""
    class JITFunction:
        __name__ = "double_kernel"

        def run(self, x, out):
            out.copy_(x * 2)

    monkeypatch.setitem(sys.modules, "triton.runtime.jit", types.SimpleNamespace(JITFunction=JITFunction))
    kernel = JITFunction()

    def launch(x):
        out = torch.empty_like(x)
        kernel.run(x, out)
        return out

    model = _model(lambda self, h, lengths: self.lin(launch(self.attn(h, lengths))))
    with pytest.raises(CaptureError, match=r"Triton kernel double_kernel was launched.*test_breaks_functions.py:\d+.*triton_op"):
        record(model, *_args(), [Attention], CPU)
    program = record(model, *_args(), [Attention, launch], CPU)  # inside a break: its business
    assert [type(s).__name__ for s in program.steps] == ["Call", "Call", "Segment"]


class Scaled(torch.autograd.Function):
    """With a ``setup_context``: ``x * 2`` forward, the gradient doubled."""

    @staticmethod
    def forward(x):
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class Tripled(Scaled):
    """The same forward (inherited), another backward: which class ran is told by its apply."""

    @staticmethod
    def backward(ctx, grad):
        return grad * 3


def test_a_subclass_that_inherits_its_forward_is_recorded_as_itself():
    torch.manual_seed(0)
    model = _model(lambda self, h, lengths: Tripled.apply(self.lin(self.attn(h, lengths))).sum())
    ref = copy.deepcopy(model)
    program, run = _eager_program(model, [Attention], *_args()[0])
    assert [getattr(op.func, "__self__", None) for op in program.segments[0].ops].count(Tripled) == 1
    h, lengths = torch.randn(2, 4, 8), torch.tensor([1, 4])
    run(h, lengths).backward()
    ref(h, lengths).backward()
    same_grads(model, ref, nonzero=True)


def test_a_forward_called_as_a_plain_function_is_plain_ops_and_one_that_raises_is_refused():
    torch.manual_seed(0)
    model = _model(lambda self, h, lengths: Scaled.forward(self.lin(self.attn(h, lengths))).sum())
    ref = copy.deepcopy(model)
    program, run = _eager_program(model, [Attention], *_args()[0])
    assert not any(getattr(op.func, "__self__", None) for op in program.segments[0].ops)
    h, lengths = torch.randn(2, 4, 8), torch.tensor([1, 4])
    run(h, lengths).backward()
    ref(h, lengths).backward()
    same_grads(model, ref, nonzero=True)

    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            raise ValueError("no")

        @staticmethod
        def backward(ctx, grad):
            return grad

    def forward(self, h, lengths):
        h = self.lin(self.attn(h, lengths))
        try:
            return Fails.apply(h)
        except ValueError:
            return h * 2

    with pytest.raises(CaptureError, match=r"Function .*Fails's forward raised"):
        record(_model(forward), *_args(), [Attention], CPU)


def test_a_break_inside_a_functions_forward_is_refused_naming_the_function():
    """HF Reformer's reversible layers: one Function around layers whose attention is the break."""
    attn = Attention()

    class Around(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h, lengths):
            return attn(h, lengths) * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2, None

    model = _model(lambda self, h, lengths: self.lin(Around.apply(self.lin(h), lengths)))
    model.attn = attn
    with pytest.raises(CaptureError, match=r"a break ran inside torch.autograd.Function .*Around's forward.*Name the module that calls"):
        record(model, *_args(), [Attention], CPU)


def _contiguous(fn):
    """Liger's ``ensure_contiguous``: a wrapper of ``(ctx, *args, **kwargs)`` that replaces its
    arguments, shared by every Function it decorates."""
    import functools

    @functools.wraps(fn)
    def wrapper(ctx, *args, **kwargs):
        args = [a.contiguous() if isinstance(a, torch.Tensor) else a for a in args]
        return fn(ctx, *args, **kwargs)

    return wrapper


class Rms(torch.autograd.Function):
    """An RMSNorm whose backward is the true one, through a decorated forward."""

    @staticmethod
    @_contiguous
    def forward(ctx, x, w, eps):
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, w, r)
        return x * r * w

    @staticmethod
    @_contiguous
    def backward(ctx, g):
        x, w, r = ctx.saved_tensors
        xn = x * r
        gw = (g * xn).reshape(-1, x.shape[-1]).sum(0)
        gx = r * (g * w - xn * (g * w * xn).mean(-1, keepdim=True))
        return gx, gw, None


class HalfGrad(torch.autograd.Function):
    """The same decorator on another Function: the shared wrapper code is told apart by ctx."""

    @staticmethod
    @_contiguous
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        return g * 0.5


def test_functions_with_a_shared_decorated_forward_are_each_recorded_as_themselves():
    def forward(self, h, lengths):
        h = Rms.apply(self.lin(h).transpose(0, 1), self.w, 1e-6)  # (a non-contiguous argument)
        return HalfGrad.apply(self.attn(h.transpose(0, 1), lengths)).sum()

    torch.manual_seed(0)
    model = _model(forward)
    model.w = nn.Parameter(torch.rand(8) + 0.5)
    ref = copy.deepcopy(model)
    program, run = _eager_program(model, [Attention], *_args()[0])
    assert [function_calls(s.ops) for s in program.segments] == ["; Functions: Rms", "; Functions: HalfGrad"]
    h, lengths = torch.randn(2, 4, 8), torch.tensor([1, 4])
    run(h, lengths).backward()
    ref(h, lengths).backward()
    same_grads(model, ref, nonzero=True)
