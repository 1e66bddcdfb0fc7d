"""Training benchmark rows (``mlp-train``, ``resnet50-train`` in :data:`torchreplay.bench.ROWS`).

Each workload is one training call on fixed tensors, timed with
:func:`torchreplay.bench.timing.time_call`
like the inference rows, with autograd on:

- ``fwd+bwd``: ``zero_grad(set_to_none=True)``, forward, loss, ``backward()``;
- ``step``: the same followed by an AdamW step.

Methods (each builds its own copy of the model from the same seed):

- ``eager``; for steps, ``AdamW(lr=1e-4)`` (foreach, the fastest eager AdamW).
- ``hand-written CUDAGraph``: torch's documented whole-network capture (static input and
  target, gradients in the graph's pool, ``AdamW(capturable=True)`` inside for steps); per call
  two copies and one replay. The floor.
- ``torch make_graphed_callables`` / ``tr.make_graphed_callables``: the model graphed, the loss
  and (for steps) the eager AdamW step around it.
- ``tr.graph_step``: the whole call graphed (``AdamW(capturable=True)`` for steps), and for
  steps ``tr.graph_step fused``: the same with ``AdamW(capturable=True, fused=True)``, the form the
  README recommends.
- ``tr.make_graphed_callables + graphed AdamW step`` (steps only): the partial-network recipe,
  forward/backward graphed, ``zero_grad()`` eager, and the fused capturable AdamW step captured
  alone with ``tr.graph_step`` (which copies the backward's new gradients in, one launch).
  ``zero_grad(set_to_none=False)`` instead costs ResNet-50 about 600 us more per step (each
  backward then adds into every ``.grad``: RESULTS.md, session 62).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from torchreplay.bench.timing import (
    EAGER,
    FLOOR,
    BenchOptions,
    Measurement,
    StepCallback,
    cuda_generator,
    release,
    short_reason,
    time_call,
    with_ratios,
)

__all__ = [
    "TORCH_MGC",
    "TR_MGC",
    "TR_MGC_STEP",
    "TR_STEP",
    "TR_STEP_FUSED",
    "TRAINING_METHODS",
    "mlp_train_row",
    "resnet50_train_row",
]

TORCH_MGC = "torch make_graphed_callables"
TR_MGC = "tr.make_graphed_callables"
TR_STEP = "tr.graph_step"
TR_STEP_FUSED = "tr.graph_step fused"
TR_MGC_STEP = "tr.make_graphed_callables + graphed AdamW step"
_STEP_ONLY = (TR_STEP_FUSED, TR_MGC_STEP)
#: Every training method, in table order.
TRAINING_METHODS: tuple[str, ...] = (
    EAGER, FLOOR, TORCH_MGC, TR_MGC, TR_MGC_STEP, TR_STEP, TR_STEP_FUSED
)

#: Batches of the ``resnet50-train`` row.
RESNET_TRAIN_BATCHES: tuple[int, ...] = (1, 8)


@dataclasses.dataclass(frozen=True)
class TrainingWorkload:
    """One training call: a fresh model from ``make_model()``, an input and a target.

    Args:
        row: the ROWS key.
        name: shown in the table.
        make_model: builds the model (same weights every time) on the GPU, in training mode.
        x, target: one batch.
        loss_fn: ``loss_fn(model(x), target)`` is the loss.
        step: an AdamW step follows the backward.
    """

    row: str
    name: str
    make_model: Callable[[], torch.nn.Module]
    x: torch.Tensor
    target: torch.Tensor
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    step: bool


def _method_name(method: str, w: TrainingWorkload) -> str:
    if w.step and method in (TORCH_MGC, TR_MGC):
        return f"{method} + eager AdamW"
    return method


def _eager_loop(model: Any, params: Any, w: TrainingWorkload) -> Callable[[], Any]:
    """zero_grad, forward through ``model`` (graphed or not), loss, backward, eager AdamW step."""
    opt = torch.optim.AdamW(params, lr=1e-4) if w.step else None
    module_params = list(params)
    x, target, loss_fn = w.x, w.target, w.loss_fn

    def call() -> None:
        for p in module_params:
            p.grad = None
        loss = loss_fn(model(x), target)
        loss.backward()
        if opt is not None:
            opt.step()

    return call


def _build(method: str, w: TrainingWorkload) -> Callable[[], Any]:
    model = w.make_model()
    params = list(model.parameters())
    if method == EAGER:
        return _eager_loop(model, params, w)
    # A sample that is not the timed input: torch's skips the copy-in when the caller passes the
    # sample tensor itself, which a training loop never does.
    sample = w.x.clone()
    if method == TORCH_MGC:
        return _eager_loop(torch.cuda.make_graphed_callables(model, (sample,)), params, w)
    import torchreplay as tr

    if method == TR_MGC:
        return _eager_loop(tr.make_graphed_callables(model, (sample,)), params, w)
    if method == TR_MGC_STEP:
        return _graphed_optimizer_loop(tr.make_graphed_callables(model, (sample,)), params, w)
    fused = method == TR_STEP_FUSED
    opt = torch.optim.AdamW(params, lr=1e-4, capturable=True, fused=fused) if w.step else None
    loss_fn = w.loss_fn

    def train_step(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for p in params:
            p.grad = None
        loss = loss_fn(model(x), target)
        loss.backward()
        if opt is not None:
            opt.step()
        return loss

    if method in (TR_STEP, TR_STEP_FUSED):
        step = tr.graph_step(train_step, w.x, w.target)
        return lambda: step(w.x, w.target)
    if method == FLOOR:
        return _handwritten_step(train_step, w)
    raise ValueError(f"unknown training method {method!r}")


def _graphed_optimizer_loop(model: Any, params: Any, w: TrainingWorkload) -> Callable[[], Any]:
    """Graphed forward/backward, then the fused capturable AdamW step captured alone."""
    import torchreplay as tr

    opt = torch.optim.AdamW(params, lr=1e-4, capturable=True, fused=True)
    x, target, loss_fn = w.x, w.target, w.loss_fn
    loss_fn(model(x), target).backward()  # every .grad exists for the capture to read
    opt_step = tr.graph_step(opt.step, optimizers=opt)

    def call() -> None:
        opt.zero_grad()
        loss = loss_fn(model(x), target)
        loss.backward()
        opt_step()

    return call


def _handwritten_step(train_step: Callable[..., Any], w: TrainingWorkload) -> Callable[[], Any]:
    """torch's documented whole-network capture of ``train_step``."""
    static_x, static_t = w.x.clone(), w.target.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            train_step(static_x, static_t)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        train_step(static_x, static_t)
    x, target = w.x, w.target

    def call() -> None:
        static_x.copy_(x)
        static_t.copy_(target)
        g.replay()

    call.graph = g  # type: ignore[attr-defined]  # keep it alive with the call
    return call


