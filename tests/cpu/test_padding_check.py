"""tr.graph(sizes=) reports at construction a callable whose padded calls would differ from eager
(a reduction across the rows), and stays quiet for one whose rows are independent, one that
masks its padding, and one it cannot compare like with like (sizes/probe.py). On the CPU, with the
eager stand-in for graphs of tests/cpu/test_buckets.py."""

from __future__ import annotations

import logging
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import torchreplay as tr
from torchreplay.sizes import probe as probing
from torchreplay.core import padcheck
from torchreplay.core.padcheck import padding_difference
from torchreplay.breaks.sized import check_padding, output_dims, padding_sample
from torchreplay.core.args import CallArgs
from torchreplay.sizes.plan import plan_inputs

import test_buckets

SIZES = [4, 8, 16]


@pytest.fixture
def cpu_graphs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    return test_buckets.install_cpu_graphs(monkeypatch.setattr)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and "padding changes what the call returns" in r.getMessage()]


def _centre(x: torch.Tensor) -> torch.Tensor:
    return x - x.mean(0)  # every row reads the others: padding rows pull the mean to 0


@pytest.mark.parametrize("rows", [3, 8, 16, 20], ids=["sample below", "sample a size", "sample the largest", "sample above"])
def test_a_reduction_across_the_rows_is_reported_with_the_output_rows_and_fix(
    cpu_graphs: list[int], caplog: pytest.LogCaptureFixture, rows: int,
) -> None:
    caplog.set_level(logging.DEBUG, logger="torchreplay")
    g = tr.graph(_centre, torch.randn(rows, 5) + 3.0, sizes=SIZES)
    (message,) = _warnings(caplog)
    real = rows if rows < 16 else 8  # at or above the largest: the next size's rows, padded
    assert f"output of a call of {real} rows" in message
    assert "padded to 16" in message and "relative difference" in message
    assert "fill_value=" in message and "list every size" in message
    assert "'_centre'" in message
    assert g.stats.padding_check.startswith(f"CHANGES the result: output of {real} rows padded to 16")
    assert "padding check: CHANGES" in g.stats.explain()
    x = torch.randn(16, 5)
    assert torch.allclose(g(x), _centre(x), atol=1e-5)  # an exact size is not padded


def test_an_output_reduced_over_the_rows_is_reported(cpu_graphs: list[int],
                                                     caplog: pytest.LogCaptureFixture) -> None:
    def fn(x):
        y = x * 2
        return y, y.mean()  # the mean sees the padding rows: not varying, compared whole

    tr.graph(fn, torch.randn(3, 4) + 1.0, sizes=SIZES)
    (message,) = _warnings(caplog)
    assert "output[1]" in message


def test_row_independent_callables_are_not_reported(cpu_graphs: list[int],
                                                    caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(5, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3)).eval()
    graphs = [
        tr.graph(mlp, torch.randn(3, 5), sizes=SIZES),
        tr.graph(lambda x: x.sum(0), torch.randn(3, 5), sizes=SIZES),  # a sum over zero rows: correct
        tr.graph(lambda x: x.softmax(-1), torch.randn(16, 5), sizes=SIZES),  # across columns
    ]
    assert _warnings(caplog) == []
    for g, rows in zip(graphs, (3, 3, 8)):
        assert g.stats.padding_check.startswith(f"rows independent: {rows} rows padded to 16, largest difference")
    assert tr.graph(lambda x: x * 2, torch.randn(1, 2), sizes=[1]).stats.padding_check == (
        "not checked: no call is padded (one row at every size)")


def test_a_callable_that_masks_its_padding_is_not_reported(cpu_graphs: list[int],
                                                           caplog: pytest.LogCaptureFixture) -> None:
    def pooled(x, mask):  # a masked mean over the rows: the padding rows' mask is the fill, 0
        w = mask[:, None]
        return (x * w).sum(0) / w.sum(0), x * 3

    x, mask = torch.randn(5, 4), torch.ones(5)
    g = tr.graph(pooled, x, mask, sizes=SIZES)
    assert _warnings(caplog) == []
    for n in (5, 3, 11):
        x, mask = torch.randn(n, 4), torch.ones(n)
        assert torch.allclose(g(x, mask)[0], pooled(x, mask)[0], atol=1e-5)
    caplog.clear()
    tr.graph(lambda x, mask: x.mean(0), x, mask, sizes=SIZES)  # the mask unused: reported
    assert len(_warnings(caplog)) == 1


