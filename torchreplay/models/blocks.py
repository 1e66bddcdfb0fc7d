"""Models of the ``compile-*`` benchmark rows: what ``torch.compile`` backends meet in practice.

- :func:`gelu_mlp`: ``depth`` x ``Linear(width, width)`` + GELU, the plain launch-bound case.
- :class:`DataDependentIf`: two blocks with an ``if`` on a tensor's value between them (a host
  read: Dynamo breaks the graph there).
- :class:`NonzeroBetween`: two blocks with ``torch.nonzero`` between them, whose result is
  returned too (an output size that depends on the data).
- :class:`SplitMLP`: the MLP cut into ``pieces`` by a custom op (:func:`split_mark_op`), to
  measure what each split costs a piecewise backend.
- :class:`ResidualBlock`: ``x + fc2(gelu(fc1(x))) * scale`` (a buffer), the repeated unit of
  a model compiled block by block (regional compilation).
- :func:`bert_encoder`: Hugging Face's ``BertModel`` (random weights) returning its last hidden
  state, when ``transformers`` is installed.

Weights come from a seed with the global RNG left as it was. Plain PyTorch: nothing here imports
torchreplay. The factories return ``(model, args)`` for ``torchreplay explain`` and ``check``::

    torchreplay explain torchreplay.models.blocks:nonzero_factory
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

__all__ = [
    "SPLIT_MARK",
    "gelu_mlp",
    "DataDependentIf",
    "NonzeroBetween",
    "SplitMLP",
    "ResidualBlock",
    "split_mark_op",
    "split_mark_out_op",
    "SPLIT_STYLES",
    "bert_encoder",
    "data_if_factory",
    "nonzero_factory",
    "split_mlp_factory",
]

#: The splitting op of :class:`SplitMLP`, as ``splitting_ops=`` names it.
SPLIT_MARK = "torchreplay_bench.split_mark"


def _seeded(seed: int, make: Callable[[], nn.Module]) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make()


def gelu_mlp(depth: int = 12, width: int = 1024, seed: int = 0) -> nn.Sequential:
    """Return ``depth`` x (``Linear(width, width)``, GELU) on the CPU: x [B, width] -> [B, width]."""

    def make() -> nn.Sequential:
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU()]
        return nn.Sequential(*layers)

    return _seeded(seed, make)  # type: ignore[return-value]


class _TwoBlocks(nn.Module):
    def __init__(self, depth: int = 6, width: int = 1024, seed: int = 0) -> None:
        super().__init__()
        self.a = gelu_mlp(depth, width, seed)
        self.b = gelu_mlp(depth, width, seed + 1)


class ResidualBlock(nn.Module):
    """A residual MLP block with a buffer (``width -> 2 * width -> width``)."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)
        self.register_buffer("scale", torch.rand(width) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x))) * self.scale


class DataDependentIf(_TwoBlocks):
    """``b(a(x) * 2 if a(x).sum() > 0 else a(x))``: the ``if`` reads a value on the host."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)  # [B, width]
        if h.sum() > 0:
            h = h * 2
        return self.b(h)


class NonzeroBetween(_TwoBlocks):
    """``(b(a(x)), nonzero(a(x) > 0))``: the second output has a size that depends on the data."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)  # [B, width]
        idx = torch.nonzero(h > 0)  # [N, 2], N known only after the GPU ran
        return self.b(h), idx


def split_mark_op() -> Any:
    """Return ``torch.ops.torchreplay_bench.split_mark`` (``x -> x.clone()``), registering it on
    first use; a registered op lives as long as the process."""
    _register_split_ops()
    return torch.ops.torchreplay_bench.split_mark


def split_mark_out_op() -> Any:
    """Return ``torch.ops.torchreplay_bench.split_mark_out`` (``(x, out) -> out.copy_(x)``,
    nothing returned): a splitting op that writes into an output argument, as vLLM's attention
    ops do, so a piecewise runtime copies nothing after it."""
    _register_split_ops()
    return torch.ops.torchreplay_bench.split_mark_out


