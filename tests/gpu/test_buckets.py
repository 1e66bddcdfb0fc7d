"""tr.graph(sizes=...) on a real GPU: every size against eager on fresh random inputs, padding that
never leaks, memory bounded by the largest size, fallbacks, lazy capture, stale outputs across
sizes, and the built-in Llama decoding through padded graphs with its in-place KV cache."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import torchreplay as tr
from torchreplay import _compat
from torchreplay.sizes.plan import target_size
from torchreplay.models.llama import LlamaConfig, build_llama

from memory import reserved

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.usefixtures("full_fp32_matmul"),  # (tests/conftest.py)
]

DEV = "cuda"
SIZES = [1, 2, 4, 8, 16, 24, 32]

needs_checked = pytest.mark.skipif(
    not _compat.HAS_CHECKED_OUTPUTS, reason="this torch cannot mark storages stale"
)


def mlp(depth: int = 6, width: int = 256) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers).to(DEV).eval()



# A padded call runs the GEMMs with M = s rows instead of n, and cuBLAS may pick another kernel
# (another summation order) for another M: results agree to fp32 rounding, not always bitwise.
FP32 = {"rtol": 1e-4, "atol": 1e-5}


# -- correctness ------------------------------------------------------------------------------


def test_every_size_matches_eager_on_fresh_inputs() -> None:
    model = mlp()
    g = tr.graph(model, torch.randn(3, 256, device=DEV), sizes=SIZES)
    assert g.captured_sizes == SIZES
    for n in range(1, 33):
        for _ in range(3):
            x = torch.randn(n, 256, device=DEV)
            y = g(x)
            with torch.no_grad():
                ref = model(x)
            assert y.shape == (n, 256)
            torch.testing.assert_close(y, ref, **FP32)
    stats = g.stats
    assert stats.replays == 96 and stats.fallbacks == 0 and stats.captures == len(SIZES)
    assert sum(stats.size_hits.values()) == 96
    assert stats.size_hits[32] == 3 * 8  # n = 25 .. 32
    assert stats.real_rows == 3 * sum(range(1, 33))
    assert stats.padded_rows == 3 * sum(target_size(SIZES, n) - n for n in range(1, 33))
    assert stats.pool_bytes > 0


def test_inputs_of_the_largest_size_and_static_buffers() -> None:
    model = mlp(depth=2, width=64)
    g = tr.graph(model, torch.randn(8, 64, device=DEV), sizes=[2, 4, 8])
    (sx,) = g.static_args
    assert sx.shape == (8, 64)
    x = torch.randn(8, 64, device=DEV)
    sx.copy_(x)
    with torch.no_grad():
        torch.testing.assert_close(g(*g.static_args), model(x), **FP32)


def test_dict_dims_static_argument_and_kwargs() -> None:
    table = torch.randn(100, 32, device=DEV)

    def fn(ids, pos, table, *, scale):
        return table[ids[:, 0]] * scale + pos[:, None].float()

    g = tr.graph(
        fn,
        torch.zeros(3, 1, dtype=torch.long, device=DEV),
        torch.zeros(3, dtype=torch.long, device=DEV),
        table,
        sizes=[4, 8],
        dim={"ids": 0, "pos": 0, "table": None},
        scale=0.5,
    )
    for n in range(1, 9):
        ids = torch.randint(0, 100, (n, 1), device=DEV)
        pos = torch.randint(0, 1000, (n,), device=DEV)
        assert torch.equal(g(ids, pos, table, scale=0.5), fn(ids, pos, table, scale=0.5))
    with pytest.raises(tr.ReplayInputError, match="'ids' has size 3 along dim 0 but .*'pos' has size 5"):
        g(torch.zeros(3, 1, dtype=torch.long, device=DEV),
          torch.zeros(5, dtype=torch.long, device=DEV), table, scale=0.5)


# -- padding ----------------------------------------------------------------------------------


class Recorder(nn.Module):
    """Row-independent; keeps every row it was called with (padding included) in a buffer."""

    def __init__(self, rows: int = 32, width: int = 16) -> None:
        super().__init__()
        self.register_buffer("seen", torch.full((rows, width), -99.0, device=DEV))

    def forward(self, x):
        self.seen[: x.shape[0]].copy_(x)
        return x * 2 + 1


@pytest.mark.parametrize("fill", [0.0, -3.5])
def test_padding_rows_hold_the_fill_value_and_never_leak(fill: float) -> None:
    m = Recorder().eval()
    g = tr.graph(m, torch.randn(5, 16, device=DEV), sizes=SIZES, fill_value=fill)
    for n in [31, 7, 3, 32, 1, 20, 17, 2, 9]:
        x = torch.randn(n, 16, device=DEV)
        y = g(x)
        s = target_size(SIZES, n)
        assert y.shape == (n, 16)
        assert torch.equal(y, x * 2 + 1)
        assert torch.equal(m.seen[:n], x)
        # the padding rows held the fill value, never rows of an earlier (larger) call
        assert torch.all(m.seen[n:s] == fill), (n, s)


def test_a_callable_that_writes_its_input_still_pads_cleanly() -> None:
    m = Recorder().eval()

    def fn(x):
        out = m(x)
        x.mul_(-1.0).add_(50.0)  # writes every row of the static input, padding included
        return out

    g = tr.graph(fn, torch.randn(4, 16, device=DEV), sizes=[8, 16, 32])
    for n in [6, 6, 3, 30, 30, 9]:
        x = torch.randn(n, 16, device=DEV)
        want, x_after = x * 2 + 1, x * -1.0 + 50.0
        assert torch.equal(g(x), want)
        assert torch.all(m.seen[n: target_size([8, 16, 32], n)] == 0.0)
        assert torch.equal(x, x_after)  # eager semantics: the write reached the caller's rows


# -- memory -----------------------------------------------------------------------------------

WIDTH = 4096
_W = None


def _chain(x):
    # Elementwise only: no cuBLAS, so no per-stream workspace in the measurement; rows are
    # independent and every step allocates a [B, 4096] fp32 intermediate (8 MiB at B = 512).
    w, b = _W
    for i in range(6):
        x = torch.tanh(x * w[i] + b[i])
    return x


def test_memory_grows_with_the_largest_size_not_the_number_of_sizes() -> None:
    global _W
    _W = (torch.randn(6, WIDTH, device=DEV), torch.randn(6, WIDTH, device=DEV))
    sizes = tr.default_sizes(512)
    x = torch.randn(512, WIDTH, device=DEV)
    base = reserved()

    alone = tr.graph(_chain, x, sizes=[512])
    alone(x)
    largest = reserved() - base
    largest_pool = alone.stats.pool_bytes
    del alone
    assert reserved() == base, "a released graph left memory reserved"

    every = tr.graph(_chain, x, sizes=sizes)
    for n in [1, 3, 8, 77, 300, 512]:
        xn = torch.randn(n, WIDTH, device=DEV)
        torch.testing.assert_close(every(xn), _chain(xn))
    del xn
    all_sizes = reserved() - base
    assert every.captured_sizes == sizes
    assert largest > 0
    assert all_sizes <= 1.2 * largest, (all_sizes / 2**20, largest / 2**20)
    assert every.stats.pool_bytes <= 1.2 * largest_pool
    del every
    assert reserved() == base


# -- fallback, cap, lazy ----------------------------------------------------------------------


def test_fallback_above_the_largest_size_warns_once_per_size(caplog: pytest.LogCaptureFixture) -> None:
    model = mlp(depth=2, width=64)
    g = tr.graph(model, torch.randn(4, 64, device=DEV), sizes=[1, 2, 4, 8])
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        for n in [9, 9, 12, 9, 12, 3]:
            x = torch.randn(n, 64, device=DEV)
            with torch.no_grad():
                torch.testing.assert_close(g(x), model(x), **FP32)
    warned = [r.getMessage() for r in caplog.records if "above the largest" in r.getMessage()]
    assert len(warned) == 2
    assert "size 9" in warned[0] and "1, 2, 4, 8" in warned[0] and "size 12" in warned[1]
    assert g.stats.fallbacks == 5 and g.stats.replays == 1

    strict = tr.graph(model, torch.randn(4, 64, device=DEV), sizes=[1, 2, 4, 8], fallback="error")
    with pytest.raises(tr.ReplayInputError, match="size 9.*add 9 to sizes or pass fallback='eager'"):
        strict(torch.randn(9, 64, device=DEV))
    assert strict.stats.replays == 0


def test_lazy_and_ahead_capture_agree() -> None:
    model = mlp()
    ahead = tr.graph(model, torch.randn(2, 256, device=DEV), sizes=SIZES)
    lazy = tr.graph(model, torch.randn(2, 256, device=DEV), sizes=SIZES, capture="lazy",
                    outputs="clone")
    assert lazy.captured_sizes == [32]
    for n in [5, 1, 32, 17, 5, 2]:
        x = torch.randn(n, 256, device=DEV)
        a = ahead(x).clone()
        torch.testing.assert_close(lazy(x), a, **FP32)
    assert lazy.captured_sizes == [1, 2, 8, 24, 32]
    assert lazy.stats.captures == 5 and lazy.stats.replays == 6


def test_max_graphs_caps_lazy_captures(caplog: pytest.LogCaptureFixture) -> None:
    model = mlp(depth=2, width=64)
    g = tr.graph(model, torch.randn(2, 64, device=DEV), sizes=SIZES, capture="lazy", max_graphs=2)
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        for n in [3, 3, 1, 1, 30]:
            x = torch.randn(n, 64, device=DEV)
            with torch.no_grad():
                torch.testing.assert_close(g(x), model(x), **FP32)
    assert g.captured_sizes == [4, 32]
    assert g.stats.fallbacks == 2 and g.stats.replays == 3
    assert sum("max_graphs=2" in r.getMessage() for r in caplog.records) == 1


# -- output policy ----------------------------------------------------------------------------


@needs_checked
def test_outputs_go_stale_across_sizes() -> None:
    model = mlp(depth=2, width=64)
    g = tr.graph(model, torch.randn(4, 64, device=DEV), sizes=[2, 4, 8])
    x3, x5 = torch.randn(3, 64, device=DEV), torch.randn(5, 64, device=DEV)
    y3 = g(x3)
    kept = y3.clone()
    y5 = g(x5)  # another size, the same output buffers
    assert y3.shape == (3, 64)
    with pytest.raises(RuntimeError, match="StaleOutputError"):
        y3.sum().item()
    y5b = g(torch.randn(5, 64, device=DEV))  # the same size
    with pytest.raises(RuntimeError, match="StaleOutputError"):
        y5[1:].sum().item()
    with torch.no_grad():
        torch.testing.assert_close(kept, model(x3), **FP32)
    assert y5b.shape == (5, 64)


def test_an_output_fed_back_as_input_is_read_before_it_goes_stale() -> None:
    lin = nn.Linear(32, 32).to(DEV)

    def step(h):
        return torch.tanh(lin(h))

    g = tr.graph(step, torch.randn(4, 32, device=DEV), sizes=[2, 4, 8])
    h = ref = torch.randn(3, 32, device=DEV)
    for _ in range(10):
        h = g(h)
        with torch.no_grad():
            ref = step(ref)
    torch.testing.assert_close(h, ref, **FP32)


def test_clone_policy_keeps_outputs_of_every_size() -> None:
    model = mlp(depth=2, width=64)
    g = tr.graph(model, torch.randn(4, 64, device=DEV), sizes=[2, 4, 8], outputs="clone")
    xs = [torch.randn(n, 64, device=DEV) for n in [3, 5, 1, 8, 3]]
    ys = [g(x) for x in xs]
    with torch.no_grad():
        for x, y in zip(xs, ys):
            torch.testing.assert_close(y, model(x), **FP32)


def test_static_policy_returns_slices_of_the_shared_output_buffer() -> None:
    g = tr.graph(lambda x: x + 1, torch.randn(8, 4, device=DEV), sizes=[4, 8], outputs="static")
    y3 = g(torch.zeros(3, 4, device=DEV))
    y6 = g(torch.ones(6, 4, device=DEV))
    assert y3.data_ptr() == y6.data_ptr()  # one buffer for every size
    assert torch.equal(y3, torch.full((3, 4), 2.0, device=DEV))  # overwritten, as documented


def test_outputs_live_outside_the_pool_so_graphs_sharing_it_do_not_clobber_them() -> None:
    a, b = mlp(depth=2, width=64), mlp(depth=3, width=64)
    ga = tr.graph(a, torch.randn(4, 64, device=DEV), sizes=[2, 4, 8])
    gb = tr.graph(b, torch.randn(8, 64, device=DEV), pool=ga)  # one shape, same pool
    assert gb.pool is ga.pool
    x3 = torch.randn(3, 64, device=DEV)
    ya = ga(x3)
    yb = gb(torch.randn(8, 64, device=DEV))
    with torch.no_grad():
        torch.testing.assert_close(ya, a(x3), **FP32)  # still valid after gb replayed
    ga(torch.randn(5, 64, device=DEV))  # ga was captured first: its scratch may hold gb's outputs
    if _compat.HAS_CHECKED_OUTPUTS:
        with pytest.raises(RuntimeError, match="StaleOutputError"):
            yb.sum().item()


# -- the built-in Llama -----------------------------------------------------------------------

SMALL = LlamaConfig(
    n_layers=2, dim=256, n_heads=8, n_kv_heads=2, vocab_size=1024, intermediate_size=512,
    max_seq_len=64, max_batch=8,
)


def _cache(model) -> list[torch.Tensor]:
    return [t for layer in model.layers for t in (layer.attention.k_cache, layer.attention.v_cache)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_decodes_32_steps_like_eager_through_padded_graphs(dtype: torch.dtype) -> None:
    graphed = build_llama(SMALL, DEV, dtype, seed=0)
    eager = build_llama(SMALL, DEV, dtype, seed=0)  # an identical twin with its own cache
    batch = 3  # padded to 4
    gen = torch.Generator(device=DEV).manual_seed(0)
    ids = torch.randint(0, SMALL.vocab_size, (batch, 1), device=DEV, generator=gen)  # [3, 1]
    positions = torch.zeros(batch, dtype=torch.long, device=DEV)  # [3]
    g = tr.graph(graphed, ids, positions, sizes=[1, 2, 4, 8])
    assert all(torch.count_nonzero(t) == 0 for t in _cache(graphed)), "capture wrote the cache"

    # Padding may change the GEMM kernel (M = 4, not 3), so logits agree to rounding (fp32 or
    # bf16), not always bitwise; greedy tokens must then agree except where eager's top two
    # logits are closer than that rounding (a near tie), after which both continue from eager's.
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}
    near_ties = 0
    ids_g = ids_e = ids
    for step in range(32):
        positions = torch.full((batch,), step, dtype=torch.long, device=DEV)
        logits_g = g(ids_g, positions)  # [3, V]
        with torch.no_grad():
            logits_e = eager(ids_e, positions)
        assert logits_g.shape == (batch, SMALL.vocab_size) and logits_g.dtype == dtype
        torch.testing.assert_close(logits_g.float(), logits_e.float(), **tol)
        next_g = logits_g.argmax(-1, keepdim=True)
        next_e = logits_e.argmax(-1, keepdim=True)
        if not torch.equal(next_g, next_e):
            top2 = logits_e.float().topk(2, dim=-1).values
            gap = (top2[:, 0] - top2[:, 1])[(next_g != next_e)[:, 0]]
            assert bool(torch.all(gap <= 2 * tol["atol"])), (
                f"step {step}: tokens {next_g.tolist()} vs eager {next_e.tolist()}"
            )
            near_ties += 1
            next_g = next_e  # both continue from the same tokens
        ids_g, ids_e = next_g, next_e
    assert near_ties <= 8, f"{near_ties} of 32 steps were near ties"
    assert g.stats.replays == 32 and g.stats.size_hits[4] == 32
    assert g.stats.real_rows == 96 and g.stats.padded_rows == 32
    for tg, te in zip(_cache(graphed), _cache(eager)):
        torch.testing.assert_close(tg[:batch].float(), te[:batch].float(), **tol)


def test_an_output_that_is_an_argument_is_the_callers_tensor() -> None:
    """``return h, mask, x, mask[:2], x[:, -1:]`` with sizes=: eagerly the caller's own tensors
    (views of them). The fixed-shape mask came back as the graph's static buffer, which the next
    call's copy-in overwrote without an error; ``x`` and its view as copies in the shared output
    buffers."""
    lin = nn.Linear(16, 16).cuda()

    def layer(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return lin(x) * mask, mask, x, mask[:2], x[:, -1:]

    g = tr.graph(layer, torch.randn(8, 16, device="cuda"), torch.rand(16, device="cuda"),
                 sizes=[2, 4, 8], dim={"x": 0, "mask": None})
    kept = []
    with torch.no_grad():
        for n in (3, 8, 1, 5, 2, 7):
            x, mask = torch.randn(n, 16, device="cuda"), torch.rand(16, device="cuda")
            h, m, xo, head, last = g(x, mask)
            assert m is mask and xo is x and head._base is mask and last._base is x
            torch.testing.assert_close(h, lin(x) * mask)
            x.mul_(2)  # the caller's write after the call: the view of x sees it, as eagerly
            assert torch.equal(last, x[:, -1:])
            kept.append((mask.clone(), m, head, x[:, -1:].clone(), last))
    for want, m, head, want_last, last in kept:  # every call's, after all later calls
        assert torch.equal(m, want) and torch.equal(head, want[:2]) and torch.equal(last, want_last)


def _padding_reports(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "padding changes what" in r.getMessage()]


def _state_reports(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "padding changes the state" in r.getMessage()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padding_that_changes_the_real_rows_is_reported_and_independent_rows_are_not(
    dtype: torch.dtype, caplog: pytest.LogCaptureFixture,
) -> None:
    """The probe compares a call padded to the largest size with the same rows unpadded, on the
    GPU's own kernels (another M, another GEMM kernel): quiet for the built-in Llama's decode
    step and for HF BERT with its padded positions masked, reported for a mean over the rows and
    for BERT with its padded positions attended."""
    transformers = pytest.importorskip("transformers")
    caplog.set_level(logging.WARNING, logger="torchreplay")
    llama = build_llama(SMALL, DEV, dtype, seed=0)
    ids = torch.randint(0, SMALL.vocab_size, (3, 1), device=DEV)
    g = tr.graph(llama, ids, torch.full((3,), 4, device=DEV), sizes=[1, 2, 4, 8], capture="lazy")
    assert _padding_reports(caplog) == []
    assert g.stats.padding_check.startswith("rows independent: 3 rows padded to 8"), g.stats.padding_check
    # its padding rows write their own cache rows (3..7, at the fill position): a note, no warning
    assert "the padding rows also write layers.0.attention.k_cache (" in g.stats.padding_check

    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, intermediate_size=256,
                                  max_position_embeddings=64)
    bert = transformers.BertModel(cfg, add_pooling_layer=False).to(DEV, dtype).eval()

    def encode(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return bert(input_ids=ids, attention_mask=mask).last_hidden_state

    ids = torch.randint(1, 1000, (2, 11), device=DEV)
    mask = torch.ones(2, 11, dtype=torch.long, device=DEV)
    g = tr.graph(encode, ids, mask, sizes=[16, 32], dim=1)  # the mask's padding: 0, masked
    assert _padding_reports(caplog) == []
    assert g.stats.padding_check.startswith("rows independent: 11 rows padded to 32"), g.stats.padding_check
    with torch.no_grad():
        for n in (11, 5, 23):
            ids = torch.randint(1, 1000, (2, n), device=DEV)
            mask = torch.ones(2, n, dtype=torch.long, device=DEV)
            tol = {} if dtype == torch.float32 else {"rtol": 5e-2, "atol": 5e-2}
            torch.testing.assert_close(g(ids, mask).float(), encode(ids, mask).float(), **tol)
    if dtype == torch.float32:  # (in bf16 the change, 0.04, is near its rounding: not asserted)
        ids = torch.randint(1, 1000, (2, 11), device=DEV)
        mask = torch.ones(2, 11, dtype=torch.long, device=DEV)
        h = tr.graph(encode, ids, mask, sizes=[16, 32], dim=1, fill_value={1: 1}, capture="lazy")
        assert h.stats.padding_check.startswith("CHANGES the result: output of 11 rows padded to 32")
        (report,) = _padding_reports(caplog)  # the padding attended: every real row changes
        assert "of a call of 11 rows" in report and "padded to 32" in report
        assert "args[1] 'mask': 1" in report

    caplog.clear()
    lin = nn.Linear(64, 64).to(DEV, dtype)
    tr.graph(lambda x: lin(x - x.mean(0)), torch.randn(5, 64, device=DEV, dtype=dtype),
             sizes=[1, 2, 4, 8], capture="lazy")
    (report,) = _padding_reports(caplog)
    assert "of a call of 5 rows" in report and "padded to 8" in report


class _Prefill(nn.Module):
    """A prefill step along the sequence: each token's key goes into a sequence cache at its
    position (``index_copy_``), as a static KV cache's update does."""

    def __init__(self, dim: int = 64, slots: int = 64) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("cache", torch.zeros(slots, dim))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        k = self.proj(x)
        self.cache.index_copy_(0, pos, k)
        return torch.relu(k)


