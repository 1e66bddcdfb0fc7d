"""Input writes on CPU tensors: which static buffers an op writes (WriteWatch), the copy-back into
the caller's tensors, the aliasing refusal, and which casts count as lossless widenings."""

from __future__ import annotations

import logging

import pytest
import torch

from torchreplay.core.args import CallArgs
from torchreplay.core.io import Inputs, widens
from torchreplay.core.writes import WriteWatch
from torchreplay.errors import CaptureError, ReplayInputError

CPU = torch.device("cpu")


def _watch(fn, *buffers):
    w = WriteWatch(list(buffers))
    with w:
        fn(*buffers)
    return w.written


def test_in_place_out_and_view_writes_are_seen() -> None:
    a, b, c = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    assert _watch(lambda a, b, c: a.add_(1), a, b, c) == [0]
    assert _watch(lambda a, b, c: torch.add(a, 1, out=c), a, b, c) == [2]
    assert _watch(lambda a, b, c: b[1:3].mul_(2), a, b, c) == [1]  # through a view
    assert _watch(lambda a, b, c: b.view(2, 2)[0].zero_(), a, b, c) == [1]
    assert _watch(lambda a, b, c: a + b * c, a, b, c) == []  # reads only
    assert _watch(lambda a, b, c: torch._foreach_add_([c, a], 1.0), a, b, c) == [2, 0]  # first-write order


def test_batch_norm_running_statistics_passed_as_arguments_are_seen_in_training() -> None:
    """The batch-norm kernels eager reaches (native on the CPU, cuDNN's on CUDA) update the
    running statistics without their schemas marking them written; found all the same."""
    x, rm, rv = torch.randn(3, 4), torch.zeros(4), torch.ones(4)
    bn = torch.nn.functional.batch_norm
    assert _watch(lambda x, rm, rv: bn(x, rm, rv, training=True), x, rm, rv) == [1, 2]
    assert _watch(lambda x, rm, rv: bn(x, rm, rv, training=False), x, rm, rv) == []


def test_a_kv_cache_index_copy_is_seen() -> None:
    cache = torch.zeros(2, 8, 4)  # [B, S, D]
    pos = torch.tensor([3])
    k = torch.randn(2, 1, 4)
    assert _watch(lambda c, p, k: c.index_copy_(1, p, k), cache, pos, k) == [0]


def test_copy_back_writes_the_caller_tensor_and_skips_its_own_buffer() -> None:
    def fn(x, y, n):
        x.add_(1)
        return x * y

    x, y = torch.randn(3), torch.randn(3)
    inputs = Inputs(CallArgs(fn, (x, y, 2), {}), CPU)
    inputs.set_written([0])  # tensor slot 0: x
    assert inputs.written == (0,) and inputs.written_paths() == ["args[0] 'x'"]
    w = torch.randn(3)
    want = w + 1
    leaves = inputs.copy_in((w, y, 2), {})
    fn(*inputs.static_args)  # what the replay does to the static buffers
    inputs.copy_back(leaves)
    assert torch.equal(w, want)
    # The caller passed the static buffer itself: nothing to copy.
    static = inputs.static_args[0]
    before = static.clone()
    leaves = inputs.copy_in(inputs.static_args, {})
    fn(*inputs.static_args)
    inputs.copy_back(leaves)
    assert torch.equal(static, before + 1)


def test_a_written_argument_that_aliases_another_is_refused() -> None:
    inputs = Inputs(CallArgs(lambda x, y: x.add_(y), (torch.randn(4), torch.randn(4)), {}), CPU)
    inputs.set_written([0])
    base = torch.randn(8)
    with pytest.raises(ReplayInputError, match=r"args\[0\] 'x' and args\[1\] 'y' share memory"):
        inputs.check_aliasing([base[:4], base[2:6]])
    with pytest.raises(CaptureError, match="share memory"):
        inputs.check_aliasing([base[:4], base[:4]], where="capture")
    inputs.check_aliasing([base[:4], base[4:]])  # same storage, no overlap: fine
    inputs.check_aliasing([torch.randn(4), torch.randn(4)])


def test_lossless_widening_table() -> None:
    assert widens(torch.float16, torch.float32) and widens(torch.bfloat16, torch.float32)
    assert widens(torch.int32, torch.int64) and widens(torch.uint8, torch.int16)
    assert not widens(torch.float32, torch.float16)  # narrowing
    assert not widens(torch.float16, torch.bfloat16)  # neither holds the other
    assert not widens(torch.int64, torch.float64)  # changes meaning, and not exact above 2**53
    assert not widens(torch.bool, torch.float32)
    assert not widens(torch.uint8, torch.int8)


def test_a_widening_cast_is_copied_in_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    inputs = Inputs(CallArgs(lambda x: x, (torch.randn(2, 3),), {}), CPU)
    half = torch.randn(2, 3).half()
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        inputs.copy_in((half,), {})
        inputs.copy_in((half,), {})
    assert torch.equal(inputs.static_args[0], half.float())
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "args[0] 'x' is float16" in said[0] and "lossless cast" in said[0]
    with pytest.raises(ReplayInputError, match="float64.*captured with.*float32"):
        inputs.copy_in((torch.randn(2, 3, dtype=torch.float64),), {})


def test_a_compiled_region_inside_the_watch_runs_compiled_and_its_writes_are_found() -> None:
    """A function that calls a torch.compile'd model, graphed: the capture runs under the
    watch, where the compiled region must run its compiled code (a recompile inside a capture
    fails), and a write it makes to a watched buffer must still be found (the version counter,
    which torch bumps for inputs a compiled graph mutates)."""
    torch._dynamo.reset()

    @torch.compile(backend="aot_eager", fullgraph=True)
    def region(x, y):
        x.add_(1)
        return y * 2

    x, y = torch.zeros(4), torch.randn(4)
    with torch.no_grad():
        region(x, y)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        watch = WriteWatch([y, x])
        with watch:
            out = region(x, y)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # no recompile
        assert watch.written == [1] and x.eq(2).all() and torch.equal(out, y * 2)
        watch = WriteWatch([y, x])
        with watch:
            y.mul_(3)  # an eager write: the mode sees the op
        assert watch.written == [0]
    torch._dynamo.reset()