def test_each_probe_call_starts_from_the_callers_state(cpu_graphs: list[int],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    class Counting(nn.Module):
        """Row-independent, but each call advances a position the output depends on."""

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("pos", torch.zeros(()))

        def forward(self, x):
            out = x + self.pos
            self.pos.add_(1.0)
            return out

    m = Counting()
    g = tr.graph(m, torch.randn(3, 4), sizes=SIZES)
    assert _warnings(caplog) == []  # the unpadded call saw the same position as the padded one
    assert g.stats.padding_check.startswith("rows independent")
    assert m.pos.item() == 0.0
    x = torch.randn(5, 4)
    assert torch.equal(g(x), x) and m.pos.item() == 1.0
    # Without the state put back (restore_state=False) the calls would compare unlike states:
    # not checked, and not reported.
    g = tr.graph(Counting(), torch.randn(3, 4), sizes=SIZES, config=tr.config.GraphConfig(restore_state=False))
    assert _warnings(caplog) == []
    assert g.stats.padding_check == "not checked: it writes a buffer (restore_state=False)"


def test_calls_it_cannot_compare_are_skipped_with_a_debug_line(cpu_graphs: list[int],
                                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="torchreplay")
    g = tr.graph(lambda x: _centre(x) + torch.rand_like(x), torch.randn(3, 4), sizes=SIZES)
    assert g.stats.padding_check == "not checked: it draws random numbers"
    assert _warnings(caplog) == []
    assert any("padding not checked: it draws random numbers" in r.getMessage() for r in caplog.records)

    def writes(x):
        x.mul_(2.0)
        return _centre(x)

    # an argument written in place no longer skips the check: each call starts from the same
    # argument (its buffer put back in between), and its written rows are compared too
    caplog.clear()
    x = torch.randn(3, 4)
    want = x.clone()
    g = tr.graph(writes, x, sizes=SIZES)
    assert len(_warnings(caplog)) == 1 and g.stats.padding_check.startswith("CHANGES the result: output")
    assert torch.equal(x, want)  # the build wrote nothing into the caller's sample


def test_the_check_adds_one_eager_call_at_most(cpu_graphs: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int | None]] = []  # (size, real rows padded to it) of each probe call
    real_args_at = probing.args_at

    def recording(inputs, plan, big, s, rows=None):
        calls.append((s, rows))
        return real_args_at(inputs, plan, big, s, rows)

    monkeypatch.setattr(probing, "args_at", recording)

    def probed(rows: int) -> list[tuple[int, int | None]]:
        calls.clear()
        tr.graph(lambda x: x * 2, torch.randn(rows, 2), sizes=SIZES)
        return list(calls)

    assert probed(3) == [(16, None), (8, None), (3, None)]  # the sample unpadded
    assert probed(8) == [(16, None), (8, None)]  # the sample is the next size: its probe is unpadded
    assert probed(16) == [(16, None), (8, None), (16, 8)]  # the next size's rows padded to the largest


def test_padding_difference() -> None:
    a = torch.randn(6, 3)
    assert padding_difference(a, a.clone()) == 0.0
    b = a.clone()
    b[0, 0] += 1.0
    assert padding_difference(b, a) == pytest.approx(1.0 / a.norm().item(), rel=1e-5)
    assert padding_difference(torch.ones(3), torch.zeros(3)) == 1.0  # all zeros: the RMS instead
    assert padding_difference(torch.full((4,), 1e-7), torch.zeros(4)) == pytest.approx(1e-7)
    nan = a.clone()
    nan[1, 1] = float("nan")
    assert padding_difference(nan, a) == math.inf
    assert padding_difference(a, nan) == math.inf
    assert padding_difference(nan, nan.clone()) == 0.0  # the same non-finite places: compared past them
    half = a.to(torch.bfloat16)
    assert padding_difference(half, half.clone()) == 0.0


def test_padding_difference_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = torch.randn(10, 7), torch.randn(10, 7)
    whole = padding_difference(a, b)
    monkeypatch.setattr(padcheck, "_CHUNK", 4)
    assert padding_difference(a, b) == pytest.approx(whole, rel=1e-6)
    b[9, 6] = float("inf")
    assert padding_difference(a, b) == math.inf


