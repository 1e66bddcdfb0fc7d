"""tr.graph on a real GPU: replay equals eager on fresh random inputs, guards, output policies,
failed captures that leave the process usable, and memory that comes back."""

from __future__ import annotations

import copy
import linecache
import dataclasses
import gc

import pytest
import torch
import torch.nn as nn

import torchreplay as tr

from memory import reserved

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEV = "cuda"


def line_of(marker: str) -> int:
    """The line number in this file of the line that carries ``marker``."""
    for i, line in enumerate(open(__file__).read().splitlines(), start=1):
        if marker in line and "line_of(" not in line:
            return i
    raise AssertionError(marker)


def mlp(depth: int = 6, width: int = 256) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers).to(DEV).eval()



# -- correctness ------------------------------------------------------------------------------


def test_replay_equals_eager_bitwise_over_100_fresh_inputs() -> None:
    model = mlp()
    g = tr.graph(model, torch.randn(8, 256, device=DEV))
    for _ in range(100):
        x = torch.randn(8, 256, device=DEV)
        y = g(x)
        with torch.no_grad():
            ref = model(x)
        assert torch.equal(y, ref)
    assert g.stats.replays == 100
    assert g.stats.captures == 1
    assert g.stats.pool_bytes > 0


def test_kwargs_and_nested_pytree_inputs_and_outputs() -> None:
    w = torch.randn(16, 16, device=DEV)

    def fn(x, pair, *, cfg, scale=1.0, mode="sum"):
        a, b = pair
        h = (x @ w + a) * cfg["gain"] + cfg["bias"][0]
        out = {"h": h * scale, "parts": [h.sum(-1), b * 2]}
        return out if mode == "sum" else None

    def args():
        return (
            torch.randn(4, 16, device=DEV),
            (torch.randn(4, 16, device=DEV), torch.randn(3, device=DEV)),
        ), {
            "cfg": {"gain": torch.randn(16, device=DEV), "bias": [torch.randn(16, device=DEV)]},
            "scale": 0.5,
            "mode": "sum",
        }

    a0, k0 = args()
    g = tr.graph(fn, *a0, **k0)
    for _ in range(50):
        a, k = args()
        got = g(*a, **k)
        ref = fn(*a, **k)
        assert set(got) == {"h", "parts"}
        assert torch.equal(got["h"], ref["h"])
        assert torch.equal(got["parts"][0], ref["parts"][0])
        assert torch.equal(got["parts"][1], ref["parts"][1])
    # keyword order does not matter
    a, k = args()
    got = g(*a, mode="sum", scale=0.5, cfg=k["cfg"])
    assert torch.allclose(got["h"], fn(*a, **k)["h"])


def test_constant_guard_names_the_argument_and_both_values() -> None:
    def fn(x, *, mask_mode="causal"):
        return x * 2 if mask_mode == "causal" else x * 3

    g = tr.graph(fn, torch.randn(4, device=DEV), mask_mode="causal")
    with pytest.raises(tr.ReplayInputError) as e:
        g(torch.randn(4, device=DEV), mask_mode="full")
    msg = str(e.value)
    assert "kwargs['mask_mode']" in msg and "'full'" in msg and "'causal'" in msg
    # a bool is not the int it equals
    g2 = tr.graph(lambda x, n: x * n, torch.randn(4, device=DEV), 1)
    with pytest.raises(tr.ReplayInputError, match=r"args\[1\].*True.*constant 1"):
        g2(torch.randn(4, device=DEV), True)


@pytest.mark.parametrize(
    "bad, words",
    [
        (lambda: torch.randn(9, 16, device=DEV), ["args[0] 'x'", "(9, 16)", "(8, 16)", "sizes="]),
        # float16 -> float32 is a lossless widening, copied in (tests/gpu/test_writes.py); a
        # narrowing cast is refused.
        (lambda: torch.randn(8, 16, device=DEV, dtype=torch.float64), ["float64", ".to(torch.float32)"]),
        (lambda: torch.randn(8, 16), ["cpu", ".to('cuda:0')"]),
        (lambda: torch.randn(16, device=DEV).expand(8, 16)[:, :15], ["(8, 15)"]),
        (lambda: torch.randn(8, 16, device=DEV).to_sparse(), ["sparse", "dense"]),
        (lambda: 3.0, ["expected a tensor", "float"]),
    ],
)
def test_each_tensor_mismatch_is_a_replay_input_error(bad, words) -> None:
    def fn(x):
        return x + 1

    g = tr.graph(fn, torch.randn(8, 16, device=DEV))
    with pytest.raises(tr.ReplayInputError) as e:
        g(bad())
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    # the graph still works after a rejected call
    x = torch.randn(8, 16, device=DEV)
    assert torch.equal(g(x), x + 1)


