"""The tensors of Python state a graph reads (core/reads.py), on the CPU: a tensor off the
graph's device that the captured call reads on the host keeps the capture's value in every
replay, so a replay that finds it written in place since (or replaced) raises; a copy of it to
the device is read by each replay and is no such read. The protocol capture() runs is
emulated as in test_effects.py, with the graph's device CUDA and the state on the CPU. The GPU
test is tests/gpu/test_effects.py."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

from test_effects import built_on
from torchreplay.core.effects import PyState
from torchreplay.core.reads import ReadWatch, _host_read
from torchreplay.errors import CaptureError, ReplayInputError

CUDA = torch.device("cuda")
META = torch.device("meta")
aten = torch.ops.aten


def build(fn: Callable[..., Any], *args: Any, device: torch.device = CUDA):
    """As capture() runs the first capture of a PyState that finds the state's reads: (error or
    None, the PyState)."""
    return built_on(device, fn, *args, reads=True)


class Scaled(nn.Module):
    """Reads a CPU tensor kept as a plain attribute on the host: ``.item()``."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.tensor(2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale.item()


def test_a_cpu_tensor_read_on_the_host_then_written_in_place_raises_at_the_next_replay() -> None:
    m = Scaled()
    err, ps = build(m, torch.randn(3))
    assert err is None
    reads = ps.reads()
    assert reads is not None and reads.replaced("m") is None
    m.scale.fill_(3.0)  # eagerly the next call reads 3.0; a replay would keep 2.0
    err = reads.replaced("m")
    assert isinstance(err, ReplayInputError)
    assert "Scaled.scale" in str(err) and "written in place since" in str(err), err
    assert "read it on the host" in str(err) and "register_buffer" in str(err)


def test_a_cpu_tensor_read_on_the_host_then_replaced_says_why_writing_in_place_is_no_fix() -> None:
    m = Scaled()
    err, ps = build(m, torch.randn(3))
    assert err is None
    m.scale = torch.tensor(3.0)
    err = ps.reads().replaced("m")
    assert isinstance(err, ReplayInputError) and "read it on the host" in str(err), err
    assert "in place (`.copy_" not in str(err)  # (the advice for a tensor on the device)


def test_a_tensor_on_the_graphs_device_written_in_place_is_read_by_every_replay() -> None:
    # the graph on the CPU itself: its ops read the tensor at every replay, nothing frozen
    m = Scaled()
    err, ps = build(m, torch.randn(3), device=torch.device("cpu"))
    assert err is None
    reads = ps.reads()  # (at the end of the build, as every front asks)
    m.scale.fill_(3.0)
    assert reads is None or reads.replaced("m") is None