def test_a_breakable_graphs_check_compares_its_padded_captures_real_rows(caplog: pytest.LogCaptureFixture) -> None:
    def fn(x, lengths):
        return x, x * 2

    x = torch.randn(3, 4)
    plan = plan_inputs(CallArgs(fn, (x, torch.tensor([1, 2, 3])), {}), 0, 0)
    out = (x.clone(), x * 2)
    assert padding_sample("fn", out, plan, None, False) is None  # no sizes
    filled = padding_sample("fn", out, plan, [2, 3], False)
    assert filled.summary == "not checked: the sample fills the largest size"
    assert padding_sample("fn", out, plan, [4, 8], True).summary == "not checked: it draws random numbers"
    unpadded = padding_sample("fn", out, plan, [4, 8], False)
    assert [p for p, _ in unpadded.outputs] == ["output[0]", "output[1]"]
    padded = [torch.cat([x, torch.zeros(5, 4)]), torch.cat([x * 2, torch.ones(5, 4)])]
    summary = check_padding("fn", unpadded, padded, 8, state_ptrs=set())
    assert summary == "rows independent: 3 rows padded to 8, largest difference 0 (output[0]; tolerance 0.001)"
    assert _warnings(caplog) == []  # the padding rows differ, the real rows do not
    padded[1][0, 0] += 10.0
    check_padding("fn", unpadded, padded, 8, state_ptrs={padded[1].untyped_storage().data_ptr()})
    assert _warnings(caplog) == []  # module state or an argument: not compared
    check_padding("fn", unpadded, padded, 8, state_ptrs=set())
    (message,) = _warnings(caplog)
    assert "output[1] of a call of 3 rows" in message and "a break gets the padded rows" in message


def test_output_dims_of_a_breakable_graph() -> None:
    seen = [(3, [(3, 5), (7,), None]), (8, [(8, 5), (7,), None]), (4, [(4, 5), (7,), None])]
    assert output_dims(seen, 3) == (0, None, None)


def test_the_leading_rows_of_a_buffer_are_an_output_dim_of_a_breakable_graph() -> None:
    """``buf[:n]`` of an 8-row buffer at sizes 4, 8, 16 (the sample at 3): 3, 4, 8 and 8 rows,
    the size clamped at 8. A fixed length of 8 seen only at sizes of 8 and more is not a dim:
    nothing shows it follows the size."""
    clamped = [(3, [(3, 4)]), (16, [(8, 4)]), (8, [(8, 4)]), (4, [(4, 4)])]
    assert output_dims(clamped, 1) == (0,)
    fixed = [(8, [(8, 4)]), (16, [(8, 4)])]
    assert output_dims(fixed, 1) == (None,)
    fixed_below = [(3, [(8, 4)]), (16, [(8, 4)])]
    assert output_dims(fixed_below, 1) == (None,)


