"""PyTorch's ``test/inductor/test_cudagraph_trees.py`` and vLLM's piecewise compile tests
(``tests/compile/piecewise/test_simple.py``, ``test_toy_llama.py``) ported to the torchreplay
backend (``tr.compile`` or ``torch.compile(backend=Backend())`` in place of
``mode="reduce-overhead"`` or vLLM's backend): their behaviours, compared with eager on fresh
random inputs, with exact counts from the runtimes' stats. ``xfail(strict=True)`` marks an
eager-equal behaviour our backend does not give yet; its reason says what is missing."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import torchreplay as tr
from torchreplay.compile.backend import Backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.usefixtures("fresh_dynamo"),
]

DEV = "cuda"
CALLS = 6
_UNSAFE_TAG = getattr(torch._C.Tag, "cudagraph_unsafe", None)
_UNSAFE = (_UNSAFE_TAG,) if _UNSAFE_TAG is not None else ()


def _close(a, b) -> None:
    torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)


def _mlp(width: int = 32) -> nn.Module:
    layers = [nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers).to(DEV).eval()


def _runtimes(c) -> list:
    return c.backend.runtimes if isinstance(c, tr.Compiled) else c.runtimes


def _total(c, counter: str) -> int:
    return sum(getattr(r.stats, counter) for r in _runtimes(c))


def _counts(rt) -> tuple[int, int, int]:
    return rt.stats.captures, rt.stats.replays, rt.stats.fallbacks


def _kinds(rt) -> list[bool]:
    return [p.graphed for p in rt.program.pieces]


def _eager_reasons(rt) -> list[str]:
    return [p.split.reason for p in rt.program.pieces if not p.graphed and p.split is not None]


def _value_or_stale(t: torch.Tensor, want: torch.Tensor) -> str:
    """``t`` holds ``want`` ("value"), or reading it raises StaleOutputError ("stale"); a kept
    output that silently holds another call's values fails."""
    try:
        same = torch.allclose(t, want, rtol=2e-3, atol=2e-3)
    except tr.StaleOutputError:
        return "stale"
    except RuntimeError as exc:
        assert "StaleOutputError" in str(exc), str(exc)
        return "stale"
    assert same, "a kept output silently holds another call's values"
    return "value"


# == custom ops: vLLM's silly attention and torch's cudagraph-unsafe ops ==========================

_ATTENTION_CALLS = [0]


@torch.library.custom_op("trported::attention", mutates_args=["out"])
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    _ATTENTION_CALLS[0] += 1  # counts eager runs: a captured run would not count on replay
    out.copy_(q + k + v)


_attention.register_fake(lambda q, k, v, out: None)


@torch.library.custom_op("trported::host_round_trip", mutates_args=(), tags=_UNSAFE)
def _host_round_trip(x: torch.Tensor) -> torch.Tensor:
    return ((x.cpu() + 1) * 2).to(x.device) / 255.0  # a copy to the host: uncapturable


_host_round_trip.register_fake(torch.empty_like)


@torch.library.custom_op("trported::modify", mutates_args=(), tags=_UNSAFE)
def _modify(x: torch.Tensor) -> torch.Tensor:
    return (((x + 1).cpu() + 1) * 2).to(x.device) + x


_modify.register_fake(torch.empty_like)


@torch.library.custom_op("trported::transform", mutates_args=())
def _transform(x: torch.Tensor) -> torch.Tensor:
    return (x + 1) * 2  # capturable: stays inside a graphed piece


_transform.register_fake(torch.empty_like)


# == kept outputs ==================================================================================


def _cube(x):
    return x * x * x


