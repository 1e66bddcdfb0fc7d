"""Helpers of :mod:`torchreplay.training.step`: what a step's arguments name (its device, its
optimizers and scalers, its modules' names), what a DistributedDataParallel module needs, the
``.grad`` tensors a captured step leaves and reads (:class:`StepGrads`), and the errors of a
failed capture whose cause is known."""

from __future__ import annotations

import operator
from typing import Any, Callable, Iterable, Sequence

import torch

from torchreplay import _compat
from torchreplay.core.args import CallArgs, infer_device, roots_of
from torchreplay.errors import CaptureError
from torchreplay.training.state import find_instances

__all__ = [
    "roots_of", "param_names", "step_device", "as_optimizers", "as_scalers", "ddp_warmup",
    "Accumulated", "StepGrads", "read_only_grads", "missing_grad", "explained",
]

#: DDP collects runtime statistics (timed with CUDA events, read on the host) in its first 10
#: iterations and every 100th: a capture must come after the 10th.
DDP_WARMUP = 11


def ddp_warmup(modules: Sequence[Any], warmup: int) -> int:
    """The warm-up count a step over ``modules`` needs: at least :data:`DDP_WARMUP` when one
    of them is a ``DistributedDataParallel`` (torch's CUDA-graph notes ask for 11 eager DDP
    iterations before a capture)."""
    ddp = torch.nn.parallel.DistributedDataParallel
    if any(isinstance(m, ddp) for m in modules):
        return max(warmup, DDP_WARMUP)
    return warmup


def param_names(
    params: Sequence[torch.Tensor],
    roots: Sequence[torch.nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
) -> list[str]:
    names: dict[int, str] = {}
    for m in roots:
        for n, p in m.named_parameters():
            names.setdefault(id(p), n)
    for opt in optimizers:
        for gi, group in enumerate(opt.param_groups):
            given = group.get("param_names")
            for k, p in enumerate(group["params"]):
                label = given[k] if given and k < len(given) else f"param_groups[{gi}]['params'][{k}]"
                names.setdefault(id(p), label)
    return [names.get(id(p), f"parameter {i} {tuple(p.shape)}") for i, p in enumerate(params)]


def step_device(
    step_fn: Callable[..., Any],
    call: CallArgs,
    optimizers: Iterable[torch.optim.Optimizer],
) -> torch.device:
    try:
        return infer_device(step_fn, call)
    except CaptureError:
        # No CUDA tensor argument (an optimizer step alone): the optimizers' parameters say it,
        # the given ones or those the step reaches by name (a closure, a global, self.opt).
        reached = find_instances(step_fn, torch.optim.Optimizer)
        for opt in [*optimizers, *reached]:
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.is_cuda:
                        return p.device
        raise


def as_optimizers(optimizers: Any) -> list[torch.optim.Optimizer]:
    if optimizers is None:
        return []
    items = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else optimizers
    if not isinstance(items, (list, tuple)):
        raise TypeError(
            f"optimizers must be an optimizer or a list of them, got {type(optimizers).__name__}"
        )
    for i, opt in enumerate(items):
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                f"optimizers[{i}] is a {type(opt).__name__}, not a torch.optim.Optimizer"
            )
    return list(items)


def as_scalers(scaler: Any, step_fn: Callable[..., Any]) -> list[Any]:
    grad_scaler = torch.amp.GradScaler
    given = [] if scaler is None else [scaler]
    for s in given:
        if not isinstance(s, grad_scaler):
            raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(s).__name__}")
    found = find_instances(step_fn, grad_scaler)
    out: list[Any] = []
    for s in given + found:
        if s.is_enabled() and not any(o is s for o in out):
            out.append(s)
    return out