def test_a_cpu_tensor_the_call_writes_with_the_values_it_holds_is_no_frozen_read() -> None:
    class Refills(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.arange(3.0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            torch.mul(torch.arange(3.0), 1, out=self.table)  # (what it holds: eager-equal)
            return x * self.table.sum().item()

    m = Refills()
    err, ps = build(m, torch.randn(3))
    assert err is None
    assert ps.reads() is None or ps.reads().replaced("m") is None


def test_only_a_copy_to_the_device_reads_host_memory_at_replay() -> None:
    """``_host_read`` with the meta device standing for the graph's."""
    t = torch.zeros(2)
    on = torch.empty(2, device=META)
    assert not _host_read(aten.copy_.default, (on, t), {}, t, META)  # pinned memory, re-read
    assert _host_read(aten.copy_.default, (torch.zeros(2), t), {}, t, META)  # a host copy
    assert not _host_read(aten.copy_.default, (t, on), {}, t, META)  # its destination: no read
    assert not _host_read(aten._to_copy.default, (t,), {"device": META}, t, META)
    assert _host_read(aten._to_copy.default, (t,), {"dtype": torch.float64}, t, META)
    assert _host_read(aten.mul.Tensor, (on, t), {}, t, META)  # a 0-dim CPU operand: by value
    assert not _host_read(aten.mul.Tensor, (on, t), {}, on, META)
    # its shape and dtype only, or a view: no value read (an op on the view reads it then)
    assert not _host_read(aten.empty_like.default, (t,), {"device": META}, t, META)
    assert not _host_read(aten.new_zeros.default, (t, [2]), {}, t, META)
    assert not _host_read(aten.select.int, (t, 0, 0), {}, t, META)
    assert _host_read(aten._local_scalar_dense.default, (t[0],), {}, t[0], META)  # .item()


def test_the_watch_sees_item_and_leaves_reads_in_eager_parts_out() -> None:
    a, b = torch.tensor(1.0), torch.tensor(2.0)
    watch = ReadWatch([a, b], CUDA)
    with watch:
        a.item()
        watch.paused += 1
        b.item()
        watch.paused -= 1
    assert watch.read == watch.host_read == {id(a)}


class Parts:
    """A breakable graph's run (as test_effects.Parts): the break bumps a CPU counter."""

    def __init__(self, segment_reads: bool) -> None:
        self.ps: PyState | None = None
        self.segment_reads = segment_reads
        self.pos = torch.zeros((), dtype=torch.long)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        with self.ps.eager_part("break b"):
            self.pos.add_(1)
        return x * int(self.pos) if self.segment_reads else x * 2


@pytest.mark.parametrize("segment_reads", [True, False])
def test_a_cpu_tensor_a_break_writes_and_a_segment_reads_on_the_host_is_refused(segment_reads: bool) -> None:
    model = Parts(segment_reads)
    ps = model.ps = PyState("model", model, (torch.randn(4),), {}, reads=True)
    ps.start()
    for i in range(3):
        if i:
            ps.put_back_tensors()
        with ps.warmup(last=i == 2):
            model(torch.randn(4))
    ps.put_back_tensors()
    with ps.captured(CUDA):
        model(torch.randn(4))
    err = ps.verdict()
    if not segment_reads:  # (the break's own writes are real at every call)
        assert err is None
        return
    assert isinstance(err, CaptureError), err
    assert "Parts.pos" in str(err) and "a graph segment reads it on the host" in str(err), err
    ps.undo()
    assert int(model.pos) == 0  # put back


def test_what_the_builds_last_put_back_writes_is_no_write_since_capture() -> None:
    """A first call that fills a table (a Python flag says so) writes it in the first warm-up
    only; the build puts it back after the capture, which moves its version. That is the build's
    write, not the caller's: the replays raise only once the caller writes it."""

    class FillsOnce(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.ones(3)
            self.filled = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not self.filled:
                self.table.mul_(1.0)  # (its values stay: only its version moves)
                self.filled = True
            return x * self.table.sum().item()

    m = FillsOnce()
    err, ps = build(m, torch.randn(3))
    assert err is None
    reads = ps.reads()
    assert reads is not None and reads.replaced("m") is None
    m.table.add_(1.0)
    assert isinstance(reads.replaced("m"), ReplayInputError)


def test_a_cpu_tensor_whose_shape_alone_is_used_is_no_frozen_read() -> None:
    class Shaped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.template = torch.zeros(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.zeros_like(self.template).sum() + self.template[:2].shape[0]

    m = Shaped()
    err, ps = build(m, torch.randn(3))
    assert err is None
    reads = ps.reads()
    assert reads is not None  # (it is read: its shape)
    m.template.fill_(5.0)  # (values no call reads)
    assert reads.replaced("m") is None


@pytest.mark.parametrize("read", ["tolist", "numpy", "item"])
def test_reads_on_the_host_without_an_op_are_seen_too(read: str) -> None:
    """``Tensor.tolist`` and ``Tensor.numpy`` read a CPU tensor's memory with no op to
    dispatch: a torch function mode sees them (at the first capture, where the state holds a
    tensor off the graph's device)."""

    class Lengths(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lengths = torch.tensor([3, 1])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n = {"tolist": lambda: max(self.lengths.tolist()), "numpy": lambda: int(self.lengths.numpy().max()),
                 "item": lambda: int(self.lengths.max().item())}[read]()
            return x[:n]

    m = Lengths()
    err, ps = build(m, torch.randn(4))
    assert err is None
    reads = ps.reads()
    assert reads is not None and reads.replaced("m") is None
    m.lengths[1] = 4
    err = reads.replaced("m")
    assert isinstance(err, ReplayInputError) and "Lengths.lengths" in str(err), err