def test_broadcastable_shape_is_rejected_not_broadcast() -> None:
    g = tr.graph(lambda x: x * 2, torch.randn(4, 8, device=DEV))
    with pytest.raises(tr.ReplayInputError):
        g(torch.randn(1, 8, device=DEV))


def test_structure_mismatch_names_what_differs() -> None:
    def fn(x, *, y):
        return x + y

    g = tr.graph(fn, torch.randn(3, device=DEV), y=torch.randn(3, device=DEV))
    with pytest.raises(tr.ReplayInputError, match="positional"):
        g(torch.randn(3, device=DEV), torch.randn(3, device=DEV), y=torch.randn(3, device=DEV))
    with pytest.raises(tr.ReplayInputError, match="missing"):
        g(torch.randn(3, device=DEV))


def test_non_contiguous_input_of_the_right_shape_is_copied() -> None:
    g = tr.graph(lambda x: x.sum(0), torch.randn(8, 4, device=DEV))
    base = torch.randn(4, 8, device=DEV)
    assert torch.allclose(g(base.t()), base.t().sum(0))


def test_passing_the_static_buffers_skips_the_copy() -> None:
    g = tr.graph(lambda x: x * 3, torch.randn(5, device=DEV))
    (sx,) = g.static_args
    sx.copy_(torch.arange(5.0, device=DEV))
    assert torch.equal(g(*g.static_args), torch.arange(5.0, device=DEV) * 3)


