"""A small Llama-style decoder with a static KV cache, written for decode-step benchmarks.

RMSNorm, rotary embeddings, grouped-query attention through ``scaled_dot_product_attention`` and a
SwiGLU MLP, in the layout of Llama 2/3 (names follow gpt-fast). The KV cache is a pair of buffers
per layer, allocated once at their largest size and updated in place at the positions the caller
gives, so one decode step has static shapes for a given batch and is capturable as a CUDA graph:
no ``.item()``, no data-dependent shapes, attention always over the whole cache with a mask.

Random weights from a seed; nothing is downloaded.

Shapes: B batch (<= ``max_batch``), S ``max_seq_len``, H query heads, KVH KV heads,
G = H / KVH query heads per KV head, D ``head_dim``, V ``vocab_size``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LlamaConfig", "Llama", "build_llama", "host_attention", "TINY"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Sizes of :class:`Llama`; the defaults are the benchmark model (about 245M parameters).

    Args:
        n_layers: transformer blocks.
        dim: hidden size.
        n_heads: query heads.
        n_kv_heads: key/value heads (grouped-query attention); must divide ``n_heads``.
        vocab_size: tokens.
        intermediate_size: hidden size of the SwiGLU MLP.
        max_seq_len: positions held by the KV cache; a decode step attends over all of them.
        max_batch: rows of the KV cache; a decode step of batch B uses rows ``0 .. B-1``.
        rope_theta: base of the rotary embedding frequencies.
        norm_eps: epsilon of RMSNorm.
    """

    n_layers: int = 16
    dim: int = 1024
    n_heads: int = 16
    n_kv_heads: int = 4
    vocab_size: int = 32000
    intermediate_size: int = 2816
    max_seq_len: int = 1024
    max_batch: int = 32
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be a multiple of n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim (dim / n_heads = {self.head_dim}) must be even for rotary")
        for name in ("n_layers", "vocab_size", "intermediate_size", "max_seq_len", "max_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def kv_cache_bytes(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """Return the bytes of all KV cache buffers: ``2 * n_layers * max_batch * KVH * S * D``."""
        elems = 2 * self.n_layers * self.max_batch * self.n_kv_heads * self.max_seq_len * self.head_dim
        return elems * dtype.itemsize


#: A two-layer model for CPU tests: every code path of the default one, in milliseconds.
TINY = LlamaConfig(
    n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=128, intermediate_size=160,
    max_seq_len=16, max_batch=4,
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The mean of squares is taken in fp32: bf16's 8-bit mantissa loses it.
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def precompute_rope(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``cos, sin`` of every position's rotary angles, each ``[S, D]`` in fp32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # [D/2]
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)  # [S, D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [S, D]: the two halves rotate together
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, heads, D]`` by ``cos, sin [B, 1, D]`` (the "rotate half" convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def host_attention(
    out: torch.Tensor,  # [B, KVH, G, D], written
    q: torch.Tensor,  # [B, KVH, G, D]
    k_cache: torch.Tensor,  # [B, KVH, S, D]
    v_cache: torch.Tensor,  # [B, KVH, S, D]
    lengths: torch.Tensor,  # [n <= B] long, on the CPU
) -> None:
    """Attention of each row over its first ``lengths[b]`` cache slots, the lengths on the host.

    What serving engines do with host-side sequence lengths, and what a CUDA graph cannot hold:
    the span ``L = max(lengths)`` is a host value (a graph would freeze it), and the mask is made
    on the CPU and copied to the GPU each call. Rows past ``len(lengths)`` (padding) attend to
    slot 0. Writes ``out`` and returns nothing, so that it fits every breakable-graph tool (some
    refuse a break that returns a CUDA tensor).
    """
    B, n = q.shape[0], lengths.shape[0]
    lens = lengths if n == B else torch.cat([lengths, lengths.new_ones(B - n)])
    span = int(lens.max())
    mask = (torch.arange(span) < lens[:, None]).to(q.device, non_blocking=True)  # [B, L]
    out.copy_(F.scaled_dot_product_attention(
        q, k_cache[:, :, :span], v_cache[:, :, :span], attn_mask=mask[:, None, None, :]
    ))


class Attention(nn.Module):
    """Grouped-query attention of one decode token over a static, in-place KV cache."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        qkv_dim = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
        self.wqkv = nn.Linear(config.dim, qkv_dim, bias=False)  # one GEMM for q, k and v
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)
        cache_shape = (config.max_batch, config.n_kv_heads, config.max_seq_len, config.head_dim)
        # Not persistent: a cache is state of a generation, not of the model's weights.
        self.register_buffer("k_cache", torch.zeros(cache_shape), persistent=False)  # [Bmax, KVH, S, D]
        self.register_buffer("v_cache", torch.zeros(cache_shape), persistent=False)  # [Bmax, KVH, S, D]

    def forward(
        self,
        x: torch.Tensor,  # [B, dim]
        cos: torch.Tensor,  # [B, 1, D]
        sin: torch.Tensor,  # [B, 1, D]
        positions: torch.Tensor,  # [B] long
        mask: torch.Tensor | None,  # [B, 1, 1, S] bool
        lengths: torch.Tensor | None = None,  # [B] long on the CPU: host_attention instead
    ) -> torch.Tensor:
        B = x.shape[0]
        H, KVH, D = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.wqkv(x).split([H * D, KVH * D, KVH * D], dim=-1)
        q = apply_rope(q.view(B, H, D), cos, sin)  # [B, H, D]
        k = apply_rope(k.view(B, KVH, D), cos, sin)  # [B, KVH, D]
        v = v.view(B, KVH, D)

        # Write this token's k, v into each row's own position, in place: the cache keeps its
        # address, so a captured graph sees the update on every replay.
        k_cache, v_cache = self.k_cache[:B], self.v_cache[:B]  # views: [B, KVH, S, D]
        index = positions.view(B, 1, 1, 1).expand(B, KVH, 1, D)
        k_cache.scatter_(2, index, k.unsqueeze(2))
        v_cache.scatter_(2, index, v.unsqueeze(2))

        # One query per head, so the G query heads that share a KV head become G query rows of
        # that head: grouped-query attention without repeating (copying) the cache.
        q = q.view(B, KVH, H // KVH, D)  # [B, KVH, G, D]
        if lengths is None:
            y = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask)  # [B, KVH, G, D]
        else:
            y = torch.empty_like(q)
            host_attention(y, q, k_cache, v_cache, lengths)
        return self.wo(y.reshape(B, H * D))  # [B, dim]


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.intermediate_size, bias=False)  # gate
        self.w3 = nn.Linear(config.dim, config.intermediate_size, bias=False)  # up
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None, lengths: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, positions, mask, lengths)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """The decoder; :meth:`forward` is one decode step. Build it with :func:`build_llama`.

    .. warning::
        A decode step writes the KV cache in place at ``positions``; calls for the same rows must
        come in generation order. Positions are not range-checked (that would need a host sync):
        each must be ``< max_seq_len``.
    """

    def __init__(self, config: LlamaConfig = LlamaConfig()) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = precompute_rope(config.head_dim, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # [S, D]
        self.register_buffer("rope_sin", sin, persistent=False)  # [S, D]
        self.register_buffer("seq_index", torch.arange(config.max_seq_len), persistent=False)  # [S]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run one decode step and return the next-token logits.

        Args:
            input_ids: ``[B, 1]`` long, this step's token of each row.
            positions: ``[B]`` long, this token's position in each row's sequence.
            lengths: ``None`` (default): attention over the whole cache with a mask made on the
                GPU (capturable). Else ``[B]`` long on the CPU, ``positions + 1``: attention
                through :func:`host_attention` (not capturable; what breakable graphs are for).

        Returns:
            ``[B, vocab_size]`` logits, in the model's dtype.
        """
        B = input_ids.shape[0]
        if input_ids.dim() != 2 or input_ids.shape[1] != 1:
            raise ValueError(f"input_ids must be [B, 1], got {tuple(input_ids.shape)}")
        if positions.shape != (B,):
            raise ValueError(f"positions must be [B] = [{B}], got {tuple(positions.shape)}")
        if B > self.config.max_batch:
            raise ValueError(
                f"batch {B} exceeds the KV cache's max_batch={self.config.max_batch}; "
                "build the model with a larger LlamaConfig.max_batch"
            )
        x = self.tok_embeddings(input_ids[:, 0])  # [B, dim]
        cos = self.rope_cos[positions].unsqueeze(1)  # [B, 1, D], broadcast over heads
        sin = self.rope_sin[positions].unsqueeze(1)
        # Row b sees cache slots 0..positions[b]; later slots hold zeros or an older sequence.
        mask = None
        if lengths is None:
            mask = (self.seq_index[None, :] <= positions[:, None])[:, None, None, :]  # [B, 1, 1, S]
        for layer in self.layers:
            x = layer(x, cos, sin, positions, mask, lengths)
        return self.output(self.norm(x))  # [B, V]

    def decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Same as calling the module: one decode step, ``[B, 1], [B] -> [B, V]``."""
        return self(input_ids, positions)

    @torch.no_grad()
    def reset_cache(self) -> None:
        """Zero every KV cache buffer in place (their addresses do not change)."""
        for layer in self.layers:
            layer.attention.k_cache.zero_()
            layer.attention.v_cache.zero_()

    @torch.no_grad()
    def _init_weights(self, seed: int, std: float = 0.02) -> None:
        # Drawn on the CPU from a private generator: the same seed gives the same weights on
        # every device and dtype, and the global RNG is not touched.
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if isinstance(self.get_submodule(name.rpartition(".")[0]), RMSNorm):
                p.fill_(1.0)
            else:
                p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=gen))

    @torch.no_grad()
    def _init_buffers(self) -> None:
        cos, sin = precompute_rope(self.config.head_dim, self.config.max_seq_len, self.config.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        self.seq_index.copy_(torch.arange(self.config.max_seq_len))
        self.reset_cache()


def build_llama(
    config: LlamaConfig = LlamaConfig(),
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> Llama:
    """Build a :class:`Llama` with random weights from ``seed``, in eval mode, without gradients.

    Args:
        config: sizes; the KV cache takes ``config.kv_cache_bytes(dtype)`` on ``device``.
        device: where weights and cache live.
        dtype: defaults to bfloat16 on CUDA and float32 elsewhere.
        seed: weights depend only on it (and the config), not on device or global RNG.

    Returns:
        The model. Its parameters do not require grad (it is an inference model: an autograd
        graph through the in-place cache would grow every step); ``requires_grad_()`` undoes it.
    """
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # Built on the meta device and materialised once: no throw-away default initialisation of
    # a quarter-billion parameters, and no fp32 copy on the GPU.
    with torch.device("meta"):
        model = Llama(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    model._init_weights(seed)
    model._init_buffers()
    return model.eval().requires_grad_(False)
