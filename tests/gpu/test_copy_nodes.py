"""A graph that copies its tensor arguments in by itself (_compat/copy_nodes.py): its first nodes
are memcpys into the static inputs, pointed at the caller's tensors at each call, so that a call
launches no copy of its own.

Every test compares with eager on fresh random inputs over many calls, in the orders that move a
node's source (new tensors, the same tensor rewritten, the graph's own buffer, a tensor a byte
copy cannot take, a freed one), and says whether the graph copied by itself (``stats``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import torchreplay as tr
from torchreplay._compat import copy_nodes
from torchreplay.errors import CaptureError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEV = "cuda"
CALLS = 30


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)).to(DEV).eval()


def eager(model: nn.Module, *args: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(*args)


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


needs_nodes = pytest.mark.skipif(
    torch.cuda.is_available() and not copy_nodes.available(), reason="this torch or driver has no copy nodes"
)


@needs_nodes
def test_new_tensors_at_every_call_are_copied_by_the_graph() -> None:
    model = mlp()
    g = tr.graph(model, torch.randn(8, 64, device=DEV))
    assert g.stats.graph_copies == 1
    for _ in range(CALLS):
        x = torch.randn(8, 64, device=DEV)
        same(g(x), eager(model, x))
    assert g.stats.replays == CALLS and g.stats.fallbacks == 0


@needs_nodes
def test_the_same_tensor_rewritten_between_calls() -> None:
    """The source does not move: the node reads what the tensor holds at each launch."""
    model = mlp()
    g = tr.graph(model, torch.randn(8, 64, device=DEV))
    x = torch.randn(8, 64, device=DEV)
    outs = []
    for _ in range(CALLS):
        x.copy_(torch.randn(8, 64, device=DEV))
        y = g(x)
        same(y, eager(model, x))
        outs.append(y.clone())
    assert not torch.equal(outs[0], outs[-1])


@needs_nodes
@pytest.mark.parametrize("sizes", [None, [4, 8, 16]])
def test_calls_queued_behind_a_busy_gpu_keep_their_own_sources(sizes) -> None:
    """The GPU held back (a sleep kernel) while the host queues many calls, each repointing the
    node (and, with ``sizes=``, its byte count): a launch already queued keeps the source it was
    launched with (the driver's contract), so each queued call reads its own tensor. Nothing is
    read back until every call is queued."""
    model = mlp()
    g = tr.graph(model, torch.randn(8, 64, device=DEV), sizes=sizes)
    rows = [8] * CALLS if sizes is None else [3 + 11 * k % 14 for k in range(CALLS)]
    xs = [torch.randn(n, 64, device=DEV) for n in rows]
    for n in sorted(set(rows)):  # (each call size's route made first, outside the timed run)
        g(torch.randn(n, 64, device=DEV))
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: the host runs ahead of it
    outs = [g(x).clone() for x in xs]  # (a clone is queued too: no sync)
    torch.cuda.synchronize()
    for x, y in zip(xs, outs):
        same(y, eager(model, x))


@needs_nodes
def test_the_graphs_own_buffer_new_tensors_and_views_in_turn() -> None:
    """Passing ``g.static_args`` turns the copy off (the buffer holds the values), a view of the
    whole buffer too; a new tensor after it turns it on again."""
    model = mlp()
    g = tr.graph(model, torch.randn(8, 64, device=DEV))
    (static,) = g.static_args
    for k in range(CALLS):
        kind = k % 3
        if kind == 0:
            static.copy_(torch.randn(8, 64, device=DEV))
            x = static
        elif kind == 1:
            static.copy_(torch.randn(8, 64, device=DEV))
            x = static.view(8, 64)
        else:
            x = torch.randn(8, 64, device=DEV)
        same(g(x), eager(model, x))


@needs_nodes
def test_tensors_a_byte_copy_cannot_take_are_copied_by_a_launch() -> None:
    """Another layout of the same shape, a widening cast, a negative-bit view: the node is off for
    that call, and on again for the next plain tensor."""
    model = mlp()
    g = tr.graph(model, torch.randn(8, 64, device=DEV))
    for k in range(CALLS):
        plain = torch.randn(8, 64, device=DEV)
        kind = k % 4
        if kind == 0:
            x = plain.t().contiguous().t()  # strides (1, 8)
            assert not x.is_contiguous()
        elif kind == 1:
            x = plain.half()  # copied with a cast (a warning, once)
        elif kind == 2:
            x = torch.complex(torch.randn(8, 64, device=DEV), plain).conj().imag  # the negative bit
            assert x.is_neg()
        else:
            x = plain
        same(g(x), eager(model, x.float()))


@needs_nodes
def test_freed_inputs_and_an_emptied_cache_between_calls() -> None:
    """A temporary freed right after the call, and its memory given back to the driver: the next
    call's node reads its own tensor, never the freed one."""
    model = mlp()
    g = tr.graph(model, torch.randn(8, 64, device=DEV))
    for k in range(CALLS):
        seed = torch.randint(0, 2**31, (1,)).item()
        torch.manual_seed(seed)
        y = g(torch.randn(8, 64, device=DEV)).clone()
        torch.manual_seed(seed)
        same(y, eager(model, torch.randn(8, 64, device=DEV)))
        if k % 5 == 0:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


@needs_nodes
def test_an_output_passed_back_in() -> None:
    """``y = g(y)``: the node reads the last output before the graph overwrites it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh()).to(DEV).eval()
    g = tr.graph(model, torch.randn(8, 64, device=DEV))
    y = torch.randn(8, 64, device=DEV)
    ref = y.clone()
    for _ in range(CALLS):
        y = g(y)
        ref = eager(model, ref)
        same(y, ref)


@needs_nodes
def test_three_arguments_are_copied_by_the_graph_four_by_a_launch() -> None:
    def f3(a, b, c):
        return (a * b).sum(-1) + c.mean()

    def f4(a, b, c, d):
        return (a * b).sum(-1) + c.mean() - d

    shapes3 = [(8, 64), (8, 64), (16,)]
    shapes4 = shapes3 + [(8,)]
    g3 = tr.graph(f3, *[torch.randn(s, device=DEV) for s in shapes3])
    g4 = tr.graph(f4, *[torch.randn(s, device=DEV) for s in shapes4])
    assert g3.stats.graph_copies == 3 and g4.stats.graph_copies == 0
    static_b = g3.static_args[1]
    for k in range(CALLS):
        a3 = [torch.randn(s, device=DEV) for s in shapes3]
        if k % 2:  # one of three passed as the graph's own buffer: that node alone is off
            static_b.copy_(a3[1])
            a3[1] = static_b
        same(g3(*a3), f3(*a3))
        a4 = [torch.randn(s, device=DEV) for s in shapes4]
        same(g4(*a4), f4(*a4))


@needs_nodes
def test_a_written_argument_still_reaches_the_caller() -> None:
    def step(x, cache):
        cache.mul_(0.5).add_(x)
        return cache.sum(-1)

    g = tr.graph(step, torch.randn(8, 64, device=DEV), torch.randn(8, 64, device=DEV))
    assert g.stats.graph_copies == 2 and g.stats.written_inputs
    cache = torch.randn(8, 64, device=DEV)
    ref_cache = cache.clone()
    for _ in range(CALLS):
        x = torch.randn(8, 64, device=DEV)
        y = g(x, cache)
        ref = step(x, ref_cache)
        same(y, ref)
        same(cache, ref_cache)


@needs_nodes
def test_on_a_side_stream() -> None:
    model = mlp()
    g = tr.graph(model, torch.randn(8, 64, device=DEV))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(CALLS):
            x = torch.randn(8, 64, device=DEV)
            same(g(x), eager(model, x))
    torch.cuda.current_stream().wait_stream(side)


@needs_nodes
def test_a_call_that_records_no_work_is_still_refused() -> None:
    """The copies alone are not the call's work: a callable that launches nothing is refused as
    before they existed."""
    with pytest.raises(CaptureError, match="no CUDA work"):
        tr.graph(lambda x: x.shape[0], torch.randn(8, 64, device=DEV))


@needs_nodes
def test_copies_not_found_leave_each_call_copying_by_a_launch(monkeypatch, caplog) -> None:
    """Copy nodes that the graph does not show after the capture (never seen; the driver's
    business): they stay as recorded, copying each static buffer into a spare nobody reads,
    and each call copies its tensors in with a launch."""
    monkeypatch.setattr(copy_nodes, "bind", lambda *args: None)
    model = mlp()
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        g = tr.graph(model, torch.randn(8, 64, device=DEV))
    assert g.stats.graph_copies == 0
    assert "were not found" in caplog.text
    for _ in range(CALLS):
        x = torch.randn(8, 64, device=DEV)
        same(g(x), eager(model, x))


@needs_nodes
def test_sizes_copy_the_call_rows_with_each_size_graphs_node() -> None:
    """``sizes=``: each size's graph copies a call's ``n`` rows (fewer than its size: the padding
    rows keep the fill value), at every ``n``, with new tensors and with views of one tensor at
    the same address but another row count."""
    model = mlp()
    g = tr.graph(model, torch.randn(3, 64, device=DEV), sizes=[1, 2, 4, 8, 16])
    assert g.stats.graph_copies == 1
    for _ in range(3):
        for n in range(1, 17):
            x = torch.randn(n, 64, device=DEV)
            same(g(x), eager(model, x))
    big = torch.randn(16, 64, device=DEV)
    for n in (13, 14, 13, 16, 9, 16):  # one address, the rows changing (and the graph, at 16 and 9)
        big.normal_()
        x = big[:n]
        same(g(x), eager(model, x))
    assert g.stats.fallbacks == 0


@needs_nodes
def test_sizes_with_a_fixed_argument_and_one_written() -> None:
    """A varying argument, a fixed one, and a written one (a running sum) through the nodes."""

    def step(x, w, acc):
        acc.add_(x.sum(0))
        return (x @ w).relu(), acc * 1

    w = torch.randn(64, 32, device=DEV)
    g = tr.graph(step, torch.randn(4, 64, device=DEV), w, torch.zeros(64, device=DEV),
                 sizes=[2, 4, 8], dim={"x": 0, "w": None, "acc": None})
    assert g.stats.graph_copies == 3
    acc, ref_acc = torch.zeros(64, device=DEV), torch.zeros(64, device=DEV)
    for k in range(CALLS):
        n = 1 + k % 8
        x = torch.randn(n, 64, device=DEV)
        w2 = torch.randn(64, 32, device=DEV) if k % 4 == 0 else w
        y, a = g(x, w2, acc)
        ry, ra = step(x, w2, ref_acc)
        same(y, ry)
        same(a, ra)
        same(acc, ref_acc)


@needs_nodes
@pytest.mark.parametrize("sizes", [None, [2, 4]], ids=["one_shape", "sizes"])
def test_torch_func_transforms_run_eagerly_not_through_the_node(sizes) -> None:
    """A forward-AD dual has its primal's storage: pointed at by address, the graph would replay
    without its tangent, silently. vmap's and jvp's tensors have no storage. Each runs eagerly
    inside the transform (a fallback), the tangent right; plain calls replay after."""
    import torch.autograd.forward_ad as fw_ad

    torch.manual_seed(0)
    model = nn.Linear(64, 32).to(DEV).eval().requires_grad_(False)
    g = tr.graph(model, torch.randn(2, 64, device=DEV), sizes=sizes)
    xs, x, t = (torch.randn(3, 2, 64, device=DEV), torch.randn(2, 64, device=DEV),
                torch.randn(2, 64, device=DEV))
    with torch.no_grad():
        y0 = torch.randn(2, 64, device=DEV)
        same(g(y0), model(y0))  # (the node on, pointed at y0)
        same(torch.func.vmap(g)(xs), model(xs))
        _, tangent = torch.func.jvp(g, (x,), (t,))
        same(tangent, t @ model.weight.T)
        with fw_ad.dual_level():
            dual = g(fw_ad.make_dual(x, t))
            assert fw_ad.unpack_dual(dual).tangent is not None
            same(fw_ad.unpack_dual(dual).tangent, t @ model.weight.T)
        for _ in range(3):
            y = torch.randn(2, 64, device=DEV)
            same(g(y), model(y))
    assert g.stats.fallbacks == 3


_EXPANDABLE = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {root!r})
    import torchreplay as tr
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32)).cuda().eval()
    g = tr.graph(model, torch.randn(8, 64, device="cuda"))
    keep = []
    for k in range(40):  # new tensors from the expandable segments, some freed, some kept
        x = torch.randn(8, 64, device="cuda")
        with torch.no_grad():
            ref = model(x)
        torch.testing.assert_close(g(x), ref, rtol=1e-5, atol=1e-5)
        if k % 3 == 0:
            keep.append(torch.randn(1 << 20, device="cuda"))  # the segment grows under later inputs
        if k % 10 == 9:
            keep.clear(); torch.cuda.synchronize(); torch.cuda.empty_cache()
    node = g._inputs._one[-1]
    print("EQUAL", g.stats.graph_copies, "node on" if node is not None and node.source else "node off: copied by a launch")
    """
)


