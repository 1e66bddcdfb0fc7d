"""The built-in models on the CPU: shapes, seeded weights, the in-place KV cache, and the decode
step against a naive full-sequence recompute written here from the same weights."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from torchreplay.models import CNNConfig, MLP, build_cnn, build_llama, build_mlp
from torchreplay.models.llama import TINY, Llama, LlamaConfig
from torchreplay.models.mlp import MLPConfig


# ---------------------------------------------------------------------------------------------
# MLP and CNN


def test_mlp_layout_and_shape() -> None:
    model = build_mlp(MLPConfig(depth=24, width=512))
    assert isinstance(model, MLP)
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 24 and all(m.in_features == m.out_features == 512 for m in linears)
    assert model(torch.randn(8, 512)).shape == (8, 512)


def test_cnn_shape_and_resnet50_layout() -> None:
    small = build_cnn(CNNConfig(depths=(1, 1, 1, 1), width=8, num_classes=10)).eval()
    assert small(torch.randn(2, 3, 64, 64)).shape == (2, 10)
    # The default layout is ResNet-50's: torchvision's resnet50 has exactly this many parameters.
    full = build_cnn(CNNConfig())
    assert sum(p.numel() for p in full.parameters()) == 25_557_032
    assert sum(isinstance(m, torch.nn.Conv2d) for m in full.modules()) == 53


@pytest.mark.parametrize(
    "build", [lambda s: build_mlp(MLPConfig(depth=2, width=16), seed=s), lambda s: build_llama(TINY, seed=s)]
)
def test_weights_depend_only_on_seed_and_leave_global_rng_alone(build) -> None:
    rng_before = torch.get_rng_state()
    a, b, c = build(0), build(0), build(1)
    assert torch.equal(torch.get_rng_state(), rng_before)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)


# ---------------------------------------------------------------------------------------------
# Llama: shapes and argument checks


def test_llama_decode_shapes_and_dtype() -> None:
    model = build_llama(TINY)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    logits = model(torch.randint(0, TINY.vocab_size, (3, 1)), torch.tensor([0, 1, 2]))
    assert logits.shape == (3, TINY.vocab_size) and logits.dtype == torch.float32
    cache = model.layers[0].attention.k_cache
    assert cache.shape == (TINY.max_batch, TINY.n_kv_heads, TINY.max_seq_len, TINY.head_dim)
    assert model.config.kv_cache_bytes(torch.float32) == sum(
        b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith("_cache")
    )
    bf16 = build_llama(TINY, dtype=torch.bfloat16)
    assert bf16(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long)).dtype == torch.bfloat16


def test_llama_rejects_bad_shapes() -> None:
    model = build_llama(TINY)
    with pytest.raises(ValueError, match="max_batch"):
        model(torch.zeros(TINY.max_batch + 1, 1, dtype=torch.long), torch.zeros(TINY.max_batch + 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[B, 1\]"):
        model(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="positions"):
        model(torch.zeros(2, 1, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="n_kv_heads"):
        LlamaConfig(n_heads=16, n_kv_heads=5)


# ---------------------------------------------------------------------------------------------
# Llama: a naive reference from the same weights, in float64


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    # x: [T, heads, D]; pairs (i, i + D/2) rotate by angle pos * theta^(-2i/D).
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[:, None, None] * inv_freq  # [T, 1, D/2]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], dim=-1)


def naive_last_logits(model: Llama, tokens: list[int]) -> torch.Tensor:
    """Logits after the last of ``tokens`` (positions 0..T-1) by full causal attention."""
    cfg = model.config
    W = {k: v.double() for k, v in model.state_dict().items()}
    T, H, KVH, D = len(tokens), cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    pos = torch.arange(T)
    x = W["tok_embeddings.weight"][torch.tensor(tokens)]  # [T, dim]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        h = _rms(x, W[p + "attention_norm.weight"], cfg.norm_eps)
        q, k, v = (h @ W[p + "attention.wqkv.weight"].T).split([H * D, KVH * D, KVH * D], dim=-1)
        q = _rope(q.view(T, H, D), pos, cfg.rope_theta)
        k = _rope(k.view(T, KVH, D), pos, cfg.rope_theta).repeat_interleave(H // KVH, dim=1)
        v = v.view(T, KVH, D).repeat_interleave(H // KVH, dim=1)  # [T, H, D]
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(D)
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + torch.einsum("hts,shd->thd", attn, v).reshape(T, H * D) @ W[p + "attention.wo.weight"].T
        h = _rms(x, W[p + "ffn_norm.weight"], cfg.norm_eps)
        ff = F.silu(h @ W[p + "feed_forward.w1.weight"].T) * (h @ W[p + "feed_forward.w3.weight"].T)
        x = x + ff @ W[p + "feed_forward.w2.weight"].T
    return (_rms(x, W["norm.weight"], cfg.norm_eps) @ W["output.weight"].T)[-1]


def test_decode_matches_naive_full_recompute() -> None:
    model = build_llama(TINY, seed=3)
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(0, TINY.vocab_size, (3,), generator=gen).tolist()
    b = torch.randint(0, TINY.vocab_size, (4,), generator=gen).tolist()
    # Two rows at different positions in one batch: row 0 stalls at step 1 by writing token a0
    # at position 0 again (an idempotent rewrite), row 1 advances every step.
    steps = [([a[0], b[0]], [0, 0]), ([a[0], b[1]], [0, 1]), ([a[1], b[2]], [1, 2]), ([a[2], b[3]], [2, 3])]
    for tokens, positions in steps:
        logits = model(torch.tensor(tokens)[:, None], torch.tensor(positions))
        for row, seq in enumerate((a, b)):
            ref = naive_last_logits(model, seq[: positions[row] + 1])
            torch.testing.assert_close(logits[row].double(), ref, rtol=1e-4, atol=1e-5)


def test_host_lengths_attention_equals_the_masked_one() -> None:
    """lengths = positions + 1 on the host gives the logits of the mask made on the device;
    padded rows (past len(lengths)) do not change the real rows."""
    gen = torch.Generator().manual_seed(0)
    masked, host = build_llama(TINY, seed=3), build_llama(TINY, seed=3)
    for _ in range(3):
        positions = torch.randint(0, TINY.max_seq_len, (3,), generator=gen)
        ids = torch.randint(0, TINY.vocab_size, (3, 1), generator=gen)
        want = masked(ids, positions)
        got = host(ids, positions, positions + 1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    padded = host(torch.cat([ids, ids[:1]]), torch.cat([positions, positions[:1]]), positions + 1)
    torch.testing.assert_close(padded[:3], want, rtol=1e-5, atol=1e-5)


def test_kv_cache_is_written_in_place_only_at_given_positions() -> None:
    cfg = dataclasses.replace(TINY, max_batch=4)
    model = build_llama(cfg, seed=1)
    attn = [layer.attention for layer in model.layers]
    ptrs = [(m.k_cache.data_ptr(), m.v_cache.data_ptr()) for m in attn]
    ids, positions = torch.tensor([[5], [9]]), torch.tensor([3, 7])
    model(ids, positions)

    assert ptrs == [(m.k_cache.data_ptr(), m.v_cache.data_ptr()) for m in attn]
    for m in attn:
        for cache in (m.k_cache, m.v_cache):
            written = torch.zeros_like(cache, dtype=torch.bool)
            written[0, :, 3], written[1, :, 7] = True, True
            assert torch.all(cache[~written] == 0), "a slot other than the given positions changed"
            assert torch.all(cache[0, :, 3].abs().sum(-1) > 0) and torch.all(cache[1, :, 7].abs().sum(-1) > 0)

    # The exact values in layer 0: v is a plain projection, k is rotated by its position.
    W, H, KVH, D = model.state_dict(), cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    h = _rms(W["tok_embeddings.weight"][ids[:, 0]], W["layers.0.attention_norm.weight"], cfg.norm_eps)
    _, k, v = (h @ W["layers.0.attention.wqkv.weight"].T).split([H * D, KVH * D, KVH * D], dim=-1)
    k = _rope(k.view(2, KVH, D).double(), positions, cfg.rope_theta).float()
    torch.testing.assert_close(attn[0].v_cache[[0, 1], :, [3, 7]], v.view(2, KVH, D))
    torch.testing.assert_close(attn[0].k_cache[[0, 1], :, [3, 7]], k, rtol=1e-5, atol=1e-6)

    model.reset_cache()
    assert all(int(m.k_cache.count_nonzero()) == 0 for m in attn)
    assert ptrs == [(m.k_cache.data_ptr(), m.v_cache.data_ptr()) for m in attn]


# ---------------------------------------------------------------------------------------------
# The compile rows' models (models/blocks.py)


def test_split_mlp_computes_the_mlp_and_cuts_it_evenly() -> None:
    from torchreplay.models.blocks import SplitMLP, gelu_mlp, split_mark_op, split_mark_out_op

    x = torch.randn(3, 16)
    plain = gelu_mlp(depth=6, width=16)
    assert len(plain) == 12 and isinstance(plain[1], torch.nn.GELU)
    with torch.no_grad():
        for style in ("returns", "writes", "clone"):
            for pieces in (1, 2, 4, 6):
                model = SplitMLP(pieces, depth=6, width=16, style=style)
                assert len(model.boundaries) == pieces - 1
                torch.testing.assert_close(model(x), plain(x))
    assert split_mark_op() is split_mark_op()  # registered once
    out = torch.zeros(3, 16)
    assert split_mark_out_op()(x, out) is None
    torch.testing.assert_close(out, x)
    with pytest.raises(ValueError, match="pieces must be in 1..6"):
        SplitMLP(7, depth=6, width=16)
    with pytest.raises(ValueError, match="style must be one of"):
        SplitMLP(2, depth=6, width=16, style="other")


def test_two_block_models() -> None:
    from torchreplay.models.blocks import DataDependentIf, NonzeroBetween

    x = torch.randn(4, 16)
    with torch.no_grad():
        m = DataDependentIf(depth=2, width=16)
        h = m.a(x)
        torch.testing.assert_close(m(x), m.b(h * 2 if h.sum() > 0 else h))
        n = NonzeroBetween(depth=2, width=16)
        y, idx = n(x)
        assert y.shape == (4, 16) and torch.equal(idx, torch.nonzero(n.a(x) > 0))