def test_an_output_that_is_an_argument_is_the_callers_tensor() -> None:
    """``return h, mask`` (a layer passing its mask on) and ``x.add_(1); return x``: eagerly the
    output is the caller's own tensor, valid after later calls and seeing the caller's later
    writes. It was the graph's static copy, which the next call overwrote (reading a kept one
    raised StaleOutputError)."""
    lin = nn.Linear(16, 16).to(DEV)

    def layer(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return lin(x) * mask, mask

    g = tr.graph(layer, torch.randn(4, 16, device=DEV), torch.rand(4, 16, device=DEV))
    kept = []
    with torch.no_grad():
        for _ in range(6):
            x, mask = torch.randn(4, 16, device=DEV), (torch.rand(4, 16, device=DEV) > 0.5).float()
            h, m = g(x, mask)
            assert m is mask
            torch.testing.assert_close(h, lin(x) * mask)
            kept.append((mask.clone(), m))
    for want, m in kept:  # every call's, after all later calls
        assert torch.equal(m, want)

    def bump(x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return x

    g2 = tr.graph(bump, torch.randn(8, device=DEV))
    for _ in range(4):
        w = torch.randn(8, device=DEV)
        want = w + 1
        y = g2(w)
        assert y is w
        torch.testing.assert_close(w, want)


def test_an_output_that_is_a_view_of_an_argument_is_that_view_of_the_callers_tensor() -> None:
    """``ids[:, -1:]``, ``x.view(-1)``: eagerly a view of the caller's tensor, which sees the
    caller's later writes and stays valid after later calls. It was a view of the graph's
    static copy (stale after the next call, blind to the caller's writes)."""
    lin = nn.Linear(16, 16).to(DEV)

    def f(x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return lin(x), ids[:, -1:], x.view(-1)

    g = tr.graph(f, torch.randn(4, 16, device=DEV), torch.randint(0, 100, (4, 8), device=DEV))
    kept = []
    with torch.no_grad():
        for _ in range(6):
            x, ids = torch.randn(4, 16, device=DEV), torch.randint(0, 100, (4, 8), device=DEV)
            h, last, flat = g(x, ids)
            assert last._base is ids and flat._base is x
            torch.testing.assert_close(h, lin(x))
            assert torch.equal(last, ids[:, -1:])
            x.add_(1)  # the caller's write after the call: the view sees it, as eagerly
            assert torch.equal(flat, x.view(-1))
            kept.append((ids[:, -1:].clone(), last))
    for want, got in kept:  # every call's, after all later calls
        assert torch.equal(got, want)
    # The one output: a view of the argument the call wrote (a view alone records no CUDA work).
    flat = tr.graph(lambda x: x.mul_(2).view(-1), torch.randn(4, 16, device=DEV))
    for _ in range(3):
        x = torch.randn(4, 16, device=DEV)
        want = (x * 2).view(-1)
        y = flat(x)
        assert y._base is x and torch.equal(y, want) and torch.equal(x.view(-1), want)


def test_output_fed_back_as_input_matches_eager() -> None:
    lin = nn.Linear(32, 32).to(DEV)

    def step(h):
        return torch.tanh(lin(h))

    h0 = torch.randn(2, 32, device=DEV)
    g = tr.graph(step, h0)
    h, ref = h0, h0
    for _ in range(20):
        h = g(h)
        with torch.no_grad():
            ref = step(ref)
    assert torch.allclose(h, ref)


# -- output policy ------------------------------------------------------------------------------


def test_checked_outputs_raise_when_read_after_overwrite() -> None:
    model = mlp(depth=2, width=64)
    g = tr.graph(model, torch.randn(4, 64, device=DEV))
    x1, x2 = torch.randn(4, 64, device=DEV), torch.randn(4, 64, device=DEV)
    y1 = g(x1)
    view1 = y1[1:]
    kept = y1.clone()
    y2 = g(x2)
    assert y1.shape == (4, 64)  # metadata is still readable
    for stale in (y1, view1):
        with pytest.raises(RuntimeError, match="StaleOutputError.*clone"):
            stale.sum().item()
    with torch.no_grad():
        assert torch.equal(kept, model(x1))
        assert torch.equal(y2, model(x2))


def test_checked_outputs_storage_is_used_again_only_when_nothing_holds_it() -> None:
    """When the last output was dropped, its alias storage is used again (the cheap path);
    when anything can still reach it (a variable, a view, autograd's saved tensors, a dict), it
    is marked stale and the old output raises when read. Every value equals eager's, over many
    calls of each pattern."""
    model = mlp(depth=2, width=64)
    g = tr.graph(model, torch.randn(4, 64, device=DEV))

    def ref(x):
        with torch.no_grad():
            return model(x)

    storages = set()
    for _ in range(20):
        x = torch.randn(4, 64, device=DEV)
        assert torch.equal(g(x), ref(x))
        storages.add(id(g._outputs.live[0]))
    assert len(storages) == 1, "a dropped output's storage was not used again"

    w = torch.randn(4, 64, device=DEV, requires_grad=True)
    for hold in ("variable", "view", "autograd", "dict"):
        for _ in range(5):
            x1, x2 = torch.randn(4, 64, device=DEV), torch.randn(4, 64, device=DEV)
            y1 = g(x1)
            want1 = ref(x1)
            assert torch.equal(y1, want1)
            if hold == "variable":
                kept = y1
            elif hold == "view":
                kept = y1[1:]
            elif hold == "autograd":
                kept = w * y1  # saves y1 for w's gradient
            else:
                kept = {"y": y1}
            del y1
            y2 = g(x2)
            assert torch.equal(y2, ref(x2)), hold
            if hold == "autograd":
                with pytest.raises(RuntimeError, match="StaleOutputError"):
                    kept.sum().backward()
            else:
                stale = kept["y"] if hold == "dict" else kept
                assert stale is not y2, hold
                with pytest.raises(RuntimeError, match="StaleOutputError"):
                    stale.sum().item()
            del kept, y2


def test_clone_policy_keeps_every_output() -> None:
    model = mlp(depth=2, width=64)
    g = tr.graph(model, torch.randn(4, 64, device=DEV), outputs="clone")
    xs = [torch.randn(4, 64, device=DEV) for _ in range(10)]
    ys = [g(x) for x in xs]
    with torch.no_grad():
        for x, y in zip(xs, ys):
            assert torch.equal(y, model(x))


def test_static_policy_returns_the_graph_buffers() -> None:
    g = tr.graph(lambda x: x + 1, torch.randn(4, device=DEV), outputs="static")
    y1 = g(torch.zeros(4, device=DEV))
    y2 = g(torch.ones(4, device=DEV))
    assert y1.data_ptr() == y2.data_ptr()
    assert torch.equal(y1, torch.full((4,), 2.0, device=DEV))  # overwritten, as documented


def test_outputs_that_are_module_buffers_alias_like_eager() -> None:
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("acc", torch.zeros(4, device=DEV))

        def forward(self, x):
            self.acc.add_(x)
            return self.acc, x * 2

    m = Counter()
    g = tr.graph(m, torch.randn(4, device=DEV))
    assert torch.equal(m.acc, torch.zeros(4, device=DEV)), "building the graph changed state"
    total = torch.zeros(4, device=DEV)
    for _ in range(10):
        x = torch.randn(4, device=DEV)
        acc, y = g(x)
        total += x
        assert acc is m.acc
        assert torch.allclose(acc, total)
        assert torch.equal(y, x * 2)


# -- modules ----------------------------------------------------------------------------------


def test_in_place_kv_cache_updates_replay_like_eager() -> None:
    class Cache(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.register_buffer("k", torch.zeros(2, 16, 8))

        def forward(self, x, pos):  # x: [B, 8], pos: [B]
            self.k.index_put_((torch.arange(x.shape[0], device=x.device), pos), self.proj(x))
            return self.k.sum(1)

    torch.manual_seed(1)
    eager, graphed = Cache().to(DEV), Cache().to(DEV)
    graphed.load_state_dict(eager.state_dict())
    g = tr.graph(graphed, torch.randn(2, 8, device=DEV), torch.tensor([0, 0], device=DEV))
    assert torch.equal(graphed.k, eager.k), "warm-up left writes in the cache"
    for step in range(16):
        x = torch.randn(2, 8, device=DEV)
        pos = torch.tensor([step, 15 - step], device=DEV)
        with torch.no_grad():
            ref = eager(x, pos)
        assert torch.allclose(g(x, pos), ref)
    assert torch.allclose(graphed.k, eager.k)


def test_train_eval_switch_falls_back_to_eager_and_counts() -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16)).to(DEV).eval()
    g = tr.graph(model, torch.randn(8, 16, device=DEV))
    model.train()
    x = torch.randn(8, 16, device=DEV)
    before = model[1].running_mean.clone()
    y = g(x)
    assert g.stats.fallbacks == 1 and g.stats.replays == 0
    assert not torch.equal(model[1].running_mean, before)  # ran eagerly in training mode
    model.eval()
    with torch.no_grad():
        assert torch.equal(g(x), model(x))
    assert g.stats.replays == 1
    assert y.shape == (8, 16)


# -- failures ---------------------------------------------------------------------------------


def _item_inside(x):
    s = x.sum().item()  # capture-breaks-here
    return x * s


def test_failed_capture_names_the_line_and_leaves_the_process_usable() -> None:
    x = torch.randn(64, 64, device=DEV)
    base = reserved()
    with pytest.raises(tr.CaptureError) as e:
        tr.graph(_item_inside, x)
    msg = str(e.value)
    assert f"{__file__}:{line_of('# capture-breaks-here')}" in msg, msg
    assert e.value.__cause__ is not None  # CUDA's own error is chained, not lost
    assert not torch.cuda.is_current_stream_capturing()
    del e
    # eager still works, a fresh capture still works, memory came back
    assert torch.allclose(_item_inside(x), x * x.sum())
    g = tr.graph(lambda t: t @ t, x)
    assert torch.allclose(g(x), x @ x)
    del g
    assert reserved() == base


def test_a_pool_id_whose_graphs_are_all_gone_takes_a_new_id_and_the_process_stays_usable() -> None:
    """torch cannot capture into a pool id again once its last graph was destroyed: its
    allocator fails an internal assertion in ``capture_begin``, after marking the RNG as
    capturing (every later random op then raised "Offset increment outside graph capture").
    The Pool takes a new id and the capture goes on; random ops and dropout equal eager."""
    handle = torch.cuda.graph_pool_handle()
    x = torch.randn(64, 64, device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        other = torch.cuda.CUDAGraph()  # another tool's graph in that pool, then dropped
        with torch.cuda.graph(other, pool=handle, stream=side):
            y = x * 2
    torch.cuda.current_stream().wait_stream(side)
    del other, y
    gc.collect()
    torch.cuda.empty_cache()
    pool = tr.Pool.from_handle(handle)
    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5)).to(DEV).train()
    g = tr.graph(model, x, pool=pool)
    assert g.pool is pool and pool.handle != tuple(handle)
    assert not torch.cuda.is_current_stream_capturing()
    torch.randn(8, device=DEV).sum().item()  # torch's RNG is not left mid-capture
    _equal_with_dropout(g, model, x)


def _equal_with_dropout(g, model: nn.Module, x: torch.Tensor) -> None:
    inputs = [torch.randn_like(x) for _ in range(4)]
    torch.manual_seed(1)
    want = [model(xi) for xi in inputs]
    torch.manual_seed(1)
    replays = g.stats.replays
    got = [g(xi).clone() for xi in inputs]
    assert g.stats.replays == replays + len(inputs)  # (replayed, not run eagerly)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert not torch.equal(got[0] == 0, got[1] == 0)  # (each replay drew its own mask)


def test_a_pool_goes_on_serving_graphs_after_a_capture_into_it_failed() -> None:
    """A capture that CUDA invalidated (an ``.item()``) into a pool that holds a live graph:
    the next capture into the same Pool works, and both graphs equal eager."""
    x = torch.randn(64, 64, device=DEV)
    pool = tr.Pool()
    first = mlp(depth=2, width=64)
    g0 = tr.graph(first, x, pool=pool)
    with pytest.raises(tr.CaptureError):
        tr.graph(_item_inside, x, pool=pool)
    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5)).to(DEV).train()
    g1 = tr.graph(model, x, pool=pool)
    torch.randn(8, device=DEV).sum().item()
    _equal_with_dropout(g1, model, x)
    for _ in range(3):
        xi = torch.randn_like(x)
        with torch.no_grad():
            assert torch.equal(g0(xi), first(xi))