@needs_nodes
def test_inputs_from_expandable_segments() -> None:
    """``expandable_segments:True`` maps memory into one growing range (cuMemMap), not cudaMalloc
    blocks: the node takes sources there too, or, refused by the driver, the call copies."""
    script = _EXPANDABLE.format(root=str(Path(__file__).resolve().parents[2]))
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and "EQUAL" in proc.stdout, (proc.stdout + proc.stderr)[-3000:]
    print(proc.stdout.strip())  # (-s: whether the driver took those sources)


@needs_nodes
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("sizes", [None, [4, 8]])
def test_a_graph_on_the_second_gpu_called_with_the_first_current(sizes) -> None:
    """A graph of ``cuda:1`` called while ``cuda:0`` is the current device (graphs on several
    devices of one process): its node is bound to the second GPU's context, takes the call's
    tensors there (on, then off for the graph's own buffer, then on again), and every call
    equals eager."""
    dev = torch.device("cuda", 1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)).to(dev).eval()
    with torch.cuda.device(0):
        g = tr.graph(model, torch.randn(8, 64, device=dev), sizes=sizes)
        assert g.stats.graph_copies == 1
        node = None
        for k in range(CALLS):
            n = 8 if sizes is None else 3 + k % 6
            x = torch.randn(n, 64, device=dev)
            if sizes is None and k % 5 == 4:
                x = g.static_args[0]
                x.copy_(torch.randn(8, 64, device=dev))
            with torch.no_grad():
                ref = model(x)
            same(g(x), ref)
            if sizes is None:
                node = g._inputs._one[-1]
                assert node is not None and node.source == (0 if k % 5 == 4 else x.data_ptr()), k
        assert torch.cuda.current_device() == 0
    assert g.stats.replays == CALLS and g.stats.fallbacks == 0