def _register_split_ops() -> None:
    """Register the bench's splitting ops once; a registered op lives as long as the process."""
    namespace = torch.ops.torchreplay_bench
    try:
        namespace.split_mark_out
        return
    except AttributeError:
        pass

    @torch.library.custom_op("torchreplay_bench::split_mark", mutates_args=())
    def split_mark(x: torch.Tensor) -> torch.Tensor:
        return x.clone()  # a custom op may not return its input itself

    @split_mark.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    @torch.library.custom_op("torchreplay_bench::split_mark_out", mutates_args=("out",))
    def split_mark_out(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(x)


#: How :class:`SplitMLP` cuts: the splitting op's style, and the name ``splitting_ops=`` takes.
SPLIT_STYLES = {
    "returns": SPLIT_MARK,  # a custom op returning a new tensor: copied into the next graph
    "writes": "torchreplay_bench.split_mark_out",  # a custom op writing its out argument
    "clone": "torch.clone",  # a C++ op (torch.clone) named as the splitting op
}


class SplitMLP(nn.Module):
    """:func:`gelu_mlp` with a splitting op between layers, cutting it into ``pieces``.

    With ``splitting_ops=[SPLIT_STYLES[style]]`` a piecewise backend makes ``pieces`` graphs
    with ``pieces - 1`` eager steps between them; ``pieces=1`` has no split at all. ``style``:
    ``"returns"``: :func:`split_mark_op` (a Python custom op returning a new tensor);
    ``"writes"``: :func:`split_mark_out_op` into a tensor made just before it (no copy after
    it); ``"clone"``: ``torch.clone``, an op with no Python of its own.
    """

    def __init__(
        self, pieces: int, depth: int = 12, width: int = 1024, seed: int = 0, style: str = "returns"
    ) -> None:
        super().__init__()
        if not 1 <= pieces <= depth:
            raise ValueError(f"pieces must be in 1..{depth} (one layer at least each), got {pieces}")
        if style not in SPLIT_STYLES:
            raise ValueError(f"style must be one of {sorted(SPLIT_STYLES)}, got {style!r}")
        self.layers = gelu_mlp(depth, width, seed)
        # Split after these layers: as even as integers allow.
        self.boundaries = frozenset(i * depth // pieces for i in range(1, pieces))
        self.pieces = pieces
        self.style = style
        if pieces > 1:
            _register_split_ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i % 2 == 0 and i // 2 in self.boundaries:  # before Linear number i // 2
                if self.style == "returns":
                    x = torch.ops.torchreplay_bench.split_mark(x)
                elif self.style == "writes":
                    out = torch.empty_like(x)
                    torch.ops.torchreplay_bench.split_mark_out(x, out)
                    x = out
                else:
                    x = torch.clone(x)
            x = layer(x)
        return x


def bert_encoder(
    layers: int = 4, hidden: int = 256, heads: int = 4, intermediate: int = 1024, seed: int = 0
) -> nn.Module:
    """Return Hugging Face's ``BertModel`` (random weights, no pooler) as a module
    ``(input_ids [B, S], attention_mask [B, S]) -> last hidden state [B, S, hidden]``.

    Raises:
        ImportError: ``transformers`` is not installed.
    """
    from transformers import BertConfig, BertModel

    config = BertConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        intermediate_size=intermediate,
    )
    return _BertLastHidden(_seeded(seed, lambda: BertModel(config, add_pooling_layer=False)))


class _BertLastHidden(nn.Module):
    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


# ---------------------------------------------------------------------------------------------
# Factories: (model, args) on CUDA when it is available, else the CPU.


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def data_if_factory(batch: int = 8) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """:class:`DataDependentIf` (eval) and an input ``[batch, 1024]``."""
    device = _device()
    return DataDependentIf().to(device).eval(), (torch.randn(batch, 1024, device=device),)


def nonzero_factory(batch: int = 8) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """:class:`NonzeroBetween` (eval) and an input ``[batch, 1024]``."""
    device = _device()
    return NonzeroBetween().to(device).eval(), (torch.randn(batch, 1024, device=device),)


def split_mlp_factory(pieces: int = 4, batch: int = 8) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """:class:`SplitMLP` in ``pieces`` (eval) and an input ``[batch, 1024]``; explain it with
    ``--splitting-ops torchreplay_bench.split_mark``."""
    device = _device()
    return SplitMLP(pieces).to(device).eval(), (torch.randn(batch, 1024, device=device),)