def test_exception_raised_during_capture_is_undone() -> None:
    def fn(x):
        y = x * 2
        if torch.cuda.is_current_stream_capturing():
            raise KeyError("boom")  # raises-in-capture
        return y

    x = torch.randn(128, 128, device=DEV)
    base = reserved()
    with pytest.raises(tr.CaptureError, match="KeyError") as e:
        tr.graph(fn, x)
    assert f":{line_of('# raises-in-capture')}" in str(e.value)
    del e
    assert not torch.cuda.is_current_stream_capturing()
    assert torch.equal(fn(x), x * 2)
    assert reserved() == base


def test_out_of_memory_during_capture_is_undone() -> None:
    free, _ = torch.cuda.mem_get_info()

    def fn(x):
        y = x * 2
        if torch.cuda.is_current_stream_capturing():
            big = torch.empty(free * 4, dtype=torch.uint8, device=DEV)
            y = y + big[:1].float()
        return y

    x = torch.randn(256, 256, device=DEV)
    base = reserved()
    with pytest.raises(tr.CaptureError, match="out of memory") as e:
        tr.graph(fn, x)
    del e
    assert not torch.cuda.is_current_stream_capturing()
    assert torch.equal(fn(x), x * 2)
    g = tr.graph(lambda t: t.relu(), x)
    assert torch.equal(g(x), x.relu())
    del g
    assert reserved() == base


