"""A training forward's piecewise runtime called twice before its backward, on CPU: the graphs are
stand-ins whose replay runs the piece again into the tensors its capture made, so a replay that
overwrites what an earlier call left for its backward gives a wrong gradient here as on a GPU.
What runs for real: the runtime's routes, keys, captures, saved-activation bookkeeping and copies
(``pieces/runtime.py``, ``pieces/saved.py``). The GPU tests (``tests/gpu/test_compile.py``) run
the same through ``tr.compile`` with CUDA graphs."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from memory import collector_off
from torchreplay.config import GraphConfig
from torchreplay.core.pool import Pool
from torchreplay.pieces import capturing
from torchreplay.pieces import runtime as runtime_mod
from torchreplay.pieces.entries import Entry
from torchreplay.pieces.program import Input, Piece, Program
from torchreplay.pieces.runtime import PiecewiseRuntime

_MADE: list[torch.Tensor] = []  # every tensor a stand-in capture made: "the pool"


class _Graph:
    """A captured piece: replaying runs it again on its static inputs, into its outputs."""

    def __init__(self, fn: Any, args: tuple[Any, ...], out: tuple[torch.Tensor, ...]) -> None:
        self.fn, self.args, self.out = fn, args, out

    def replay(self) -> None:
        with torch.no_grad():
            for o, n in zip(self.out, self.fn(*self.args)):
                o.data.copy_(n)  # (no version bump: a graph's replay moves none)

    def reset(self) -> None:  # (dropped with its set of graphs)
        self.fn = None


def _capture(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], **_: Any) -> Any:
    with torch.no_grad():
        out = tuple(t.clone() for t in fn(*args))  # (memory of the capture's own)
    _MADE.extend(out)
    return SimpleNamespace(graph=_Graph(fn, args, out), out=out, seconds=0.0, copies=(), spares=())


class _Pool(Pool):
    def segment_ranges(self) -> list[tuple[int, int]]:
        return [(t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
                for t in _MADE]


class _Stream:
    def synchronize(self) -> None:
        pass


@pytest.fixture()
def stand_ins(monkeypatch):
    _MADE.clear()
    monkeypatch.setattr(capturing, "capture", _capture)
    monkeypatch.setattr(runtime_mod, "side_stream", lambda device: _Stream())
    monkeypatch.setattr(runtime_mod, "follow_stream", lambda pool: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (this test's runtime only)
    yield
    _MADE.clear()


def _forward_runtime(max_graphs: int) -> PiecewiseRuntime:
    """One piece: ``x, w -> (y, a)`` with ``a = tanh(x @ w)`` the activation its backward
    reads (program output 1, a saved activation) and ``y = a * 2`` the caller's output."""

    def piece(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.tanh(x @ w)
        return a * 2, a

    program = Program(
        (Input("x", "tensor"), Input("w", "static")),
        [Piece(piece, (0, 1), (2, 3), True, "piece 0")],
        (2, 3),
    )
    rt = PiecewiseRuntime(program, name="forward", config=GraphConfig(outputs="static"),
                          max_graphs=max_graphs, guard_outputs=(1,), pool=_Pool())
    return rt


class _Forward(torch.autograd.Function):
    """As AOT autograd's: the runtime's forward, its activation saved for the backward, which
    marks it read (the backward runtime's ``after_replay`` on a GPU)."""

    @staticmethod
    def forward(ctx: Any, rt: PiecewiseRuntime, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if not rt._ready:
            rt._setup((x, w), torch.device("cpu"))
        y, a = rt(x, w)
        ctx.rt = rt
        ctx.save_for_backward(x, w, a)
        return y.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[None, torch.Tensor, torch.Tensor]:
        x, w, a = ctx.saved_tensors
        ctx.rt.saved.read(Entry(None), (a,))
        d = g * 2 * (1 - a * a)
        return None, d @ w.T, x.T @ d


def _grads_of_calls(rt: PiecewiseRuntime, calls: int, steps: int = 3) -> None:
    """``calls`` forwards of ``rt`` before one backward, ``steps`` times: every gradient equal
    to eager's."""
    w = torch.randn(6, 6, requires_grad=True)
    for step in range(steps):
        xs = [torch.randn(4, 6, requires_grad=True) for _ in range(calls)]
        sum(_Forward.apply(rt, x, w).square().sum() * (k + 1) for k, x in enumerate(xs)).backward()
        got = [x.grad for x in xs] + [w.grad]
        w_ref = w.detach().clone().requires_grad_()
        xs_ref = [x.detach().clone().requires_grad_() for x in xs]
        sum((torch.tanh(x @ w_ref) * 2).square().sum() * (k + 1) for k, x in enumerate(xs_ref)).backward()
        for k, (a, b) in enumerate(zip(got, [x.grad for x in xs_ref] + [w_ref.grad])):
            torch.testing.assert_close(a, b, msg=lambda m, k=k: f"step {step}, gradient {k}: {m}")
        w.grad = None


def _two_blocks_run_twice(block: Any, steps: int = 3) -> None:
    """A model of two blocks (``block(x, w)``, weights of their own) run twice before one
    backward, ``steps`` times: the weights' gradients equal eager's."""
    w1, w2 = torch.randn(6, 6, requires_grad=True), torch.randn(6, 6, requires_grad=True)
    for step in range(steps):
        xs = [torch.randn(4, 6) for _ in range(2)]
        sum(block(block(x, w1), w2).square().sum() * (k + 1) for k, x in enumerate(xs)).backward()
        r1, r2 = w1.detach().clone().requires_grad_(), w2.detach().clone().requires_grad_()
        sum((torch.tanh((torch.tanh(x @ r1) * 2) @ r2) * 2).square().sum() * (k + 1)
            for k, x in enumerate(xs)).backward()
        torch.testing.assert_close(w1.grad, r1.grad, msg=lambda m: f"step {step} w1: {m}")
        torch.testing.assert_close(w2.grad, r2.grad, msg=lambda m: f"step {step} w2: {m}")
        w1.grad = w2.grad = None


def test_a_second_call_before_the_backward_replays_a_copy(stand_ins) -> None:
    rt = _forward_runtime(max_graphs=16)
    _grads_of_calls(rt, calls=2)
    assert rt.stats.captures == 2 and rt.copies == 1
    assert rt.stats.replays == 6 and rt.stats.fallbacks == 0, rt.fallback_reasons


def test_a_dropped_runtime_is_freed_with_its_graphs(stand_ins) -> None:
    """The pool's finalizer of a runtime (``Pool.track``) must not hold the runtime itself: it
    held it through a bound method, and no runtime was ever freed (164 MiB of pool memory kept
    on the H200 after the model was gone)."""
    rt = _forward_runtime(max_graphs=16)
    _grads_of_calls(rt, calls=2, steps=2)
    assert rt.stats.replays > 0
    gone = weakref.ref(rt)
    del rt
    gc.collect()
    assert gone() is None


def test_a_dropped_runtime_is_freed_at_once_without_a_collection(stand_ins) -> None:
    """No reference cycle through the runtime (its stats read the pool's size through a bound
    method of it): one would leave it, its graphs and its pool's memory to Python's next full
    collection, which a long-running process may not make for a long time."""
    rt = _forward_runtime(max_graphs=16)
    _grads_of_calls(rt, calls=2, steps=2)
    gone = weakref.ref(rt)
    with collector_off():
        del rt
        assert gone() is None


def test_past_max_graphs_the_calls_run_ungraphed_and_are_counted(stand_ins) -> None:
    rt = _forward_runtime(max_graphs=2)
    _grads_of_calls(rt, calls=4)
    assert rt.stats.captures == 2 and rt.copies == 1
    assert rt.stats.replays == 6 and rt.stats.fallbacks == 6
    (why,) = rt.fallback_reasons
    assert "max_graphs" in why


def test_the_stand_ins_see_an_overwritten_activation(stand_ins, monkeypatch) -> None:
    """The harness can fail: with the block turned off, the second call's replay overwrites
    the first call's activation before its backward, and the first call's gradient is wrong."""
    rt = _forward_runtime(max_graphs=16)
    monkeypatch.setattr(rt.saved, "blocks", lambda entry: False)
    with pytest.raises(AssertionError, match="gradient"):
        _grads_of_calls(rt, calls=2)


def test_two_blocks_of_one_class_each_called_twice_before_the_backward(stand_ins) -> None:
    """Regional compilation: one runtime, a set of graphs per block's weights; a model of two
    blocks run twice before one backward. Each block's second call replays a copy of its own
    graph, captured later in the pool than every graph of the first run."""
    rt = _forward_runtime(max_graphs=16)
    _two_blocks_run_twice(lambda x, w: _Forward.apply(rt, x, w))
    assert rt.instances == 2 and rt.stats.captures == 4 and rt.copies == 2
    assert rt.stats.fallbacks == 0, rt.fallback_reasons


def test_forwards_dropped_before_their_backward_neither_block_nor_copy(stand_ins) -> None:
    """Outputs dropped without a backward (a metric in train mode) free what they saved: the
    next calls replay the one graph, with no copy and no call ungraphed."""
    rt = _forward_runtime(max_graphs=16)
    w = torch.randn(6, 6, requires_grad=True)
    for _ in range(3):
        _Forward.apply(rt, torch.randn(4, 6), w)  # dropped at once
    x = torch.randn(4, 6, requires_grad=True)
    _Forward.apply(rt, x, w).square().sum().backward()
    w_ref = w.detach().clone().requires_grad_()
    (torch.tanh(x.detach() @ w_ref) * 2).square().sum().backward()
    torch.testing.assert_close(w.grad, w_ref.grad)
    assert rt.stats.captures == 1 and rt.copies == 0
    assert rt.stats.replays == 4 and rt.stats.fallbacks == 0, rt.fallback_reasons


def test_a_copy_whose_call_was_dropped_serves_the_next_call(stand_ins) -> None:
    """Three calls before one backward, the second's output dropped (a metric): the third call
    replays the copy the second used, now free, instead of capturing another."""
    rt = _forward_runtime(max_graphs=16)
    w = torch.randn(6, 6, requires_grad=True)
    for step in range(3):
        a, b, c = (torch.randn(4, 6) for _ in range(3))
        ya = _Forward.apply(rt, a, w)
        _Forward.apply(rt, b, w)  # dropped at once
        yc = _Forward.apply(rt, c, w)
        (ya.square().sum() + 2 * yc.square().sum()).backward()
        w_ref = w.detach().clone().requires_grad_()
        ((torch.tanh(a @ w_ref) * 2).square().sum() + 2 * (torch.tanh(c @ w_ref) * 2).square().sum()).backward()
        torch.testing.assert_close(w.grad, w_ref.grad, msg=lambda m: f"step {step}: {m}")
        w.grad = None
    assert rt.stats.captures == 2 and rt.copies == 1
    assert rt.stats.replays == 9 and rt.stats.fallbacks == 0, rt.fallback_reasons


def test_a_shape_captured_mid_step_blocks_the_earlier_graph_which_copies(stand_ins) -> None:
    """8 rows, then 5 rows (a new graph, captured mid-step, later in the pool), then 8 rows
    again before one backward (a mixture of experts' token counts): the 8-row graph's replay
    may reach the 5-row graph's activations, held for the backward, so a copy of the 8-row
    graph serves the third call."""
    rt = _forward_runtime(max_graphs=16)
    w = torch.randn(6, 6, requires_grad=True)
    for step in range(3):
        xs = [torch.randn(n, 6) for n in (8, 5, 8)]
        sum(_Forward.apply(rt, x, w).square().sum() * (k + 1) for k, x in enumerate(xs)).backward()
        w_ref = w.detach().clone().requires_grad_()
        sum((torch.tanh(x @ w_ref) * 2).square().sum() * (k + 1) for k, x in enumerate(xs)).backward()
        torch.testing.assert_close(w.grad, w_ref.grad, msg=lambda m: f"step {step}: {m}")
        w.grad = None
    assert rt.stats.captures == 3 and rt.copies == 1  # 8 rows, 5 rows, a copy of the 8-row graph
    assert rt.stats.replays == 9 and rt.stats.fallbacks == 0, rt.fallback_reasons


def test_weights_moved_between_steps_drop_the_graph_and_its_copy_and_capture_both_again(stand_ins) -> None:
    """``w.data = ...`` between steps (a checkpoint reload): the set of graphs that read the old
    memory goes, its copy with it, and the next step captures both again at the new address."""
    rt = _forward_runtime(max_graphs=16)
    w = torch.randn(6, 6, requires_grad=True)
    for step in range(4):
        if step == 2:
            w.data = w.data.clone()  # moved
        xs = [torch.randn(4, 6) for _ in range(2)]
        sum(_Forward.apply(rt, x, w).square().sum() * (k + 1) for k, x in enumerate(xs)).backward()
        w_ref = w.detach().clone().requires_grad_()
        sum((torch.tanh(x @ w_ref) * 2).square().sum() * (k + 1) for k, x in enumerate(xs)).backward()
        torch.testing.assert_close(w.grad, w_ref.grad, msg=lambda m: f"step {step}: {m}")
        w.grad = None
    assert rt.stats.captures == 4 and rt.stats.fallbacks == 0, rt.fallback_reasons
    assert rt.instances == 1 and rt.copies == 1  # the old set and its copy are gone


def _pair(max_graphs: int = 16) -> tuple[PiecewiseRuntime, PiecewiseRuntime]:
    """A forward runtime and its backward's, wired as ``compile/training.py`` wires them: the
    forward ``x, w -> (y, a, xb)`` saves ``a = tanh(x @ w)`` and ``xb`` (x's copy) in its pool;
    the backward reads them in place (``pinned``) with ``w`` and the incoming gradient, finds
    the forward graphs it consumed by their addresses, and admits only activations a forward
    graph left in its pool."""

    def forward(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a = torch.tanh(x @ w)
        return a * 2, a, x * 1

    def backward(a: torch.Tensor, xb: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
        d = g * 2 * (1 - a * a)
        return d @ w.T, xb.T @ d

    fw = PiecewiseRuntime(
        Program((Input("x", "tensor"), Input("w", "static")), [Piece(forward, (0, 1), (2, 3, 4), True, "piece 0")],
                (2, 3, 4)),
        name="forward", config=GraphConfig(outputs="static"), max_graphs=max_graphs, guard_outputs=(1, 2),
        pool=_Pool(),
    )
    bw = PiecewiseRuntime(
        Program((Input("a", "pinned"), Input("xb", "pinned"), Input("w", "static"), Input("g", "tensor")),
                [Piece(backward, (0, 1, 2, 3), (4, 5), True, "piece 0")], (4, 5)),
        name="backward", config=GraphConfig(outputs="clone"), max_graphs=max_graphs, pool=_Pool(),
    )
    saved = fw.saved
    bw.after_replay = saved.read
    bw.admit = lambda call: all(saved.holds(call[i]) for i in (0, 1))
    return fw, bw


class _Pair(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fw: PiecewiseRuntime, bw: PiecewiseRuntime, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if not fw._ready:
            fw._setup((x, w), torch.device("cpu"))
        y, a, xb = fw(x, w)
        ctx.bw = bw
        ctx.save_for_backward(a, xb, w)
        return y.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        a, xb, w = ctx.saved_tensors
        args = (a, xb, w, g.contiguous())
        if not ctx.bw._ready:
            ctx.bw._setup(args, torch.device("cpu"))
        dx, dw = ctx.bw(*args)
        return None, None, dx, dw


def test_forward_and_backward_graphs_of_two_calls_before_one_backward(stand_ins) -> None:
    """The second call replays a copy of the forward graph; its backward gets a graph of its
    own (a set per forward graph: the addresses of the activations it reads in place). Every
    call of both runtimes replays after the first step, and gradients equal eager's."""
    fw, bw = _pair()
    w = torch.randn(6, 6, requires_grad=True)
    for step in range(4):
        xs = [torch.randn(4, 6, requires_grad=True) for _ in range(2)]
        sum(_Pair.apply(fw, bw, x, w).square().sum() * (k + 1) for k, x in enumerate(xs)).backward()
        w_ref = w.detach().clone().requires_grad_()
        xs_ref = [x.detach().clone().requires_grad_() for x in xs]
        sum((torch.tanh(x @ w_ref) * 2).square().sum() * (k + 1) for k, x in enumerate(xs_ref)).backward()
        for k, (a, b) in enumerate(zip([x.grad for x in xs] + [w.grad], [x.grad for x in xs_ref] + [w_ref.grad])):
            torch.testing.assert_close(a, b, msg=lambda m, k=k: f"step {step}, gradient {k}: {m}")
        w.grad = None
    assert fw.stats.captures == 2 and fw.copies == 1 and fw.stats.fallbacks == 0, fw.fallback_reasons
    assert bw.instances == 2 and bw.stats.captures == 2, bw
    assert bw.stats.replays == 8 and bw.stats.fallbacks == 0, bw.fallback_reasons
    assert not any(e.outputs.held() for e in fw.saved.pending)  # every activation let go


def test_the_pair_sees_an_overwritten_activation_without_the_block(stand_ins, monkeypatch) -> None:
    """The pair can fail too: with the block turned off, the second forward's replay overwrites
    the first's activations, which the backward graph reads in place: a wrong gradient."""
    fw, bw = _pair()
    monkeypatch.setattr(fw.saved, "blocks", lambda entry: False)
    w = torch.randn(6, 6, requires_grad=True)
    xs = [torch.randn(4, 6) for _ in range(2)]
    for _ in range(2):
        sum(_Pair.apply(fw, bw, x, w).square().sum() * (k + 1) for k, x in enumerate(xs)).backward()
        got, w.grad = w.grad, None
    w_ref = w.detach().clone().requires_grad_()
    sum((torch.tanh(x @ w_ref) * 2).square().sum() * (k + 1) for k, x in enumerate(xs)).backward()
    assert not torch.allclose(got, w_ref.grad)


def test_two_blocks_each_called_twice_forward_and_backward(stand_ins) -> None:
    """Regional compilation through the pair: two blocks (one runtime each way, a set per
    block's weights), the model run twice before one backward: four forward graphs (two
    copies) and four backward sets, every call replayed, gradients equal eager's."""
    fw, bw = _pair()
    _two_blocks_run_twice(lambda x, w: _Pair.apply(fw, bw, x, w))
    assert fw.instances == 2 and fw.stats.captures == 4 and fw.copies == 2
    assert bw.instances == 4 and bw.stats.captures == 4
    assert fw.stats.fallbacks == 0 and bw.stats.fallbacks == 0, (fw.fallback_reasons, bw.fallback_reasons)


def test_a_retained_graph_backward_again_after_another_forward(stand_ins) -> None:
    """``loss.backward(retain_graph=True)``, another call of the same graph, then
    ``loss.backward()`` again: the first backward's read does not free the activations (autograd
    keeps them for the second), so the other call replays a copy, and both backwards read the
    first call's values. Before, a backward's read marked them consumed and that call's replay
    overwrote them."""
    fw, bw = _pair()
    w = torch.randn(6, 6, requires_grad=True)
    x, x2 = torch.randn(4, 6), torch.randn(4, 6)
    loss = _Pair.apply(fw, bw, x, w).square().sum()
    loss.backward(retain_graph=True)
    _Pair.apply(fw, bw, x2, w).sum().backward()  # another call while the first is retained
    loss.backward()
    w_ref = w.detach().clone().requires_grad_()
    (2 * (torch.tanh(x @ w_ref) * 2).square().sum() + (torch.tanh(x2 @ w_ref) * 2).sum()).backward()
    torch.testing.assert_close(w.grad, w_ref.grad)


def test_micro_batches_each_with_its_backward_replay_one_graph(stand_ins) -> None:
    """The common case: each call's backward runs before the next call, and autograd lets its
    activations go: one forward graph and one backward graph serve every call, no copy."""
    fw, bw = _pair()
    w = torch.randn(6, 6, requires_grad=True)
    for step in range(3):
        xs = [torch.randn(4, 6) for _ in range(3)]
        for x in xs:
            _Pair.apply(fw, bw, x, w).square().sum().backward()
        w_ref = w.detach().clone().requires_grad_()
        for x in xs:
            (torch.tanh(x @ w_ref) * 2).square().sum().backward()
        torch.testing.assert_close(w.grad, w_ref.grad, msg=lambda m: f"step {step}: {m}")
        w.grad = None
    assert fw.stats.captures == 1 and fw.copies == 0 and bw.stats.captures == 1
    assert fw.stats.fallbacks == 0 and bw.stats.fallbacks == 0


def test_blocks_gathered_at_each_others_addresses_stop_being_captured(stand_ins) -> None:
    """FSDP2 with ``reshard_after_forward=True`` (two H200s): each step gathers block 0's
    parameters at new memory and, after block 0 frees them, block 1's at the same addresses. The
    runtime's fast path saw block 1 at the current set's addresses and replayed block 0's graphs
    without a switch, correctly, but the set never learnt those were not its own tensors'
    replays: block 0's next move counted as a weight swapped in after graphs that paid off, and
    block 0 was captured anew at every step for good (``test_fsdp2_blocks_compiled_one_by_one
    _equal_eager[True]``: +2 captures a step). Now another tensor at the same addresses switches
    (the set learns it is not its own), block 0 runs "moving" and the captures stop. The
    stand-in graphs read block 0's parameter object, which here shares the gathered memory with
    block 1's, so every output is checked against eager too."""
    from torchreplay.pieces.instances import MAX_MOVES, MOVING

    rt = _forward_runtime(max_graphs=64)
    full = [torch.randn(6, 6) for _ in range(2)]
    blocks = [torch.nn.Parameter(torch.empty(6, 6)) for _ in range(2)]
    captures = []
    for step in range(4 * MAX_MOVES + 4):
        gathered = torch.empty(6, 6)  # this step's memory, block 0's, then block 1's
        for w, f in zip(blocks, full):
            w.data = gathered
            gathered.copy_(f)
            x = torch.randn(4, 6)
            if not rt._ready:
                rt._setup((x, w), torch.device("cpu"))
            y, _ = rt(x, w)
            torch.testing.assert_close(y, torch.tanh(x @ f) * 2, msg=lambda m: f"step {step}: {m}")
        captures.append(rt.stats.captures)
    assert captures[-1] == captures[-5], captures
    assert rt.fallback_reasons.get(MOVING, 0) >= 4, rt.fallback_reasons


def test_a_new_tensor_object_each_call_over_the_same_memory_replays_one_capture(stand_ins) -> None:
    """The fast path's identity check (another tensor at the current set's addresses switches)
    with a caller that passes a new tensor object over the same weights at every call (a
    ``detach()``): each call switches to the one set it finds there and replays it; nothing is
    captured again and no call runs ungraphed."""
    rt = _forward_runtime(max_graphs=16)
    w = torch.randn(6, 6)
    for call in range(6):
        x = torch.randn(4, 6)
        view = w.detach()
        if not rt._ready:
            rt._setup((x, view), torch.device("cpu"))
        y, _ = rt(x, view)
        torch.testing.assert_close(y, torch.tanh(x @ w) * 2, msg=lambda m: f"call {call}: {m}")
    assert rt.stats.captures == 1 and rt.stats.replays == 6, rt.stats
    assert rt.stats.fallbacks == 0 and rt.instances == 1, rt.fallback_reasons