def test_an_output_whose_shape_padding_changes_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    """A padded output whose real rows have another shape than the unpadded call's (no
    dimension of it cut back to the call's rows) is reported, never compared as equal or left
    out. The leading rows of an 8-row buffer at size 16 (8 rows) against the sample's 3 are cut
    to 3 and compared."""
    def fn(x):
        return x, x.sum(0, keepdim=True)

    x = torch.randn(3, 4)
    unpadded = padding_sample("fn", list(fn(x)), plan_inputs(CallArgs(fn, (x,), {}), 0, 0), SIZES, False)
    assert check_padding("fn", unpadded, [torch.cat([x, torch.zeros(5, 4)]), x.sum(0, keepdim=True)], 8,
                         state_ptrs=set()).startswith("rows independent")
    assert _warnings(caplog) == []
    summary = check_padding("fn", unpadded, [torch.cat([x, torch.zeros(5, 4)]), torch.zeros(2, 4)], 8,
                            state_ptrs=set())
    assert summary == "CHANGES the shape: output[1] of 3 rows padded to 8 is (2, 4), unpadded (1, 4)", summary
    (message,) = _warnings(caplog)
    assert "has shape (2, 4) where the same call unpadded returns (1, 4)" in message


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is absent")
def test_under_torch_distributed_the_check_makes_no_call_of_its_own(
    cpu_graphs: list[int], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ranks' samples may differ in rows: an extra call made on one rank and not another
    would hang a collective inside it."""
    from ranks import free_port

    caplog.set_level(logging.DEBUG, logger="torchreplay")
    calls: list[tuple[int, int | None]] = []
    real_args_at = probing.args_at
    monkeypatch.setattr(probing, "args_at", lambda inputs, plan, big, s, rows=None: (
        calls.append((s, rows)), real_args_at(inputs, plan, big, s, rows))[1])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        tr.graph(_centre, torch.randn(3, 5) + 3.0, sizes=SIZES)
    finally:
        dist.destroy_process_group()
    assert calls == [(16, None), (8, None)]  # the two probe calls every rank makes
    assert _warnings(caplog) == []
    assert any("padding not checked: torch.distributed is set up" in r.getMessage() for r in caplog.records)


class _FakeRuntime:
    """What pieces/padding.py reads of a PiecewiseRuntime, over a plain function of one varying
    tensor and its size: "replaying" size ``s`` runs it on the rows padded with zeros to ``s``,
    and hands back the real rows."""

    def __init__(self, fn, sizes, *, written=False, grad=False):
        from torchreplay.pieces.program import Input
        from torchreplay.stats import GraphStats

        self.fn, self.sizes, self.name, self.saved = fn, sizes, "graph 0", None
        self.device = torch.device("cpu")
        self.stats = GraphStats()
        self.program = type("P", (), {})()
        self.program.inputs = [Input("x", "tensor", dim=0, written=written, fill=0), Input("n", "int", is_size=True)]
        self._sized, self._size_ints = [0], [1]
        self.runs: list[tuple[str, int, int]] = []

    def rows(self, args):
        return args[0].shape[0]

    def _run_ungraphed(self, args):
        x, n = args
        assert n == x.shape[0]  # the size int follows the rows
        self.runs.append(("ungraphed", x.shape[0], n))
        return (self.fn(x),)

    def _route(self, args, size):
        return size

    def _replay(self, size, args):
        x, _ = args
        self.stats.replays += 1
        padded = torch.cat([x, torch.zeros(size - x.shape[0], *x.shape[1:])])
        self.runs.append(("replay", x.shape[0], size))
        return (self.fn(padded)[: x.shape[0]],)


@pytest.mark.parametrize("rows", [3, 8], ids=["padded first call", "first call at the largest"])
def test_the_compile_backends_first_call_check(caplog: pytest.LogCaptureFixture, rows: int) -> None:
    from torchreplay.pieces.padding import check_first_call

    resets: list[int] = []
    rt = _FakeRuntime(lambda x: x - x.mean(0), [2, 4, 8])
    x = torch.randn(rows, 3) + 2.0
    check_first_call(rt, (x, rows), lambda: resets.append(1))
    real = rows if rows < 8 else 4  # the leading rows, as many as the next size down
    assert rt.runs == [("ungraphed", real, real), ("replay", real, 8)]
    assert len(resets) == 2  # each run from the state the call found
    assert rt.stats.replays == 0  # the check's replay is no call of the caller's
    assert rt.stats.padding_check.startswith(f"CHANGES the result: output 0 of {real} rows padded to 8")
    (message,) = _warnings(caplog)
    assert "(x along dim 0)" in message and "x: 0" in message

    rt = _FakeRuntime(lambda x: x * 2, [2, 4, 8])
    check_first_call(rt, (x, rows), lambda: None)
    assert rt.stats.padding_check.startswith(f"rows independent: {real} rows padded to 8")


def test_the_compile_backends_first_call_check_compares_state(caplog: pytest.LogCaptureFixture) -> None:
    """What the unpadded run and the padded replay leave in the tensors the graphs read in place:
    a count that follows the padded size is a warning, the padding rows' own cache rows a note."""
    from torchreplay.pieces.padding import check_first_call

    caplog.set_level(logging.DEBUG, logger="torchreplay")
    seen, cache = torch.zeros((), dtype=torch.long), torch.full((8, 3), -1.0)
    start = seen.clone(), cache.clone()

    def fn(x):
        seen.add_(x.shape[0])
        cache[: x.shape[0]] = x
        return x * 2

    def reset():
        seen.copy_(start[0])
        cache.copy_(start[1])

    rt = _FakeRuntime(fn, [2, 4, 8])
    check_first_call(rt, (torch.randn(3, 3), 3), reset, [("self.seen", seen), ("self.cache", cache)])
    summary = rt.stats.padding_check
    assert summary.startswith("CHANGES state: self.seen: 1 of the 1 elements both write differ"), summary
    assert "the padding rows also write self.cache (15 elements)" in summary, summary
    (message,) = _state_warnings(caplog)
    assert "self.seen" in message and "self.cache" not in message


def test_the_compile_backends_first_call_check_skips() -> None:
    from torchreplay.pieces.padding import check_first_call

    x = torch.randn(3, 2)
    rt = _FakeRuntime(lambda x: x, [4, 8], written=True)
    check_first_call(rt, (x, 3), lambda: None)
    assert rt.stats.padding_check == "not checked: it writes an argument" and rt.runs == []
    rt = _FakeRuntime(lambda x: x + torch.rand_like(x), [4, 8])
    check_first_call(rt, (x, 3), lambda: None)
    assert rt.stats.padding_check == "not checked: it draws random numbers"
    assert [r[0] for r in rt.runs] == ["ungraphed"]
    rt = _FakeRuntime(lambda x: x, [4, 8])
    with torch.enable_grad():
        check_first_call(rt, (x.requires_grad_(), 3), lambda: None)
    assert rt.stats.padding_check == "not checked: the call needs gradients"

    def raises(x):
        raise RuntimeError("only at 4 rows")

    rt = _FakeRuntime(raises, [4, 8])
    check_first_call(rt, (torch.randn(8, 2), 8), lambda: None)
    assert rt.stats.padding_check == "not checked: its run at 4 rows raised RuntimeError"
    rt = _FakeRuntime(lambda x: x, [8])  # one size: a first call of 8 rows has nothing to compare
    check_first_call(rt, (torch.randn(8, 2), 8), lambda: None)
    assert rt.stats.padding_check == "not checked: the first call fills the largest size"


def test_put_back_restores_tensors_versions_and_rng() -> None:
    """pieces/putback.py: around a first call's captures and padding check."""
    from torchreplay.pieces.putback import put_back

    buf = torch.arange(4.0)
    version = buf._version
    rng = torch.get_rng_state()
    with put_back([("buf", buf)], torch.device("cpu")) as restore:
        buf.add_(10.0)
        torch.rand(3)
        restore()  # a run inside starts from the state found
        assert torch.equal(buf, torch.arange(4.0))
        buf.mul_(3.0)
    assert torch.equal(buf, torch.arange(4.0)) and buf._version == version
    assert torch.equal(torch.get_rng_state(), rng)
    with pytest.raises(RuntimeError, match="boom"):
        with put_back([("buf", buf)], torch.device("cpu")):
            buf.fill_(7.0)
            raise RuntimeError("boom")
    assert torch.equal(buf, torch.arange(4.0))  # put back on the way out of an error too


def test_what_a_compile_piece_copies_to_reset_before_each_warm_up() -> None:
    """pieces/putback.py: every tensor a piece writes, but with restore_state=False not a module
    buffer over 1 MiB (a KV cache; it keeps what each warm-up writes)."""
    from types import SimpleNamespace as NS

    from torchreplay.config import GraphConfig
    from torchreplay.pieces.program import Input
    from torchreplay.pieces.putback import reset_copies

    inputs = (Input("self.cache", "static"), Input("x", "tensor"), Input("self.seen", "static"))
    big, small, other = torch.randn(1 << 19), torch.randn(4), torch.randn(1 << 19)  # 2 MiB, 16 bytes
    for restore in (True, False):
        rt = NS(_inputs=inputs, config=GraphConfig(restore_state=restore), name="Net", device=torch.device("cpu"),
                _putback=None)
        kept = reset_copies(rt, [(0, big), (1, other), (2, small), (5, other), (1, 3)])
        cache = [big] if restore else []
        assert [id(t) for t, _ in kept] == [id(t) for t in cache + [other, small, other]]
        assert all(torch.equal(t, c) and t is not c for t, c in kept)


def test_a_piece_reset_starts_from_the_put_backs_copy_while_nothing_wrote_the_tensor() -> None:
    """A written cache the first call's put-back copied is not copied again for a piece's
    reset while no piece wrote it since (held twice, not three times); once written, a copy of
    its own; after the put-back writes its copies back, its copy again."""
    from types import SimpleNamespace as NS

    from torchreplay.config import GraphConfig
    from torchreplay.pieces.program import Input
    from torchreplay.pieces.putback import put_back, reset_copies

    cache, x = torch.randn(1 << 19), torch.randn(4)
    start = cache.clone()
    rt = NS(_inputs=(Input("self.cache", "static"), Input("x", "tensor")), config=GraphConfig(),
            name="Net", device=torch.device("cpu"), _putback=None)
    with put_back([("self.cache", cache)], torch.device("cpu")) as restore:
        rt._putback = restore
        (c, init), (_, own) = reset_copies(rt, [(0, cache), (1, x)])
        assert c is cache and init is restore.copy_of(cache) and torch.equal(init, start)
        assert own is not x and torch.equal(own, x)
        cache.add_(1.0)
        restore.wrote([cache])
        ((c, init),) = reset_copies(rt, [(0, cache)])
        assert init is not restore.copy_of(cache) is None and torch.equal(init, start + 1.0)
        restore()
        assert torch.equal(cache, start)
        ((c, init),) = reset_copies(rt, [(0, cache)])
        assert torch.equal(init, start) and init is restore.copy_of(cache)


def test_a_breakable_graphs_report() -> None:
    """breaks/report.py over a stand-in graph: breaks, their reads, segments, sizes, stats."""
    from types import SimpleNamespace as NS

    from torchreplay.breaks.report import report
    from torchreplay.stats import GraphStats

    stats = GraphStats()
    stats.padding_check = "rows independent: 3 rows padded to 8, largest difference 0"
    target = object()
    rule = NS(path="args[1] 'lengths'", kind="rebound", source="the call")
    rec = NS(brk=NS(name="Attention", target=target), where="model.py:12", rules=[rule])
    entry = NS(graphs=[NS(graph=None, copies=[]), None,
                       NS(graph=object(), copies=[(0, object()), (1, object())], nodes={0: object()})])
    rt = NS(_entries={1: entry}, captured_sizes=lambda: [4, 8], fallback_reasons={"a size above 8": 2})

    class Graph(NS):
        def __repr__(self) -> str:
            return "BreakableGraph(model)"

    g = Graph(runtime=rt, auto=[NS(module=target, op="aten.nonzero", kind="data-dependent", where="m.py:3")],
              breaks=[rec], stats=stats)
    lines = report(g).splitlines()
    assert lines[0] == "BreakableGraph(model)"
    assert lines[1] == "  break 0: Attention at model.py:12 (auto: aten.nonzero (data-dependent) at m.py:3)"
    assert lines[2] == "    reads: args[1] 'lengths' rebound from the call"
    assert lines[3] == ("    its 2 tensor output(s) go into segment 1: 1 by its own copy nodes, 1 by one "
                        "launch (none if in place)")
    assert lines[4] == "  segments: 2 per size, 2 size(s) [4, 8] (1 empty segment(s) replay nothing)"
    assert "padding check: rows independent" in lines[5]
    assert lines[6] == "  ran ungraphed 2x: a size above 8"


# -- what the two calls leave in state: module buffers, arguments written in place ---------------


class _Cache(nn.Module):
    """A per-row cache written at each call's rows (the gpt-fast layout: a batch of n rows uses
    rows 0..n-1): padded, the padding rows write rows n.. too, which eager leaves alone."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("rows", torch.full((16, 4), -1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows[: x.shape[0]] = x * 2.0
        return x * 2.0


class _Counted(nn.Module):
    """Counts the rows it has seen: padded, it counts the padding rows too."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += x.shape[0]
        return x + 1.0


class _Slots(nn.Module):
    """Writes each row into a sequence cache at its position: a position padded with 0 writes
    slot 0, over the real row at position 0."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(16, 4))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(0, pos, x)
        return x * 3.0


def _state_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and "padding changes the state" in r.getMessage()]


def test_padding_rows_writing_state_of_their_own_is_a_note_not_a_warning(
    cpu_graphs: list[int], caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="torchreplay")
    m = _Cache()
    g = tr.graph(m, torch.randn(3, 4), sizes=SIZES)
    assert _warnings(caplog) == [] and _state_warnings(caplog) == []
    summary = g.stats.padding_check
    assert summary.startswith("rows independent: 3 rows padded to 16"), summary
    # rows 3..15, written by the padded call only
    assert "the padding rows also write _Cache.rows (52 elements)" in summary, summary
    assert torch.equal(m.rows, torch.full((16, 4), -1.0))  # the build put it back


def test_a_count_that_follows_the_padded_size_is_reported(cpu_graphs: list[int],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="torchreplay")
    m = _Counted()
    g = tr.graph(m, torch.randn(3, 4), sizes=SIZES)
    assert _warnings(caplog) == []  # the outputs are right
    (message,) = _state_warnings(caplog)
    assert "_Counted.seen: 1 of the 1 elements both write differ" in message, message
    assert "fill_value=" in message and "list every size" in message
    assert g.stats.padding_check.startswith("CHANGES state: _Counted.seen"), g.stats.padding_check
    assert int(m.seen) == 0
    g(torch.randn(4, 4))  # an exact size: counted as eagerly
    assert int(m.seen) == 4


def test_a_padded_position_writing_over_a_real_slot_is_reported(cpu_graphs: list[int],
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="torchreplay")
    m = _Slots()
    g = tr.graph(m, torch.randn(3, 4) + 1.0, torch.arange(3), sizes=SIZES)
    (message,) = _state_warnings(caplog)
    assert f"'{type(m).__name__}' with sizes=: padding changes the state" in message
    # the padding rows wrote slot 0 with their fill value, 0, which it held before: as if only
    # the unpadded call wrote it
    assert "_Slots.cache: 4 elements only the unpadded call writes, first at [0, 0]" in message, message
    assert "CHANGES state: _Slots.cache" in g.stats.padding_check
    # positions padded past the real ones write slots of their own: only a note
    caplog.clear()
    g = tr.graph(_Slots(), torch.randn(3, 4) + 1.0, torch.arange(3), sizes=SIZES, fill_value={"x": 1.0, "pos": 15})
    assert _state_warnings(caplog) == []
    assert "the padding rows also write _Slots.cache (4 elements)" in g.stats.padding_check, g.stats.padding_check


def test_a_fixed_argument_the_call_writes_is_compared_as_state(cpu_graphs: list[int],
                                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="torchreplay")

    def step(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache[: x.shape[0]] = x
        return x * 2.0

    cache = torch.randn(16, 4)
    before = cache.clone()
    g = tr.graph(step, torch.randn(3, 4), cache, sizes=SIZES, dim={"x": 0, "cache": None})
    assert _warnings(caplog) == [] and _state_warnings(caplog) == []
    assert "the padding rows also write args[1] 'cache' (52 elements)" in g.stats.padding_check
    assert torch.equal(cache, before)  # the build left the caller's tensor alone

    def count(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        n += x.shape[0]
        return x + 1.0

    g = tr.graph(count, torch.randn(3, 4), torch.zeros((), dtype=torch.long), sizes=SIZES,
                 dim={"x": 0, "n": None})
    assert len(_state_warnings(caplog)) == 1
    assert g.stats.padding_check.startswith("CHANGES state: args[1] 'n'"), g.stats.padding_check

    # the same count kept in Python state (an object the function closes over): compared too
    class Box:
        pass

    box = Box()
    box.seen = torch.zeros((), dtype=torch.long)

    def counted(x: torch.Tensor) -> torch.Tensor:
        box.seen += x.shape[0]
        return x + 1.0

    caplog.clear()
    g = tr.graph(counted, torch.randn(3, 4), sizes=SIZES)
    assert len(_state_warnings(caplog)) == 1
    assert g.stats.padding_check.startswith("CHANGES state: box.seen: 1 of the 1 elements both write differ"), g.stats.padding_check
    assert int(box.seen) == 0


def test_written_rows_of_an_argument_are_compared_like_outputs(cpu_graphs: list[int],
                                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="torchreplay")

    def rows(x: torch.Tensor) -> torch.Tensor:
        x.mul_(2.0)
        return x.sum()  # (a reduction: not compared, its rows are gone)

    g = tr.graph(rows, torch.randn(3, 4), sizes=SIZES)
    assert _warnings(caplog) == [], _warnings(caplog)
    assert g.stats.padding_check.startswith("rows independent"), g.stats.padding_check

    def centred(x: torch.Tensor) -> torch.Tensor:
        x.sub_(x.mean(0))
        return x.new_ones(x.shape[0])  # (the same however padded: only the written rows differ)

    g = tr.graph(centred, torch.randn(3, 4) + 2.0, sizes=SIZES)
    (message,) = _warnings(caplog)
    assert "args[0] 'x' (written in place)" in message, message


def test_state_too_large_to_copy_is_named_not_compared(cpu_graphs: list[int], monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(padcheck, "copy_budget", lambda device: 64)  # the small state's copies
    caplog.set_level(logging.DEBUG, logger="torchreplay")
    g = tr.graph(_Counted(), torch.randn(3, 4), sizes=SIZES)  # 8 bytes: compared
    assert "CHANGES state: _Counted.seen" in g.stats.padding_check
    g = tr.graph(_Cache(), torch.randn(3, 4), sizes=SIZES)  # 256 bytes: not
    assert g.stats.padding_check.endswith("state not compared (over the copy budget, or large and not contiguous): _Cache.rows"), g.stats.padding_check
    g = tr.graph(_BigCache(), torch.randn(3, 512), sizes=SIZES)  # its fingerprints: 2 KiB
    assert g.stats.padding_check.endswith("state not compared (over the copy budget, or large and not contiguous): _BigCache.kv"), g.stats.padding_check


class _BigCache(nn.Module):
    """A 2 MiB per-row cache (over the 1 MiB of exact copies): compared by fingerprints."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("kv", torch.full((16, 64, 512), -1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.kv[: x.shape[0], 0] = x
        return x * 2.0


def test_large_state_is_compared_by_row_fingerprints_without_a_copy(cpu_graphs: list[int],
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="torchreplay")
    m = _BigCache()
    g = tr.graph(m, torch.randn(3, 512), sizes=SIZES)
    assert _state_warnings(caplog) == []
    # rows 3..15 of the first slot: 13 rows of 1024 (two of the last dimension, 512, taken
    # together), written by the padding only
    assert "the padding rows also write _BigCache.kv (13 rows of 1024)" in g.stats.padding_check, g.stats.padding_check
    assert torch.equal(m.kv, torch.full((16, 64, 512), -1.0))

    # a 2 MiB cache passed as an argument, written at padded positions: slot 0 both write
    def prefill(x: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(0, pos, x)
        return x + 1.0

    cache = torch.randn(1024, 512)
    before = cache.clone()
    g = tr.graph(prefill, torch.randn(3, 512), torch.arange(3), cache, sizes=SIZES,
                 dim={"x": 0, "pos": 0, "cache": None})
    (message,) = _state_warnings(caplog)
    assert "args[2] 'cache': " in message and "where both write" in message, message
    assert torch.equal(cache, before)
    # the same, the padding sent to a slot of its own: a note
    g = tr.graph(prefill, torch.randn(3, 512), torch.arange(3), cache, sizes=SIZES,
                 dim={"x": 0, "pos": 0, "cache": None}, fill_value={"pos": 1023})
    assert len(_state_warnings(caplog)) == 1
    assert "the padding rows also write args[2] 'cache' (1 rows of 1024)" in g.stats.padding_check, g.stats.padding_check
    # its fingerprint: a row rewritten with its own values keeps it, any other value changes it
    t = torch.randn(8, 512)
    f = padcheck.fingerprint(t)
    t[2] = t[2].clone()
    assert torch.equal(padcheck.fingerprint(t), f)
    t[2, 7] += 1e-3  # (a change within float32 rounding of the row sums, 1e-6, may not show)
    changed = (padcheck.fingerprint(t) != f).any(1)
    assert changed.tolist() == [False, True, False, False]  # (rows 2 and 3 taken together)


def test_what_the_first_call_copies_to_put_back() -> None:
    """``to_put_back``: what the graphs write (a large buffer not with restore_state=False),
    every small buffer (BatchNorm's statistics, which no fake run sees written), a large
    buffer only read never (quantized weights), a parameter only when written."""
    from torchreplay.pieces.putback import to_put_back

    small, large = torch.zeros(4), torch.zeros(1 << 19)  # (4 bytes each: 2 MiB)
    param = torch.nn.Parameter(torch.zeros(4))
    assert to_put_back(large, written=True, restore_state=True)
    assert not to_put_back(large, written=True, restore_state=False)
    assert not to_put_back(large, written=False, restore_state=True)
    assert to_put_back(small, written=False, restore_state=True)
    assert to_put_back(small, written=False, restore_state=False)
    assert not to_put_back(param, written=False, restore_state=True)
    assert to_put_back(param, written=True, restore_state=False)