# --- the compile backend's piecewise runtime (pieces/entries.py copy_inputs, PieceGraph.copy_in)


class _CloneSplit(nn.Module):
    """Two blocks with ``torch.clone`` between them, named as the splitting op: an eager step
    whose new tensor the second graph copies in (by its own node)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Sequential(nn.Linear(64, 128), nn.ReLU())
        self.b = nn.Linear(128, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.clone(self.a(x) * 2)) + 1


def _runtime(c):
    (rt,) = c.backend.runtimes
    return rt


@needs_nodes
@pytest.mark.parametrize("sizes", [None, [2, 4, 8]])
def test_a_compiled_model_copies_its_inputs_by_its_first_graph(sizes) -> None:
    """``tr.compile``: the call's tensor goes into the first graph's buffer by that graph's node
    (a call of fewer rows than its size: those rows' bytes), equal to eager on fresh inputs; a
    transposed input (a byte copy would not keep it) is copied by a launch, still equal."""
    model = mlp()
    c = tr.compile(model, sizes=sizes)
    rows = [8] * CALLS if sizes is None else [1 + 5 * k % 8 for k in range(CALLS)]
    with torch.no_grad():
        for n in rows:
            x = torch.randn(n, 64, device=DEV)
            same(c(x), eager(model, x))
        rt = _runtime(c)
        assert rt.stats.graph_copies == 1, rt.stats.explain()
        assert rt.stats.fallbacks == 0, rt.fallback_reasons
        t = torch.randn(64, 8, device=DEV).t()
        same(c(t), eager(model, t))


@needs_nodes
def test_compiled_calls_queued_behind_a_busy_gpu_keep_their_own_sources() -> None:
    """Many calls queued while the GPU is held back, each pointing the first graph's node at a
    new tensor of other rows: each launch reads the tensor it was launched with."""
    model = mlp()
    c = tr.compile(model, sizes=[4, 8, 16])
    queued_calls_equal(c, lambda x: eager(model, x))
    assert _runtime(c).stats.graph_copies == 1


def queued_calls_equal(f, reference) -> None:
    """Calls of ``f`` (sizes 4, 8, 16) queued while the GPU is held back, each with a new tensor
    of other rows (every size called once first): each equals ``reference`` once they ran."""
    rows = [3 + 11 * k % 14 for k in range(CALLS)]
    xs = [torch.randn(n, 64, device=DEV) for n in rows]
    with torch.no_grad():
        for n in sorted(set(rows)):
            f(torch.randn(n, 64, device=DEV))
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)
        outs = [f(x).clone() for x in xs]
        torch.cuda.synchronize()
        for x, y in zip(xs, outs):
            same(y, reference(x))


@needs_nodes
def test_a_compiled_model_writing_its_input_and_one_passed_back() -> None:
    """The graph copies the argument in by its node, writes its buffer, and the write reaches
    the caller's tensor; the output passed back in as the next input (a tensor of the pool)."""

    def f(x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return torch.tanh(x @ x.t())

    c = tr.compile(f)
    for _ in range(CALLS):
        x = torch.randn(8, 8, device=DEV)
        ref = x.clone()
        want = f(ref)
        got = c(x)
        same(got, want)
        same(x, ref)
        y = c(got.clone())
        same(y, f(want.clone()))


@needs_nodes
def test_an_eager_steps_value_goes_into_the_next_graph_by_its_node() -> None:
    """``torch.clone`` as the splitting op: its new tensor reaches the next graph by that
    graph's own node (no copy launch), equal to eager at every call, the same and new inputs."""
    model = _CloneSplit().to(DEV).eval()
    c = tr.compile(model, splitting_ops=["torch.clone"])
    x = torch.randn(8, 64, device=DEV)
    with torch.no_grad():
        for k in range(CALLS):
            if k % 3:
                x = torch.randn(8, 64, device=DEV)
            same(c(x), eager(model, x))
    rt = _runtime(c)
    assert rt.stats.fallbacks == 0, rt.fallback_reasons
    (entry,) = rt._entries.values()
    assert [bool(g.nodes) for g in entry.graphs if g is not None] == [False, True], rt


@needs_nodes
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_compiled_model_on_the_second_gpu_called_with_the_first_current() -> None:
    """``tr.compile`` of a model on ``cuda:1``, built and called while ``cuda:0`` is current,
    ``torch.clone`` as a splitting op: the first graph's node (the call's rows) and the second's
    (the clone) are bound to the second GPU's context and point at each call's tensors there;
    every call equals eager."""
    dev = torch.device("cuda", 1)
    model = _CloneSplit().to(dev).eval()
    with torch.cuda.device(0), torch.no_grad():
        c = tr.compile(model, splitting_ops=["torch.clone"], sizes=[4, 8])
        for k in range(CALLS):
            x = torch.randn(3 + k % 6, 64, device=dev)
            same(c(x), model(x))
        assert torch.cuda.current_device() == 0
    rt = _runtime(c)
    assert rt.device == dev and rt.stats.graph_copies == 1, rt
    assert rt.stats.fallbacks == 0, rt.fallback_reasons
    assert all(bool(e.graphs[-1].nodes) for e in rt._entries.values()), rt


# -- a breakable graph (``tr.graph(..., breaks=)``): its first segment copies the call's tensors --


def host_scale(x: torch.Tensor, lengths: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """A break: row ``b`` scaled by the host's ``lengths[b]`` (rows past them, a size's padding,
    kept as they are), plus ``shift``, a tensor of the call that only this break reads."""
    out = x.clone()
    n = lengths.numel()
    out[:n] *= lengths.to(x.device, x.dtype).view(-1, 1)
    return out + shift


class _HostScaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(64, 128)
        self.b = nn.Linear(128, 32)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return self.b(host_scale(torch.relu(self.a(x)), lengths, shift))


@needs_nodes
@pytest.mark.parametrize("sizes", [None, [2, 4, 8]])
def test_a_breakable_graph_copies_the_calls_tensors_by_its_first_segment(sizes) -> None:
    """``tr.graph(breaks=)``: the call's two CUDA tensors (one read by the segments, one only by
    the break) go into their buffers by the first segment's own nodes (a call of fewer rows
    than its size: those rows), the host lengths are re-bound, equal to eager on fresh inputs
    at every call; a transposed input (a byte copy would not keep it) is copied by a launch."""
    model = _HostScaled().to(DEV).eval()
    g = tr.graph(model, torch.randn(8, 64, device=DEV), torch.randint(1, 5, (8,)),
                 torch.randn(128, device=DEV), breaks=[host_scale], sizes=sizes,
                 dim=None if sizes is None else {"x": 0})
    rows = [8] * CALLS if sizes is None else [1 + 5 * k % 8 for k in range(CALLS)]
    for n in rows:
        args = torch.randn(n, 64, device=DEV), torch.randint(1, 5, (n,)), torch.randn(128, device=DEV)
        same(g(*args), eager(model, *args))
    assert g.stats.graph_copies == 2, g.stats.explain()
    assert g.stats.fallbacks == 0, g.runtime.fallback_reasons
    assert _segment_nodes(g) == [[False, True]] * (1 if sizes is None else 3)  # the break's output
    lengths, shift = torch.randint(1, 5, (8,)), torch.randn(128, device=DEV)
    t = torch.randn(64, 8, device=DEV).t()
    same(g(t, lengths, shift), eager(model, t, lengths, shift))
    x = torch.randn(8, 64, device=DEV)
    for _ in range(3):  # the same tensors again, rewritten between the calls
        x.normal_()
        shift.normal_()
        same(g(x, lengths, shift), eager(model, x, lengths, shift))


def _segment_nodes(g) -> list[list[bool]]:
    """Per captured entry of a breakable graph, per segment that recorded work: does it copy
    the last break's outputs in by its own nodes?"""
    return [[bool(p.nodes) for p in e.graphs if p is not None and p.graph is not None]
            for e in g.runtime._entries.values()]


def doubled_tanh(x: torch.Tensor) -> torch.Tensor:
    """A break of device work only: nothing in it waits for the GPU."""
    return torch.tanh(x) * 2


@needs_nodes
def test_breakable_calls_queued_behind_a_busy_gpu_keep_their_own_sources() -> None:
    """Many calls of a breakable graph queued while the GPU is held back, each pointing the
    first segment's node at a new tensor of other rows: each launch reads the tensor it was
    launched with, and the break between the segments runs on what they wrote."""
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)).to(DEV).eval()

    def f(x: torch.Tensor) -> torch.Tensor:
        return model[2](doubled_tanh(model[1](model[0](x))))

    g = tr.graph(f, torch.randn(16, 64, device=DEV), breaks=[doubled_tanh], sizes=[4, 8, 16])
    queued_calls_equal(g, f)
    assert g.stats.graph_copies == 1 and g.stats.fallbacks == 0, g.stats.explain()
    assert _segment_nodes(g) == [[False, True]] * 3


@needs_nodes
def test_a_breakable_graph_writing_its_input_reaches_the_caller() -> None:
    """The first segment copies the argument in by its node and writes its buffer, a break
    reads it after; the write reaches the caller's tensor, as eagerly, at every call."""

    def f(x: torch.Tensor, lengths: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return torch.tanh(host_scale(x @ x.t(), lengths, shift) + x)

    shift = torch.randn(8, device=DEV)
    g = tr.graph(f, torch.randn(8, 8, device=DEV), torch.randint(1, 5, (8,)), shift, breaks=[host_scale])
    for _ in range(CALLS):
        x, lengths = torch.randn(8, 8, device=DEV), torch.randint(1, 5, (8,))
        ref = x.clone()
        want = f(ref, lengths, shift)
        got = g(x, lengths, shift)
        same(got, want)
        same(x, ref)
        same(g(got.clone(), lengths, shift), f(want.clone(), lengths, shift))
    assert g.stats.graph_copies == 2 and g.stats.fallbacks == 0, g.stats.explain()


def fan_out(h: torch.Tensor, lengths: torch.Tensor) -> tuple:
    """A break returning a view of its argument (read where it is), two new tensors (the next
    segment copies them in by its nodes) and the host's count (a constant of the graph)."""
    n = lengths.numel()
    scale = lengths.to(h.device, h.dtype).sum()
    return h[:, :64], torch.tanh(h) * scale, h.sum(-1, keepdim=True), n


def four_new(t: torch.Tensor) -> tuple:
    """A break with four new outputs: more than a segment copies by nodes (one launch)."""
    return t + 1, t * 2, t - 3, torch.sigmoid(t)


class _FanOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(64, 128)
        self.b = nn.Linear(64 + 128 + 1, 32)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        v, t, s, n = fan_out(torch.relu(self.a(x)), lengths)
        p, q, r, u = four_new(t * 0.5 + s)
        return self.b(torch.cat([v * 2, p + q * r - u, s * n], -1))


@needs_nodes
def test_break_outputs_of_every_kind_reach_the_next_segment() -> None:
    """A break's view of its argument, its new tensors (copied by the next segment's nodes), its
    host count, and a break of four new tensors (copied by one launch): equal to eager on fresh
    inputs at every call."""
    model = _FanOut().to(DEV).eval()
    g = tr.graph(model, torch.randn(8, 64, device=DEV), torch.randint(1, 5, (8,)), breaks=[fan_out, four_new])
    for _ in range(CALLS):
        x, lengths = torch.randn(8, 64, device=DEV), torch.randint(1, 5, (8,))
        same(g(x, lengths), eager(model, x, lengths))
    assert g.stats.fallbacks == 0, g.runtime.fallback_reasons
    assert _segment_nodes(g) == [[False, True, False]]
    text = tr.explain(g)
    assert "its 3 tensor output(s) go into segment 1: 2 by its own copy nodes, 1 by one launch" in text, text
    assert "its 4 tensor output(s) go into segment 2: 0 by its own copy nodes, 4 by one launch" in text, text