def test_empty_graph_is_a_capture_error() -> None:
    with pytest.raises(tr.CaptureError, match="empty graph.*ran on the CPU"):
        tr.graph(lambda x: torch.ones(3) + 1, torch.randn(3, device=DEV))
    # nothing to launch at all: the message says so, not "move it to the GPU"
    with pytest.raises(tr.CaptureError, match="empty graph.*returns its arguments or views"):
        tr.graph(lambda x: (x.view(-1), x[1:]), torch.randn(3, 4, device=DEV))


def test_warmup_exception_is_a_capture_error_naming_the_line() -> None:
    def fn(x):
        return x.view(7, 7)  # bad-view

    with pytest.raises(tr.CaptureError) as e:
        tr.graph(fn, torch.randn(10, device=DEV))
    assert f":{line_of('# bad-view')}" in str(e.value)


def test_capture_and_release_does_not_leak() -> None:
    model = mlp(depth=4, width=512)
    x = torch.randn(32, 512, device=DEV)
    base_reserved, base_alloc = reserved(), torch.cuda.memory_allocated()
    for _ in range(5):
        g = tr.graph(model, x)
        y = g(x)
        del g, y
    assert reserved() == base_reserved
    assert torch.cuda.memory_allocated() == base_alloc


# -- pools ------------------------------------------------------------------------------------


