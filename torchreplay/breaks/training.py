"""Training with breaks: ``tr.make_graphed_callables(model, sample_args, breaks=[...])``.

Module by module. One eager run of the model (its state put back after) finds, for each
submodule, whether a break ran inside it and how often it ran. Every largest submodule that holds
no break, runs inside none, ran once and gives tensors on the model's device is graphed, forward
and backward (:func:`torchreplay.training.callables.graph_callables`: one pool, in the order they
ran, each its own autograd node). The breaks, and the code of the modules that hold one (a decoder
layer's residual adds around its attention), run eagerly, with eager autograd between the graphs.

Why not a segment per stretch between breaks, as inference has (:mod:`.graph`): a segment's
backward needs an autograd node whose inputs are every tensor the segment reads from earlier code
and whose outputs are everything later code reads. The breakable runtime knows a run by
addresses, not by that tensor-level flow; and a break's own backward (attention over host-side
lengths) must run eagerly inside autograd's backward, which a captured backward cannot stop for.
Modules give both for free: their calls are where autograd nodes can begin and end.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

import torch
import torch.nn as nn

from torchreplay import _compat
from torchreplay.breaks.auto import find_on_copies
from torchreplay.breaks.plan import check_reached, intercept, resolve_breaks
from torchreplay.core.args import CallArgs, infer_device
from torchreplay.core.graphed import resolve_config, resolve_pool
from torchreplay.core.modes import refuse_inference_capture
from torchreplay.core.pool import Pool
from torchreplay.core.snapshot import StateSnapshot
from torchreplay.errors import CaptureError
from torchreplay.training.callables import graph_callables, make_graphed_callables
from torchreplay.training.verify import check_verify, resolve_tolerance

__all__ = ["Seen", "plan_modules", "auto_breaks", "graph_around_breaks"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Seen:
    """One submodule as the sample run saw it.

    Attributes:
        path: its name in the model (``"layers.0.mlp"``).
        module: the submodule.
        order: when it was first called, among all submodule calls.
        calls: how often it ran.
        holds_break: a break ran while it ran (or it is one).
        in_break: it ran inside a break.
        other_device: an argument tensor on another device than the model's (a graph would
            freeze it), or no output tensor on the model's device (nothing to graph).
        args, kwargs: its first call's arguments (tensors detached, ``requires_grad`` as they
            came).
    """

    path: str
    module: nn.Module
    order: int
    calls: int = 0
    holds_break: bool = False
    in_break: bool = False
    other_device: bool = False
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def graphable(self) -> bool:
        return self.calls == 1 and not (self.holds_break or self.in_break or self.other_device)

    def __str__(self) -> str:
        return f"{self.path} ({type(self.module).__name__})"


def _sample(x: Any) -> Any:
    """A module's argument as the graph's sample: a tensor detached (no autograd history kept
    alive), wanting a gradient as it did."""
    if not isinstance(x, torch.Tensor):
        return x
    d = x.detach()
    if x.requires_grad and (x.dtype.is_floating_point or x.dtype.is_complex):
        d.requires_grad_(True)
    return d


def _on(device: torch.device, values: Any) -> tuple[bool, bool]:
    """(any tensor leaf on ``device``'s type, any tensor leaf elsewhere)."""
    on = off = False
    for leaf in _compat.tree_flatten(values)[0]:
        if isinstance(leaf, torch.Tensor):
            if leaf.device.type == device.type:
                on = True
            else:
                off = True
    return on, off


def plan_modules(
    model: nn.Module, args: Sequence[Any], kwargs: dict[str, Any], breaks: Any, device: torch.device
) -> tuple[list[Seen], list[Seen]]:
    """Run ``model(*args, **kwargs)`` once, eagerly (buffers and RNG put back after), and
    return ``(graphed, eager)``: the largest submodules to graph, in the order they ran, and the
    modules that hold a break (which run eagerly around them).

    Raises:
        CaptureError: a break that never ran; nothing left to graph.
    """
    resolved = resolve_breaks(breaks)
    seen: dict[int, Seen] = {}
    paths = {id(m): p for p, m in model.named_modules() if m is not model}
    stack: list[Seen] = []
    inside = [0]  # breaks running now
    counter = [0]

    def pre(m: nn.Module, a: Any, k: Any) -> None:
        s = seen.get(id(m))
        if s is None:
            s = seen[id(m)] = Seen(paths[id(m)], m, counter[0])
            s.args = tuple(_sample(x) for x in a)
            s.kwargs = {key: _compat.tree_map(_sample, v) for key, v in k.items()}
            s.other_device = _on(device, (a, k))[1]
        else:
            s.args, s.kwargs = (), {}  # ran twice: not graphed, its sample is not needed
        counter[0] += 1
        s.calls += 1
        s.in_break = s.in_break or inside[0] > 0
        stack.append(s)

    def post(m: nn.Module, a: Any, k: Any, out: Any) -> None:
        s = stack.pop()
        on, off = _on(device, out)
        s.other_device = s.other_device or off or not on
        if not s.graphable:
            s.args, s.kwargs = (), {}

    def on_break(brk: Any, call: Any, a: Any, k: Any) -> Any:
        for s in stack:
            s.holds_break = True
        inside[0] += 1
        try:
            return call(*a, **k)
        finally:
            inside[0] -= 1

    handles = []
    reached: set[Any] = set()
    snapshot = StateSnapshot(model, device)  # a run for real: BatchNorm statistics, dropout's RNG
    try:
        for m in model.modules():
            if m is not model:
                handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
                handles.append(m.register_forward_hook(post, with_kwargs=True, always_call=True))
        with snapshot.running(), intercept(model, resolved, on_break, reached):
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
        snapshot.restore()
    check_reached(resolved, reached)
    graphed: list[Seen] = []
    eager: list[Seen] = []

    def walk(m: nn.Module) -> None:
        for child in m.children():
            s = seen.get(id(child))
            if s is not None and s.graphable:
                graphed.append(s)
                continue
            if s is not None and s.holds_break and not s.in_break:
                eager.append(s)
            walk(child)

    walk(model)
    graphed = list({id(s): s for s in graphed}.values())  # a submodule under two names: once
    graphed.sort(key=lambda s: s.order)
    if not graphed:
        raise CaptureError(
            f"make_graphed_callables(breaks=...): every submodule of {type(model).__name__} that "
            "ran holds a break, runs inside one, ran more than once or gives no tensor on "
            f"{device}, so nothing is left to graph; break at smaller modules (the attention, "
            "not the decoder layer)"
        )
    return graphed, eager


def auto_breaks(model: nn.Module, call: CallArgs, device: torch.device) -> list[nn.Module]:
    """``breaks="auto"``: the modules :func:`torchreplay.breaks.auto.find_breaks` chooses
    around each op that cannot be captured (none: the whole model can be graphed)."""
    found = find_on_copies(model, call, device)
    for b in found:
        log.info("torchreplay: breaks='auto' breaks at %s", b)
    return [b.module for b in found]


def graph_around_breaks(
    model: Any,
    sample_args: Any,
    breaks: Any,
    *,
    sample_kwargs: Any,
    allow_unused_input: bool,
    num_warmup_iters: int | None,
    pool: Any,
    outputs: str | None,
    capture_error_mode: str | None,
    config: Any,
    verify: int,
    verify_tol: Any,
) -> nn.Module:
    """``tr.make_graphed_callables(model, sample_args, breaks=...)``: graph the submodules
    :func:`plan_modules` chooses (their ``forward`` replaced, as torch's tool replaces a
    module's) and return ``model``, whose own code and breaks run eagerly."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"make_graphed_callables(breaks=...) graphs a module's submodules around its breaks: "
            f"pass the model (an nn.Module), got {type(model).__name__}; for a tuple of "
            "callables, graph each piece between the breaks yourself (without breaks=)"
        )
    if not isinstance(sample_args, (tuple, list)):
        raise TypeError(
            f"sample_args must be a tuple of the model's positional arguments, e.g. (x,), got "
            f"{type(sample_args).__name__}"
        )
    if sample_kwargs is not None and not isinstance(sample_kwargs, dict):
        raise TypeError(f"sample_kwargs must be a dict, got {type(sample_kwargs).__name__}")
    refuse_inference_capture("make_graphed_callables")
    call = CallArgs(model, tuple(sample_args), dict(sample_kwargs or {}))
    device = infer_device(model, call)
    verify = check_verify(verify)
    tol = resolve_tolerance(verify_tol)
    cfg = resolve_config(
        config, outputs=outputs, num_warmup_iters=num_warmup_iters, capture_error_mode=capture_error_mode
    )
    if isinstance(breaks, str) and breaks == "auto":
        breaks = auto_breaks(model, call, device)
        if not breaks:  # nothing that cannot be captured: the whole model is one graph
            log.info("torchreplay: breaks='auto' found nothing to break at: %s is graphed whole", type(model).__name__)
            return make_graphed_callables(
                model, call.args, sample_kwargs=call.kwargs, pool=pool, config=cfg,
                allow_unused_input=allow_unused_input, verify=verify, verify_tol=verify_tol,
            )
    graphed, eager = plan_modules(model, call.args, call.kwargs, breaks, device)
    runners = graph_callables(
        [s.module for s in graphed],
        [s.args for s in graphed],
        [s.kwargs for s in graphed],
        device=device,
        pool=resolve_pool(pool) or Pool(device),
        config=cfg,
        # an argument a submodule does not differentiate through (a rotary embedding reads
        # only the hidden states' dtype) is the model's business, not the caller's
        allow_unused=True,
        verify=verify,
        tol=tol,
        names=[str(s) for s in graphed],
    )
    for s, r in zip(graphed, runners):
        s.module.forward = r  # type: ignore[method-assign]
        r.input_hint = (
            f". It was graphed around the breaks from one run; if its arguments change shape "
            f"from call to call (rows picked by a router), name it, or a module around it, in "
            f"breaks= to run it eagerly: model.get_submodule({s.path!r})"
        )
        s.args, s.kwargs = (), {}
    log.info(
        "torchreplay: %s graphed for training in %d pieces around its breaks; eager: %s",
        type(model).__name__,
        len(graphed),
        ", ".join(str(s) for s in eager),
    )
    return model
