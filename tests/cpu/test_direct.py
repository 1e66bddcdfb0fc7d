"""A custom op called without the dispatcher at replay (``pieces/direct.py``): the same results,
outputs and version counters as through ``torch.ops``; the dispatcher kept wherever it would do
more (autograd, modes, autocast rules, converted arguments); the FX rewrite of an eager step."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode

from torchreplay.compile.split import direct_forward
from torchreplay.pieces.direct import direct_call, device_type_of

_CALLS = {"scale_out": 0}


@torch.library.custom_op("trdirect::scale_out", mutates_args=("out",))
def _scale_out(x: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> None:
    _CALLS["scale_out"] += 1
    out.copy_(x * scale)


@torch.library.custom_op("trdirect::times", mutates_args=())
def _times(x: torch.Tensor, n: int) -> torch.Tensor:
    return x * n


@_times.register_fake
def _(x, n):
    return torch.empty_like(x)


def _times_backward(ctx, g):
    return g * ctx.n, None


def _times_setup(ctx, inputs, output):
    ctx.n = inputs[1]


_times.register_autograd(_times_backward, setup_context=_times_setup)


@torch.library.custom_op("trdirect::cast", mutates_args=())
def _cast(x: torch.Tensor) -> torch.Tensor:
    return x + 1


torch.library.register_autocast("trdirect::cast", "cpu", torch.bfloat16)


@torch.library.custom_op("trdirect::cat_into", mutates_args=("outs",))
def _cat_into(xs: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
    for x, o in zip(xs, outs):
        o.copy_(x)


def test_a_custom_op_called_directly_equals_the_dispatcher_and_bumps_versions_alike() -> None:
    op = torch.ops.trdirect.scale_out.default
    x = torch.randn(5)
    fn = direct_call(op, [x, torch.empty(5), 2.0], {})
    assert fn is not None
    for _ in range(3):
        x = torch.randn(5)
        want, got = torch.empty(5), torch.empty(5)
        v_want, v_got = want._version, got._version
        op(x, want, 2.0)
        fn(x, got, 2.0)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert got._version - v_got == want._version - v_want > 0


def test_lists_of_written_tensors_are_bumped_each() -> None:
    op = torch.ops.trdirect.cat_into.default
    xs = [torch.randn(2), torch.randn(3)]
    outs = [torch.empty(2), torch.empty(3)]
    fn = direct_call(op, [xs, outs], {})
    assert fn is not None
    before = [o._version for o in outs]
    fn(xs, outs)
    assert all(o._version > b for o, b in zip(outs, before))
    assert all(torch.equal(o, x) for o, x in zip(outs, xs))


def test_the_dispatcher_is_kept_where_it_would_do_more() -> None:
    x = torch.randn(4)
    # an int for a float argument: the dispatcher converts it, a direct call would not
    assert direct_call(torch.ops.trdirect.scale_out.default, [x, torch.empty(4), 2], {}) is None
    # a tuple for a list argument
    assert direct_call(torch.ops.trdirect.cat_into.default, [(x,), [x]], {}) is None
    # an autocast rule casts the inputs
    assert direct_call(torch.ops.trdirect.cast.default, [x], {}) is None
    # not a custom op: an aten op, a function
    assert direct_call(torch.ops.aten.add.Tensor, [x, x], {}) is None
    assert direct_call(torch.add, [x, x], {}) is None
    # no tensor, or tensors on two device types: the dispatcher chooses the kernel
    assert device_type_of([1, "a"]) is None
    assert device_type_of([x, [torch.randn(1, device="meta")]]) is None


def test_autograd_and_modes_go_through_the_dispatcher() -> None:
    op = torch.ops.trdirect.times.default
    fn = direct_call(op, [torch.randn(3), 2], {})
    assert fn is not None
    x = torch.randn(3, requires_grad=True)
    y = fn(x, 2)  # grad needed: autograd records the op as eagerly
    assert y.grad_fn is not None
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    with torch.no_grad():
        assert fn(x, 2).grad_fn is None

    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Spy():
        fn(torch.randn(3), 2)
    assert "trdirect.times.default" in seen, seen


def test_an_eager_step_calls_its_custom_ops_directly_after_the_fx_rewrite() -> None:
    def step(x, out):
        torch.ops.trdirect.scale_out.default(x.relu(), out, 3.0)
        return (torch.ops.trdirect.times(out, 2) + 1,)  # the packet, as user code calls it

    gm = fx.symbolic_trace(step)
    x0, out0 = torch.randn(6), torch.empty(6)
    for n in gm.graph.nodes:  # traced values, as Dynamo leaves them
        if n.op == "placeholder":
            n.meta["val"] = x0 if n.name == "x" else out0
        elif n.target is torch.relu or n.name.startswith("relu"):
            n.meta["val"] = x0
        elif n.op == "call_function" and "times" in str(n.target):
            n.meta["val"] = out0
    fast = direct_forward(gm)
    assert fast is not None
    targets = [getattr(n.target, "__name__", "") for n in fast.__self__.graph.nodes if n.op == "call_function"]
    assert targets.count("direct_trdirect_scale_out") == 1 and targets.count("direct_trdirect_times") == 1
    calls = _CALLS["scale_out"]
    for _ in range(3):
        x = torch.randn(6)
        out_a, out_b = torch.empty(6), torch.empty(6)
        with torch.no_grad():
            want = gm(x, out_a)
            got = fast(x, out_b)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(out_b, out_a, rtol=0, atol=0)
    assert _CALLS["scale_out"] == calls + 6
    # the module's own forward (capture, warm-up) still calls through torch.ops
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function" and "trdirect" in str(n.target)]
    assert len(ops) == 2 and all(isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) for t in ops)
    # nothing to rewrite: None
    plain = fx.symbolic_trace(lambda x: (x.relu(),))
    assert direct_forward(plain) is None


@torch.library.custom_op("trdirect::which", mutates_args=())
def _which(x: torch.Tensor) -> torch.Tensor:
    return x + 1  # the function the op was defined with


@_which.register_kernel("cpu")
def _(x):
    return x + 2  # the CPU kernel, until it is disabled


def test_the_kernel_is_called_under_torchs_dynamo_wrapper_and_keeps_its_enabled_switch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With no Dynamo hook on, a replay calls what torch's ``_disable_dynamo`` wraps; that is
    still torch's switch between the device kernel and the op's own function. With a hook on
    (a replay inside someone's ``torch.compile``d frame), the wrapper is called."""
    from torchreplay import _compat
    from torchreplay.pieces import direct

    kernel = _compat.custom_op_kernel(torch.ops.trdirect.which.default, "cpu")
    assert kernel is not None and _compat.without_dynamo_guard(kernel) is kernel.__wrapped__
    assert _compat.without_dynamo_guard(_which._init_fn) is None  # not torch's wrapper
    assert _compat.eval_frame_callback() is None  # no torch.compile here
    x = torch.randn(4)
    hooks = {"off": lambda: None, "on": lambda: object()}
    for hook in hooks.values():
        monkeypatch.setattr(direct, "_dynamo_hook", hook)
        fn = direct_call(torch.ops.trdirect.which.default, [x], {})
        assert fn is not None
        torch.testing.assert_close(fn(x), x + 2, rtol=0, atol=0)
        with _which.set_kernel_enabled("cpu", False):
            torch.testing.assert_close(fn(x), x + 1, rtol=0, atol=0)
            torch.testing.assert_close(torch.ops.trdirect.which(x), x + 1, rtol=0, atol=0)
        torch.testing.assert_close(fn(x), x + 2, rtol=0, atol=0)