def test_shared_pool_marks_later_graphs_outputs_stale() -> None:
    a, b = mlp(depth=2, width=128), mlp(depth=3, width=128)
    x = torch.randn(4, 128, device=DEV)
    ga = tr.graph(a, x)
    gb = tr.graph(b, x, pool=ga)
    assert gb.pool is ga.pool
    yb = gb(x)
    ya = ga(x)  # may reuse memory that gb's outputs live in
    with pytest.raises(RuntimeError, match="StaleOutputError"):
        yb.sum().item()
    with torch.no_grad():
        assert torch.equal(ya, a(x))
        assert torch.equal(gb(x), b(x))


def test_a_pool_whose_graphs_were_all_dropped_serves_new_graphs_in_order() -> None:
    """Dropping the last graph of a Pool resets its capture order: graphs captured into the
    same Pool afterwards (fewer than before) get the stale marking of a fresh pool."""
    pool = tr.Pool()
    a, b = mlp(depth=2, width=128), mlp(depth=3, width=128)
    x = torch.randn(4, 128, device=DEV)
    for extra in (True, False):
        ga = tr.graph(a, x, pool=pool)
        gb = tr.graph(b, x, pool=pool)
        more = [tr.graph(a, x, pool=pool)] if extra else []
        for _ in range(3):
            xi = torch.randn(4, 128, device=DEV)
            yb = gb(xi)
            ya = ga(xi)
            with pytest.raises(RuntimeError, match="StaleOutputError"):
                yb.sum().item()
            with torch.no_grad():
                assert torch.equal(ya, a(xi))
                assert torch.equal(gb(xi), b(xi))
                assert all(torch.equal(m(xi), a(xi)) for m in more)
        del ga, gb, more, ya, yb
        gc.collect()
        assert not pool._members  # the last graph went: the order starts again


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    scale: float


_HAS_REGISTER_DATACLASS = hasattr(torch.utils._pytree, "register_dataclass")
if _HAS_REGISTER_DATACLASS:
    torch.utils._pytree.register_dataclass(Batch)


@pytest.mark.skipif(not _HAS_REGISTER_DATACLASS, reason="this torch has no register_dataclass")
def test_registered_dataclass_argument() -> None:
    g = tr.graph(lambda b: b.x * b.scale, Batch(torch.randn(3, device=DEV), 2.0))
    x = torch.randn(3, device=DEV)
    assert torch.equal(g(Batch(x, 2.0)), x * 2.0)
    with pytest.raises(tr.ReplayInputError, match="scale"):
        g(Batch(x, 3.0))


@dataclasses.dataclass
class Result:  # (not registered as a pytree node)
    y: torch.Tensor


@pytest.mark.skipif(not _HAS_REGISTER_DATACLASS, reason="this torch has no register_dataclass")
def test_an_output_object_holding_the_graphs_tensors_is_refused_and_a_registered_one_is_new_each_call() -> None:
    """Not a pytree, the object is one leaf: every replay would hand out the capture's object,
    its tensor overwritten by the next call, unchecked. Registered, each call gets a new one
    whose tensor is checked."""
    with pytest.raises(tr.CaptureError, match=r"returns a Result \(output 0\) .*output 0\.y.*register_dataclass"):
        tr.graph(lambda x: Result(x * 2), torch.randn(3, device=DEV))

    @dataclasses.dataclass
    class Registered:
        y: torch.Tensor

    torch.utils._pytree.register_dataclass(Registered)
    g = tr.graph(lambda x: Registered(x * 2), torch.randn(3, device=DEV))
    x1, x2 = torch.randn(3, device=DEV), torch.randn(3, device=DEV)
    r1 = g(x1)
    r2 = g(x2)
    assert r1 is not r2 and torch.equal(r2.y, x2 * 2)
    with pytest.raises(RuntimeError, match="StaleOutputError"):
        r1.y.sum()