def test_padding_that_writes_over_the_real_rows_state_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    """A prefill whose positions are padded with 0 writes the padding tokens' keys into slot 0,
    over the real first token's: the probe compares what the padded and the unpadded call leave
    in the cache, on the GPU's own kernels, and warns. With the padding positions moved past the
    real ones (fill_value=), the padding writes slots of its own: a note only. Either way the
    outputs equal eager over many calls, and the cache after each exact-size call too."""
    caplog.set_level(logging.WARNING, logger="torchreplay")
    torch.manual_seed(0)
    m = _Prefill().to(DEV)
    x, pos = torch.randn(11, 64, device=DEV), torch.arange(11, device=DEV)
    g = tr.graph(m, x, pos, sizes=[16, 32], capture="lazy")
    assert _padding_reports(caplog) == []  # the outputs are right
    (report,) = _state_reports(caplog)
    assert "_Prefill.cache: " in report and "padded to 32" in report and "fill_value=" in report, report
    assert g.stats.padding_check.startswith("CHANGES state: _Prefill.cache"), g.stats.padding_check
    assert torch.equal(m.cache, torch.zeros_like(m.cache))  # the build put it back

    caplog.clear()
    h = tr.graph(m, x, pos, sizes=[16, 32], fill_value={"pos": 63})
    assert _padding_reports(caplog) == [] and _state_reports(caplog) == []
    assert "the padding rows also write _Prefill.cache (" in h.stats.padding_check, h.stats.padding_check
    ref = _Prefill().to(DEV)
    ref.load_state_dict(m.state_dict())
    with torch.no_grad():
        for i in range(30):
            n = (11, 16, 32)[i % 3]
            start = int(torch.randint(0, 63 - n + 1, ()))
            x, pos = torch.randn(n, 64, device=DEV), torch.arange(start, start + n, device=DEV)
            torch.testing.assert_close(h(x, pos), ref(x, pos))
            # every slot but the padding's own (63) as eager left it
            torch.testing.assert_close(m.cache[:63], ref.cache[:63])