def measure_training(
    w: TrainingWorkload, opts: BenchOptions, on_step: StepCallback | None = None
) -> list[Measurement]:
    """Time every training method on ``w``; one :class:`Measurement` per method."""
    raw: list[Measurement] = []
    for method in TRAINING_METHODS:
        if method in _STEP_ONLY and not w.step:
            continue
        shown = _method_name(method, w)
        if on_step is not None:
            on_step(w.name, shown)
        call = None
        try:
            call = _build(method, w)
            per_call, host, host_median = time_call(call, opts)
            raw.append(Measurement(w.row, w.name, shown, per_call, host, host_median))
        except Exception as exc:  # noqa: BLE001 - one failing method must not end the table
            raw.append(Measurement(w.row, w.name, shown, error=short_reason(exc)))
        finally:
            call = None  # drop the graphs and their pools before the next method
            release()
    return with_ratios(raw)


def _mlp_train_workloads() -> Iterator[TrainingWorkload]:
    from torchreplay.models.mlp import MLPConfig, build_mlp

    cfg, batch = MLPConfig(depth=24, width=512), 8
    gen = cuda_generator()
    x = torch.randn(batch, cfg.width, device="cuda", generator=gen)  # [8, 512]
    target = torch.randn(batch, cfg.width, device="cuda", generator=gen)  # [8, 512]
    base = f"MLP {cfg.depth} x Linear({cfg.width}, {cfg.width})+ReLU, batch {batch}, fp32, training"
    for step in (False, True):
        yield TrainingWorkload(
            "mlp-train",
            f"{base}: {'step (AdamW)' if step else 'fwd+bwd'}",
            lambda: build_mlp(cfg, "cuda", torch.float32),
            x,
            target,
            F.mse_loss,
            step,
        )


def _resnet50_train_workloads() -> Iterator[TrainingWorkload]:
    from torchreplay.models.cnn import resnet50, resnet50_source

    gen = cuda_generator()
    for batch in RESNET_TRAIN_BATCHES:
        x = torch.randn(batch, 3, 224, 224, device="cuda", generator=gen)  # [B, 3, 224, 224]
        labels = torch.randint(0, 1000, (batch,), device="cuda", generator=gen)  # [B]
        yield TrainingWorkload(
            "resnet50-train",
            f"ResNet-50 ({resnet50_source()}), batch {batch}, fp32, training step (AdamW)",
            lambda: resnet50("cuda", torch.float32).train(),
            x,
            labels,
            F.cross_entropy,
            True,
        )


def mlp_train_row(opts: BenchOptions, on_step: StepCallback | None) -> Iterator[Measurement]:
    """The ``mlp-train`` row: fwd+bwd and a full AdamW step of the benchmark MLP."""
    for w in _mlp_train_workloads():
        yield from measure_training(w, opts, on_step)


def resnet50_train_row(opts: BenchOptions, on_step: StepCallback | None) -> Iterator[Measurement]:
    """The ``resnet50-train`` row: a full AdamW training step of ResNet-50 at batch 1 and 8."""
    for w in _resnet50_train_workloads():
        yield from measure_training(w, opts, on_step)