def test_an_hf_decoder_with_its_default_cache_is_refused_naming_use_cache() -> None:
    """``model(ids)`` makes a DynamicCache at every call and returns it."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    model = transformers.LlamaForCausalLM(cfg).to(DEV).eval()
    ids = torch.randint(0, 256, (2, 8), device=DEV)
    with torch.no_grad(), pytest.raises(tr.CaptureError, match=r"DynamicCache.*use_cache=False"):
        tr.graph(model, ids)
    g = tr.graph(model, ids, use_cache=False)
    with torch.no_grad():
        torch.testing.assert_close(g(ids, use_cache=False).logits, model(ids, use_cache=False).logits)


def test_line_helper_finds_markers() -> None:
    assert linecache.getline(__file__, line_of("# capture-breaks-here")).strip().endswith(
        "# capture-breaks-here"
    )


# ---------------------------------------------------------------- calls from several threads

def _threads_hammer(
    call, model, rows_of, threads: int = 4, calls: int = 60, grad: bool = False
) -> dict:
    """``threads`` threads each call ``call`` ``calls`` times on fresh inputs of their own and
    compare with eager (``model``): the outputs, or with ``grad`` the input's gradient through
    a backward of each call. Returns the counts: right, wrong, stale (a read that raised
    StaleOutputError: another thread's call overwrote a checked output or activation first)."""
    import threading

    counts = {"right": 0, "wrong": 0, "stale": 0}
    lock = threading.Lock()
    failures: list[BaseException] = []

    def result(f, x):
        if grad:
            return torch.autograd.grad(f(x).square().sum(), x)[0]
        with torch.no_grad():
            return f(x)

    def worker(seed: int) -> None:
        gen = torch.Generator(device=DEV).manual_seed(seed)
        try:
            for k in range(calls):
                rows = rows_of(seed, k)
                x = torch.randn(rows, 256, device=DEV, generator=gen, requires_grad=grad)
                want = result(model, x)
                try:
                    ok = torch.allclose(result(call, x), want, rtol=1e-3, atol=1e-3)
                    kind = "right" if ok else "wrong"
                except RuntimeError as exc:  # tr.StaleOutputError is one too
                    stale = isinstance(exc, tr.StaleOutputError) or "StaleOutputError" in str(exc)
                    if not stale:
                        raise
                    kind = "stale"
                with lock:
                    counts[kind] += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failures.append(exc)

    pool = [threading.Thread(target=worker, args=(s,)) for s in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not failures, failures
    return counts


@pytest.mark.parametrize("outputs", ["checked", "clone"])
@pytest.mark.parametrize("kind", ["tr.graph", "sizes=", "tr.compile"])
def test_threads_calling_one_graph_never_get_another_calls_result(kind: str, outputs: str) -> None:
    """Four threads call one graph at once, each on inputs of its own (a server's worker
    threads). The graph's static buffers are shared, so a call copying its input in while
    another is between its copy-in and its replay would silently get the other's result:
    calls are serialized. Every result equals eager; under ``outputs="checked"`` a result that
    another thread's call overwrote before it was read raises instead (never a wrong value)."""
    torch.manual_seed(0)
    model = mlp().to(DEV).eval()
    sample = torch.randn(8, 256, device=DEV)
    if kind == "tr.graph":
        g, rows_of = tr.graph(model, sample, outputs=outputs), (lambda s, k: 8)
    elif kind == "sizes=":
        g = tr.graph(model, sample, sizes=[1, 2, 4, 8], outputs=outputs)
        rows_of = lambda s, k: 1 + (s + k) % 8  # noqa: E731
    else:
        g, rows_of = tr.compile(model, outputs=outputs, cache_dir=None), (lambda s, k: 8)
        with torch.no_grad():
            g(sample)  # compiled and captured here, not by four threads at once
    counts = _threads_hammer(g, model, rows_of)
    assert counts["wrong"] == 0, counts
    assert counts["right"] > 0, counts
    if outputs == "clone":
        assert counts["stale"] == 0, counts


def test_threads_calling_one_graphed_callable_never_get_another_calls_result() -> None:
    """tr.make_graphed_callables under four threads: forward calls (no_grad) equal eager, and
    forward plus backward per thread give each thread its own input gradient (a forward called
    while another's activations await their backward runs eagerly); never another call's
    result. Without the lock, 116 and 100 of 400 calls were wrong on the H200."""
    torch.manual_seed(0)
    ref = mlp(depth=3, width=256)
    model = copy.deepcopy(ref)
    tr.make_graphed_callables(model, (torch.randn(8, 256, device=DEV, requires_grad=True),))
    for grad in (False, True):
        counts = _threads_hammer(model, ref, lambda s, k: 8, calls=30, grad=grad)
        assert counts["wrong"] == 0 and counts["right"] > 0, (grad, counts)


def _new_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: torch.randn_like(v) * 0.1 for k, v in model.state_dict().items()}


@pytest.mark.parametrize("sizes", [None, [2, 4, 8]], ids=["one shape", "sizes"])
def test_weights_loaded_in_place_reach_the_graph_and_a_reloaded_model_raises(sizes) -> None:
    """Eager semantics for new weights: ``load_state_dict(sd)`` (in place) reaches every later
    replay, equal to eager; a reload that puts new tensors in the model (``assign=True``) or
    moves it (``p.data = ...`` for each weight) raises ReplayInputError naming the parameter,
    instead of replaying over the old (or freed) memory."""
    torch.manual_seed(0)
    model = mlp(depth=3, width=64)
    g = tr.graph(model, torch.randn(8, 64, device=DEV), sizes=sizes)
    with torch.no_grad():
        for reload in range(3):
            model.load_state_dict(_new_weights(model))
            for _ in range(5):
                x = torch.randn(8 if sizes is None else 3, 64, device=DEV)
                torch.testing.assert_close(g(x), model(x), rtol=1e-5, atol=1e-5)
        model.load_state_dict(_new_weights(model), assign=True)
        with pytest.raises(tr.ReplayInputError, match=r"'0\.weight'.*assign=True"):
            g(torch.randn(8, 64, device=DEV))
    g2 = tr.graph(model, torch.randn(8, 64, device=DEV), sizes=sizes)
    for p in model.parameters():
        p.data = p.data.clone()
    with pytest.raises(tr.ReplayInputError, match="another address"):
        g2(torch.randn(8, 64, device=DEV))


@pytest.mark.parametrize("sizes", [None, [2, 4, 8]], ids=["one shape", "sizes"])
@pytest.mark.parametrize("how", ["parameter", "tied", "submodule", "deleted"])
def test_one_weight_or_layer_replaced_after_capture_raises_and_other_registrations_do_not(
    how: str, sizes
) -> None:
    """Eager semantics for one weight or one layer replaced in the middle of the model (a new
    ``nn.Parameter``, a weight tied to another, ``model[1] = nn.GELU()``): the next call raises
    ReplayInputError naming it (seen through torch's registration hooks, core/placed.py),
    never a replay of the old weight or layer. A registration that changes nothing the graph
    reads (a new buffer) keeps every later call graphed and equal to eager."""
    torch.manual_seed(0)
    model = mlp(depth=3, width=64)
    g = tr.graph(model, torch.randn(8, 64, device=DEV), sizes=sizes)
    rows = 8 if sizes is None else 3
    with torch.no_grad():
        model[0].register_buffer("unused", torch.randn(3, device=DEV))
        for _ in range(5):
            x = torch.randn(rows, 64, device=DEV)
            torch.testing.assert_close(g(x), model(x), rtol=1e-5, atol=1e-5)
        replays = g.stats.replays
        assert replays == 5 and g.stats.fallbacks == 0
        if how == "parameter":
            model[2].weight = nn.Parameter(torch.randn_like(model[2].weight))
            named = r"'2\.weight' is at another address"
        elif how == "tied":
            model[4].weight = model[2].weight
            named = r"'4\.weight' is at another address"
        elif how == "submodule":
            model[1] = nn.GELU()
            named = r"submodule '1' was replaced by GELU"
        else:  # no hook fires; eagerly the next call would raise AttributeError
            del model[0].weight
            named = r"'0\.weight' is gone \(now None: deleted"
        with pytest.raises(tr.ReplayInputError, match=named):
            g(torch.randn(rows, 64, device=DEV))
    assert g.stats.replays == replays


def test_a_weight_replaced_alone_keeps_the_graph_on_its_captured_memory() -> None:
    """One weight in the middle replaced by ``p.data = new`` is not checked per call (only
    the first parameter is): the graph holds the memory it captured, so, even with that memory
    let go by the model and the allocator asked for the same sizes again, each replay computes
    with the old weight, never with freed and reused memory."""
    torch.manual_seed(0)
    model = mlp(depth=3, width=64)
    old = copy.deepcopy(model)
    g = tr.graph(model, torch.randn(8, 64, device=DEV))
    model[2].weight.data = torch.randn_like(model[2].weight)
    junk = [torch.full_like(p, float("nan")) for p in old.parameters() for _ in range(4)]
    with torch.no_grad():
        for _ in range(10):
            x = torch.randn(8, 64, device=DEV)
            torch.testing.assert_close(g(x), old(x), rtol=0, atol=0)
    del junk