@pytest.mark.parametrize(
    "sizes, outputs", [(None, "checked"), ((4, 8), "checked"), ((4, 8), "clone")],
    ids=["shapes", "padded", "clone"],
)
def test_kept_outputs_hold_their_values_or_raise(sizes, outputs) -> None:
    # ports test_error_on_dealloc_use and test_error_on_dealloc_use2 (a detached output): there
    # reduce-overhead raises "overwritten by a subsequent run"; and outputs="clone" for
    # test_clone_live_output_on_new_generation (cudagraph_trees_generation_cloning)
    c = tr.compile(_cube, sizes=sizes, outputs=outputs)
    kept = []
    with torch.no_grad():
        for n in (5, 6, 7, 5, 8, 6):
            x = torch.randn(n, 16, device=DEV)
            out = c(x)
            kept.append((out, out.detach(), _cube(x)))
    seen = [_value_or_stale(t, want) for out, det, want in kept for t in (out, det)]
    assert seen[-2:] == ["value", "value"], seen  # nothing ran after the last call
    if outputs == "clone":
        assert seen == ["value"] * len(seen)
    assert _total(c, "fallbacks") == 0


def _cube_after_a_break(x):
    torch._dynamo.graph_break()
    return x * x * x


def _cube_twice(x):
    y = _cube_after_a_break(x)
    return y + _cube_after_a_break(y)


@pytest.mark.parametrize("outputs", ["checked", "clone"])
def test_the_same_graph_twice_in_one_step(outputs: str) -> None:
    # ports test_function_compiled_multiple_times. Cudagraph trees record a second node; ours
    # keeps one set of output buffers per graph, so under "checked" the first call's output,
    # read after the second call, raises StaleOutputError: loud, never another call's values.
    # "clone" equals eager.
    c = tr.compile(_cube_twice, outputs=outputs)
    raised = 0
    with torch.no_grad():
        for _ in range(CALLS):
            x = torch.randn(4, 4, device=DEV)
            try:
                got = c(x)
            except RuntimeError as exc:
                assert outputs == "checked" and "StaleOutputError" in str(exc), exc
                raised += 1
                continue
            _close(got, _cube_twice(x))
    assert raised == (CALLS if outputs == "checked" else 0)


# == data-dependent shapes: nonzero between two graphed pieces ===================================


class _Gather(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)

    def forward(self, x):
        h = self.a(x)
        idx = torch.nonzero(x[:, 0] > 0).squeeze(1)
        return h, self.b(h[idx])


def _signed(k: int) -> torch.Tensor:
    """8 fresh random rows, exactly ``k`` of them with a positive first column."""
    x = torch.randn(8, 32, device=DEV).abs()
    x[k:, 0] *= -1
    return x


def test_a_nonzero_count_that_changes_each_call() -> None:
    # ports test_incompatible_cudagraph_ops_nonzero (reduce-overhead skips graphs for it)
    model = _Gather().to(DEV).eval()
    counts = [3, 5, 3, 6, 3, 1]
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True), torch.no_grad():
        c = tr.compile(model)
        for k in counts:
            x = _signed(k)
            (h, y), (wh, wy) = c(x), model(x)
            _close(h, wh)
            _close(y, wy)
    (rt,) = _runtimes(c)
    assert _kinds(rt) == [True, False, True], tr.explain(c)
    assert "depends on the data" in _eager_reasons(rt)[0]
    assert rt.stats.replays == len(counts)
    # a call whose count differs from the captured one runs the rest ungraphed, counted once
    assert rt.stats.fallbacks == sum(k != counts[0] for k in counts)


def test_a_kept_output_of_an_ungraphed_call_holds_or_raises() -> None:
    # ports test_incompatible_cudagraph_ops_nonzero with test_error_on_dealloc_use's check
    model = _Gather().to(DEV).eval()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True), torch.no_grad():
        c = tr.compile(model)
        c(_signed(3))
        x = _signed(5)  # another count than at capture: its call finishes ungraphed
        kept, want = c(x)[0], model(x)[0]
        c(_signed(3))
        _value_or_stale(kept, want)


# == writes to arguments, buffers and parameters ==================================================


def _add_into(x, y):
    x.add_(y)
    return x * 2


def _write_slice(x, y):
    x[:2] = y[:2] * 3
    return x.sum(0) + y


def _kv_write(cache, new, pos):
    cache.index_copy_(0, pos, new)
    return cache.sum(0)


_WRITERS = {  # the function, and fresh random arguments for one call (on the CPU)
    "add_": (_add_into, lambda: (torch.randn(8, 16), torch.randn(8, 16))),
    "slice": (_write_slice, lambda: (torch.randn(8, 16), torch.randn(8, 16))),
    "index_copy_": (
        _kv_write, lambda: (torch.randn(16, 8), torch.randn(4, 8), torch.randperm(16)[:4])
    ),
}