class Accumulated:
    """Which of ``params`` get a gradient accumulated by a backward run inside the block (their
    post-accumulate-grad hooks fire), as indices in ``seen``; the hooks go when the block ends."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = params
        self.seen: set[int] = set()
        self._handles: list[Any] = []

    def __enter__(self) -> "Accumulated":
        for i, p in enumerate(self.params):
            if p.is_leaf and p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(
                    lambda _p, i=i: self.seen.add(i)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def read_only_grads(reads: Sequence[bool], accumulated: set[int]) -> list[int]:
    """The parameters whose ``.grad`` the step reads (the same tensor before and after it) and no
    backward inside it writes: an optimizer step alone. Eagerly an optimizer skips a parameter
    whose ``.grad`` is None; a replay cannot skip it (it would step it on a zero gradient, and
    Adam's momentum would move it), so such a call runs eagerly (:func:`missing_grad`)."""
    return [i for i, r in enumerate(reads) if r and i not in accumulated]


def missing_grad(
    params: Sequence[torch.Tensor], read_only: Sequence[int], names: Sequence[str]
) -> str | None:
    """The name of the first read-only parameter (:func:`read_only_grads`) whose ``.grad`` is
    None now, or None."""
    for i in read_only:
        if params[i].grad is None:
            return names[i]
    return None


class StepGrads:
    """The ``.grad`` of each parameter a captured step touches, kept as after an eager step.

    ``ends``: the tensor the step left as ``.grad`` at capture (None: it ends with
    ``zero_grad()``), which every call leaves there too. ``reads``: where the step accumulates
    into the ``.grad`` it found (no ``zero_grad``, or ``set_to_none=False``), so a ``.grad`` the
    caller replaced is copied in first. ``read_only``: those of them no backward inside the step
    writes (:func:`read_only_grads`)."""

    __slots__ = ("params", "ends", "reads", "read_only", "names", "_get")

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        before: Sequence[torch.Tensor | None],
        after: Sequence[torch.Tensor | None],
        accumulated: set[int],
        names: Sequence[str],
    ) -> None:
        self.params = params
        self.ends = after
        self.reads = [a is not None and a is b for a, b in zip(after, before)]
        self.read_only = read_only_grads(self.reads, accumulated)
        self.names = names
        self._get = operator.attrgetter("grad")

    def missing(self) -> str | None:
        """The name of a read-only parameter whose ``.grad`` is None now (the call runs
        eagerly: :func:`read_only_grads`), or None."""
        return missing_grad(self.params, self.read_only, self.names) if self.read_only else None

    def sync(self) -> None:
        """Make every ``p.grad`` the tensor the captured step uses, copying in (one launch for
        all: 161 ``copy_`` launches for ResNet-50 otherwise) a ``.grad`` the caller replaced
        where the step reads it, and zeroing it where the caller set it to None."""
        params, ends = self.params, self.ends
        if all(map(operator.is_, map(self._get, params), ends)):
            return
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        zeros: list[torch.Tensor] = []
        with torch.no_grad():
            for p, end, reads in zip(params, ends, self.reads):
                g = p.grad
                if g is end:
                    continue
                if reads and end is not None:
                    if g is None:
                        zeros.append(end)
                    else:
                        dsts.append(end)
                        srcs.append(g)
                p.grad = end
            if dsts:
                _compat.foreach_copy_(dsts, srcs)
            if zeros:
                _compat.foreach_zero_(zeros)


def explained(
    exc: CaptureError, name: str, modules: Sequence[Any], optimizers: Sequence[torch.optim.Optimizer]
) -> CaptureError | None:
    """A clearer error for a step's failed capture where its cause is known, else None: a DDP
    module built on the default stream, or an optimizer step alone graphed before any gradient
    existed (nothing to step: the capture recorded no work)."""
    if ddp_warmup(modules, 0) and "legacy" in str(exc):
        return CaptureError(
            f"capture of '{name}' failed: its DistributedDataParallel module was "
            "built on the default stream, where DDP keeps each parameter's gradient "
            "accumulator, and a captured backward cannot accumulate there. Build it on "
            "the capture stream: `with tr.capture_stream(): model = "
            f"DistributedDataParallel(model, ...)`. ({exc})"
        )
    params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    if params and "recorded no CUDA work" in str(exc) and all(p.grad is None for p in params):
        return CaptureError(
            f"capturing '{name}' recorded no CUDA work: no parameter of its optimizer has a "
            ".grad, so its step updates nothing (eagerly too). To graph an optimizer step alone, "
            "run one backward first, so that every parameter it updates has its gradient, then "
            "graph the step: each call reads the .grad tensors the caller's backward leaves."
        )
    return None
