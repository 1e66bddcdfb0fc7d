"""The split ``tr.compile`` would make on a GPU, found on any machine (``torchreplay explain``
without CUDA).

Without CUDA the backend compiles without CUDA graphs and splits nothing: every tensor is on the
CPU, which a graph cannot hold. :func:`preview_split` traces the call with Dynamo as the backend
would see it (a recording backend: no compile, no graphs), moves each graph's traced values to the
meta device (shapes, dtypes and data-dependent sizes kept) and splits each graph as
:func:`~torchreplay.compile.split.split_graph` does on a GPU. A model that takes another path on
a GPU (it branches on the device) or makes CPU tensors itself may be split otherwise there.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from torchreplay.compile.explain import piece_line
from torchreplay.compile.split import split_graph

__all__ = ["preview_split"]

_META = torch.device("meta")


def preview_split(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    splitting_ops: Sequence[Any] = (),
) -> str:
    """Trace ``fn(*args, **kwargs)`` with Dynamo and report how each graph would be split.

    ``fn`` runs once (eagerly between Dynamo's graphs, as compiled code does); call it under
    ``torch.no_grad()`` for an inference split.

    Returns:
        ``"graph 0: 3 piece(s), 2 graphed, 1 eager"`` and one line per piece, per Dynamo graph.
    """
    graphs: list[fx.GraphModule] = []

    def record(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=record)(*args, **dict(kwargs or {}))
    lines = [f"{len(graphs)} Dynamo graph(s)"
             + (" (Dynamo broke the call between them: TORCH_LOGS=graph_breaks says why)"
                if len(graphs) > 1 else "")]
    for k, gm in enumerate(graphs):
        _values_to_meta(gm)
        segments = split_graph(gm, splitting_ops, _META)
        graphed = sum(s.graphed for s in segments)
        lines.append(f"graph {k}: {len(segments)} piece(s), {graphed} graphed, "
                     f"{len(segments) - graphed} eager")
        for i, seg in enumerate(segments):
            what = "graphed" if seg.graphed else (f"eager: {seg.splits[0]}" if seg.splits else "eager")
            lines.append(piece_line(f"piece {i}", len(seg.nodes), what))
    return "\n".join(lines)


def _values_to_meta(gm: fx.GraphModule) -> None:
    """Move every fake tensor of the graph's node values to the meta device, in place."""
    for node in gm.graph.nodes:
        for key in ("example_value", "val"):
            if key in node.meta:
                node.meta[key] = _to_meta(node.meta[key])


def _to_meta(value: Any) -> Any:
    if isinstance(value, list):
        return [_to_meta(v) for v in value]
    if isinstance(value, tuple):
        items = [_to_meta(v) for v in value]
        if hasattr(type(value), "_fields"):  # a namedtuple
            return type(value)(*items)
        return type(value)(items)  # a tuple, or a torch.return_types structseq
    mode = getattr(value, "fake_mode", None)
    if isinstance(value, torch.Tensor) and mode is not None and value.device.type != "meta":
        with mode:
            return value.to(_META)
    return value