@pytest.mark.parametrize("name", list(_WRITERS))
def test_a_model_writing_its_argument_is_graphed(name) -> None:
    # ports test_mutation_on_inp (and the slice and index_copy_ writes of a KV cache): there
    # reduce-overhead logs "skipping cudagraphs due to mutated inputs" and runs ungraphed
    fn, make = _WRITERS[name]
    c = tr.compile(fn)
    with torch.no_grad():
        for _ in range(CALLS):
            args = [a.to(DEV) for a in make()]
            mine = [a.clone() for a in args]
            _close(c(*mine), fn(*args))
            for got, want in zip(mine, args):
                _close(got, want)
    (rt,) = _runtimes(c)
    assert _counts(rt) == (1, CALLS, 0)
    first_arg = fn.__code__.co_varnames[0]  # the argument each writer writes
    assert any(first_arg in x.name for x in rt.program.inputs if x.written), tr.explain(c)


class _Stateful(nn.Module):
    def __init__(self, ema_is_a_parameter: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.bn = nn.BatchNorm1d(32)
        self.register_buffer("count", torch.zeros(()))
        if ema_is_a_parameter:
            self.ema = nn.Parameter(torch.zeros(32), requires_grad=False)
        else:
            self.register_buffer("ema", torch.zeros(32))

    def forward(self, x):
        self.count += 1
        self.ema.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return self.bn(self.lin(x)) * self.count + self.ema


@pytest.mark.parametrize("ema_is_a_parameter", [False, True], ids=["buffer", "parameter"])
def test_state_written_by_forward_follows_eager(ema_is_a_parameter) -> None:
    # ports test_mutation_on_inp's buffer half, test_tensor_constant_mutation, the BatchNorm
    # running statistics of test_multi_dispatch_single_compile_builtin_module_buffers and (a
    # parameter) test_input_storage_mutation_skips_cudagraphs, where reduce-overhead skips graphs
    model = _Stateful(ema_is_a_parameter).to(DEV).train()
    ref = copy.deepcopy(model)
    c = tr.compile(model)
    with torch.no_grad():
        for _ in range(CALLS):
            x = torch.randn(16, 32, device=DEV)
            _close(c(x), ref(x))
            for (name, got), want in zip(model.state_dict().items(), ref.state_dict().values()):
                assert torch.allclose(got.double(), want.double(), rtol=2e-3, atol=2e-3), name
    (rt,) = _runtimes(c)
    assert _counts(rt) == (1, CALLS, 0)


# == Dynamo graph breaks ===========================================================================


class _Breaks(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)

    def forward(self, x):
        y = self.a(x).relu()
        if self.how == "print":
            print("a print is a Dynamo graph break")
        elif self.how == "graph_break":
            torch._dynamo.graph_break()
        elif x.sum() > 0:  # data-dependent: a graph break, then one graph per branch
            y = y * 2
        return self.b(y) - 1 + y.mean()


@pytest.mark.parametrize("how", ["print", "graph_break", "data_if"])
def test_dynamo_graph_breaks(how) -> None:
    # ports test_end_recording_early, test_execution_into_recording,
    # test_live_outputs_multiple_graphs and test_accumulate_multiple_recordings; through
    # torch.compile(backend=Backend())
    model = _Breaks(how).to(DEV).eval()
    backend = Backend()
    cm = torch.compile(model, backend=backend)
    with torch.no_grad():
        for _ in range(CALLS):
            x = torch.randn(8, 32, device=DEV)
            _close(cm(x), model(x))
    runtimes = _runtimes(backend)
    assert len(runtimes) >= 2, tr.explain(backend)
    for r in runtimes:
        assert (r.stats.captures, r.stats.fallbacks) == (1, 0), tr.explain(backend)
    assert _total(backend, "replays") == 2 * CALLS  # the first graph, then one of the others


# == sizes: every batch size from one compile =====================================================


def test_capture_sizes_from_one_compile() -> None:
    # ports test_cudagraph_capture_sizes (cudagraph_capture_sizes=(2, 5, 7), batches 1..9: 3
    # graphs) and test_graph_partition_dynamic_shapes
    model = _mlp()
    c = tr.compile(model, sizes=[2, 5, 7])
    with torch.no_grad():
        for b in range(1, 10):
            for _ in range(2):
                x = torch.randn(b, 32, device=DEV)
                _close(c(x), model(x))
    assert c.backend.compiles == 1, tr.explain(c)
    (rt,) = _runtimes(c)
    assert rt.captured_sizes() == [2, 5, 7] and rt.stats.captures == 3
    assert rt.stats.size_hits == {2: 4, 5: 6, 7: 4}
    assert rt.stats.fallbacks == 4  # 8 and 9 rows, twice each: above the largest size


def test_a_first_call_above_one_row_then_one_row_is_one_compile() -> None:
    # ports test_cudagraph_capture_sizes in another order: a first batch of 4, later batches of 1
    # (the first call is traced size-oblivious, so Dynamo does not guard the size >= 2)
    model = _mlp()
    c = tr.compile(model, sizes=[1, 2, 4, 8])
    with torch.no_grad():
        for b in (4, 1, 3, 8, 2, 1):
            x = torch.randn(b, 32, device=DEV)
            _close(c(x), model(x))
    assert c.backend.compiles == 1, tr.explain(c)
    (rt,) = _runtimes(c)
    assert rt.captured_sizes() == [1, 2, 4, 8] and rt.stats.replays == 6, tr.explain(c)


# == partitions: what a graph cannot hold runs eagerly between graphed pieces =====================


def _cpu_trip(x, y):
    x1, y1 = x + 1, y + 1
    y_cpu = y1.cpu() + 1
    z = x @ y
    return x1 + y1 + z + y_cpu.to(x.device)


def test_a_round_trip_through_the_cpu_is_an_eager_piece() -> None:
    # ports test_graph_partition (reduce-overhead without graph partition skips the whole graph)
    c = tr.compile(_cpu_trip)
    with torch.no_grad():
        for _ in range(CALLS):
            x, y = torch.randn(16, 16, device=DEV), torch.randn(16, 16, device=DEV)
            _close(c(x, y), _cpu_trip(x, y))
    (rt,) = _runtimes(c)
    assert _kinds(rt) == [True, False, True, False, True], tr.explain(c)
    assert all("host" in r or "CPU" in r for r in _eager_reasons(rt)), tr.explain(c)
    assert _counts(rt) == (3, CALLS, 0)


def _count_above(x):
    y = x.relu()
    k = (y > 0.1).sum().item()
    return y * 2, k


def test_item_is_an_eager_piece() -> None:
    # ports test_incompatible_cudagraph_ops_item and test_graph_partition_item
    with torch._dynamo.config.patch(capture_scalar_outputs=True), torch.no_grad():
        c = tr.compile(_count_above)
        for _ in range(CALLS):
            x = torch.randn(8, 32, device=DEV)
            (y, k), (wy, wk) = c(x), _count_above(x)
            _close(y, wy)
            assert k == wk
    (rt,) = _runtimes(c)
    assert _kinds(rt) == [True, False, True], tr.explain(c)
    assert "on the host" in _eager_reasons(rt)[0]
    assert _counts(rt) == (2, CALLS, 0)


def _scale_by(x, s):
    return (x * s).relu() + s


def _plus_count(x):
    n = (x > 0).sum().item()
    return x * 2 + n


_HOST_SCALARS = {
    "int_arg": (_scale_by, lambda i: (torch.randn(8, 32, device=DEV), 2 + i % 3)),
    "float_arg": (_scale_by, lambda i: (torch.randn(8, 32, device=DEV), 0.5 + i)),
    "item": (_plus_count, lambda i: (torch.randn(8, 32, device=DEV),)),
    "cpu_scalar": (_scale_by, lambda i: (torch.randn(8, 32, device=DEV), torch.randn(()))),
}


@pytest.mark.parametrize("case", ["int_arg", "float_arg", "item", "cpu_scalar"])
def test_a_host_scalar_that_changes_each_call(case) -> None:
    # ports test_graph_partition_dynamic_scalar_inputs and test_dynamic_warmup (an int argument),
    # test_graph_partition_item (an .item() value) and test_graph_partition_cpu_scalar1 (a CPU
    # scalar tensor, which torch's graph partition copies to the device before the graph)
    fn, make = _HOST_SCALARS[case]
    with torch._dynamo.config.patch(capture_scalar_outputs=True), torch.no_grad():
        c = tr.compile(fn)
        for i in range(CALLS):
            args = make(i)
            _close(c(*args), fn(*args))
    assert _total(c, "captures") >= 1, tr.explain(c)
    if case == "int_arg":  # a new value is a new graph of the runtime's (keyed on int arguments)
        assert _total(c, "fallbacks") == 0, tr.explain(c)


def _unsafe_pipeline(img):
    x = (img + 10) * 2
    y = torch.ops.trported.host_round_trip(x)
    u = torch.ops.trported.transform(y + 1)
    return torch.ops.trported.modify(2 * u + 1) + 1


@pytest.mark.parametrize("listed", [
    True,
    pytest.param(False, marks=[
        pytest.mark.skipif(_UNSAFE_TAG is None, reason="this torch has no Tag.cudagraph_unsafe"),
    ]),
], ids=["splitting_ops", "tag_only"])
def test_uncapturable_custom_ops_are_eager_pieces(listed) -> None:
    # ports test_graph_partition_custom_op ("splitting on 2 custom gives 3 cudagraphs") and
    # test_skip_cudagraph_unsafe_ops (reduce-overhead without graph partition skips the graph)
    ops = ["trported.host_round_trip", "trported.modify"] if listed else []
    c = tr.compile(_unsafe_pipeline, splitting_ops=ops)
    with torch.no_grad():
        for _ in range(CALLS):
            img = torch.randn(3, 16, 16, device=DEV)
            _close(c(img), _unsafe_pipeline(img))
    (rt,) = _runtimes(c)
    assert _kinds(rt) == [True, False, True, False, True], tr.explain(c)
    assert _counts(rt) == (3, CALLS, 0)


# == RNG ===========================================================================================


def _noisy(x):
    return x * 2 + torch.rand_like(x)


@pytest.mark.parametrize("fallback_random", [True, False], ids=["aten_rand", "inductor_dropout"])
def test_graphed_random_numbers_follow_the_seed(fallback_random) -> None:
    # ports check_rng (test_rng_trees, test_rng_non_trees): after torch.manual_seed the graph
    # draws what it drew after the same seed before; with fallback_random what eager draws too.
    # inductor_dropout: dropout in train mode without grad (test_forward_backward's forward)
    fn = _noisy if fallback_random else nn.Dropout(0.5).train()
    x = torch.randn(32, 64, device=DEV)
    with torch._inductor.config.patch(fallback_random=fallback_random), torch.no_grad():
        c = tr.compile(fn)
        torch.manual_seed(0)
        want = [fn(x) for _ in range(3)]
        torch.manual_seed(0)
        got = [c(x).clone() for _ in range(3)]
        torch.manual_seed(0)
        again = [c(x).clone() for _ in range(3)]
    for g, w, a in zip(got, want, again):
        assert torch.equal(a, g)
        if fallback_random:
            torch.testing.assert_close(g, w)
        else:  # Inductor's own RNG: a dropout mask, kept values scaled by 1 / (1 - p)
            kept = g != 0
            assert 0.35 < kept.float().mean().item() < 0.65
            _close(g[kept], 2 * x[kept])
    assert not torch.equal(got[0], got[1])
    (rt,) = _runtimes(c)
    assert _counts(rt) == (1, 6, 0)


# == vLLM's piecewise tests: splitting_ops on a toy model whose outputs are known exactly ========


class _Silly(nn.Module):
    def forward(self, x):
        x = x + 1
        x = x + 2
        out = torch.empty_like(x)
        torch.ops.trported.attention(x, x, x, out)
        x = out - 2
        x = x - 1
        out = torch.empty_like(x)
        torch.ops.trported.attention(x, x, x, out)
        return out + 1  # 9 * x + 19


@pytest.mark.parametrize("op", [
    "trported.attention",
    torch.ops.trported.attention,
    torch.ops.trported.attention.default,
    "trported::attention",
], ids=["dotted", "packet", "overload", "qualified"])
def test_silly_model_piecewise(op) -> None:
    # ports vLLM tests/compile/piecewise/test_simple.py::test_simple_piecewise_compile
    # (splitting_ops=["silly::attention"]): 5 pieces, 3 graphed and captured once per size,
    # the silly attention run eagerly twice per call (inductor=False: vLLM runs both, the toy
    # llama below runs Inductor)
    c = tr.compile(_Silly(), sizes=[1, 2, 4], splitting_ops=[op], inductor=False)
    with torch.no_grad():
        for i, n in enumerate((1, 4, 3, 2, 1, 4)):
            x = torch.randint(-100, 100, (n,), device=DEV).float()
            before = _ATTENTION_CALLS[0]
            y = c(x)
            if i:  # the first call also ran them once per captured size
                assert _ATTENTION_CALLS[0] - before == 2
            assert torch.equal(y, 9 * x + 19)
    assert c.backend.compiles == 1
    (rt,) = _runtimes(c)
    assert _kinds(rt) == [True, False, True, False, True], tr.explain(c)
    assert rt.captured_sizes() == [1, 2, 4]
    assert _counts(rt) == (9, 6, 0)


HIDDEN, VOCAB = 32, 64


class _ToyLlama(nn.Module):
    """vLLM's tractable toy: identity weights, so each layer's attention gives
    ``q + k + v = 3 * h + positions`` and every output is an exact integer."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.qkv = nn.ModuleList(nn.Linear(HIDDEN, 3 * HIDDEN, bias=False) for _ in range(layers))
        self.o = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(layers))
        with torch.no_grad():
            self.embed.weight.fill_(1.0)
            for qkv, o in zip(self.qkv, self.o):
                qkv.weight.copy_(torch.eye(HIDDEN).repeat(3, 1))
                o.weight.copy_(torch.eye(HIDDEN))

    def forward(self, ids, positions):
        h, residual = self.embed(ids), None
        for qkv, o in zip(self.qkv, self.o):
            h = h if residual is None else h + residual
            residual = h
            q, k, v = qkv(h).split(HIDDEN, dim=-1)  # q, k, v: [B, HIDDEN]
            out = torch.empty_like(q)
            torch.ops.trported.attention(q + positions[:, None], k, v, out)
            h = o(out)
        return h


def _toy_expected(positions: torch.Tensor, layers: int) -> torch.Tensor:
    p = positions[:, None].float()
    h, residual = torch.ones(len(positions), HIDDEN, device=positions.device), None
    for _ in range(layers):
        h = h if residual is None else h + residual
        residual = h
        h = 3 * h + p
    return h


@pytest.mark.parametrize("inductor", [True, False])
def test_toy_llama_piecewise(inductor) -> None:
    # ports vLLM tests/compile/piecewise/test_toy_llama.py (tractable_init): 2 * layers + 1
    # pieces, layers + 1 graphed, captured once per size; outputs known exactly
    layers, sizes = 3, [2, 4, 8]
    model = _ToyLlama(layers).to(DEV).eval()
    c = tr.compile(model, sizes=sizes, splitting_ops=["trported.attention"], inductor=inductor)
    with torch.no_grad():
        for i, n in enumerate((8, 3, 2, 5, 7, 4)):
            ids = torch.randint(0, VOCAB, (n,), device=DEV)
            positions = torch.randint(0, 8, (n,), device=DEV)
            before = _ATTENTION_CALLS[0]
            y = c(ids, positions)
            if i:
                assert _ATTENTION_CALLS[0] - before == layers
            assert torch.equal(y, _toy_expected(positions, layers))
            assert torch.equal(y, model(ids, positions))
    assert c.backend.compiles == 1
    (rt,) = _runtimes(c)
    assert _kinds(rt) == [True, False] * layers + [True], tr.explain(c)
    assert _counts(rt) == ((layers + 1) * len(sizes), 6, 0)
