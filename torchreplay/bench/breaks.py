"""The breakable-graph row (``llama-breaks``): the built-in Llama decode step whose attention reads
host-side sequence lengths (:func:`~torchreplay.models.llama.host_attention`, 16 calls a step),
at batch 1, 8 and 32.

Methods (each a :class:`Measurement`; one that fails is a ``failed: <reason>`` entry):

- ``eager``: ``model(ids, positions, lengths)``;
- ``tr.graph`` (whole callable): the same call graphed whole; it cannot run (the lengths are host
  values a graph would freeze; the capture fails), and the row says so;
- ``tr.graph, device mask``: the whole-callable graph of the same model with the capturable
  attention (a mask made on the GPU over the whole cache): the reference for "the same
  capturable work";
- ``breaks alone (eager)``: the 16 ``host_attention`` calls of a step by themselves, eagerly;
- ``tr.graph breaks=``: ``tr.graph(model, ids, positions, lengths, breaks=[host_attention])``;
- ``torch.compile reduce-overhead``;
- ``piecewise-cuda-graphs``: Meta's package (``@no_graph`` on ``host_attention``, static buffers
  filled by hand each call, as its README shows), skipped where it is not installed.

Notes: on ``tr.graph breaks=``, its time against the target ``whole-graph (device mask) + breaks
alone + 10 us per break`` and against Meta's; capture of 32 sizes (``sizes=range(1, 33)``) in
seconds, after one eager call (the process's one-time CUDA start, kernels loading, is paid by
whichever runs first), then the same again (every shape met before: what the capture itself
costs), and what the break alone pays eagerly the first time it meets each of the 32 sizes (at
a span nothing ran before: the attention's set-up per shape, which a capture pays too); first
call (capture) against reduce-overhead's (compile and record).
"""

from __future__ import annotations

import importlib.util
import logging
import time
from typing import Any, Callable, Iterator

import torch

from torchreplay.bench.inference import COMPILE as REDUCE_OVERHEAD
from torchreplay.bench.timing import (
    EAGER,
    BenchOptions,
    Measurement,
    StepCallback,
    cuda_generator,
    release,
    short_reason,
    skipped,
    time_interleaved,
)

__all__ = ["llama_breaks_row", "WHOLE", "MASKED", "BREAKS_ALONE", "TR_BREAKS", "META"]

log = logging.getLogger(__name__)

WHOLE = "tr.graph (whole callable)"
MASKED = "tr.graph, device mask"
BREAKS_ALONE = "breaks alone (eager)"
TR_BREAKS = "tr.graph breaks="
META = "piecewise-cuda-graphs"
BATCHES = (1, 8, 32)


def _inputs(model: Any, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = cuda_generator(batch)
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (batch, 1), device="cuda", generator=gen)
    positions = torch.randint(cfg.max_seq_len // 4, cfg.max_seq_len // 2, (batch,), device="cuda", generator=gen)
    return ids, positions, (positions + 1).cpu()


def _meta(model: Any, args: tuple[torch.Tensor, ...]) -> Callable[[], Any]:
    """Meta's package as its README shows: static buffers, warm-up on a side stream, capture
    with ``host_attention`` under ``@no_graph``, and a call that fills the buffers and replays."""
    import piecewise_cuda_graphs as pcg  # type: ignore[import-not-found]

    from torchreplay.models import llama as llama_module

    static = [a.clone() for a in args]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            model(*static)
    torch.cuda.current_stream().wait_stream(stream)
    seq = pcg.CUDAGraphSequence()
    plain = llama_module.host_attention
    llama_module.host_attention = pcg.no_graph(plain)
    try:
        with pcg.piecewise_graph(seq):
            out = model(*static)
    finally:
        llama_module.host_attention = plain

    def call() -> torch.Tensor:
        for s, a in zip(static, args):
            s.copy_(a)
        seq.replay()
        return out

    return call


def _breaks_alone(model: Any, batch: int) -> Callable[[], Any]:
    """The step's ``host_attention`` calls by themselves, on tensors of the step's shapes."""
    from torchreplay.models.llama import host_attention

    cfg = model.config
    G = cfg.n_heads // cfg.n_kv_heads
    q = torch.randn(batch, cfg.n_kv_heads, G, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    caches = [(layer.attention.k_cache[:batch], layer.attention.v_cache[:batch]) for layer in model.layers]
    lengths = _inputs(model, batch)[2]

    def call() -> None:
        for k, v in caches:
            host_attention(out, q, k, v, lengths)

    return call


def _build(method: str, model: Any, args: tuple[torch.Tensor, ...], batch: int) -> Callable[[], Any]:
    import torchreplay as tr
    from torchreplay.models.llama import host_attention

    if method == EAGER:
        return lambda: model(*args)
    if method == WHOLE:
        g = tr.graph(model, *args)
        return lambda: g(*args)
    if method == MASKED:
        g = tr.graph(model, *args[:2])
        return lambda: g(*args[:2])
    if method == BREAKS_ALONE:
        return _breaks_alone(model, batch)
    if method == TR_BREAKS:
        g = tr.graph(model, *args, breaks=[host_attention])
        return lambda: g(*args)
    if method == REDUCE_OVERHEAD:
        compiled = torch.compile(model, mode="reduce-overhead")
        return lambda: compiled(*args)
    if method == META:
        return _meta(model, args)
    raise ValueError(method)


def _methods(opts: BenchOptions) -> list[str]:
    methods = [EAGER, WHOLE, MASKED, BREAKS_ALONE, TR_BREAKS]
    if opts.compile:
        methods.append(REDUCE_OVERHEAD)
    methods.append(META)
    return methods


def _capture_sizes(model: Any) -> tuple[float, int]:
    """Seconds to build ``tr.graph(..., breaks=, sizes=range(1, 33))`` (every size ahead), and
    its captures."""
    import torchreplay as tr
    from torchreplay.models.llama import host_attention

    args = _inputs(model, 1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    g = tr.graph(model, *args, breaks=[host_attention], sizes=list(range(1, 33)))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    captures = g.stats.captures
    del g
    release()
    return seconds, captures


def _break_first_use(model: Any, span: int) -> float:
    """Seconds of the first eager call of ``host_attention`` alone at each batch of 1..32, over
    ``span`` cache slots (a span no call used before: every shape is new to the process)."""
    from torchreplay.models.llama import host_attention

    cfg = model.config
    dtype = next(model.parameters()).dtype
    seconds = 0.0
    for b in range(1, 33):
        q = torch.randn(b, cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim, device="cuda", dtype=dtype)
        kv = torch.randn(b, cfg.n_kv_heads, cfg.max_seq_len, cfg.head_dim, device="cuda", dtype=dtype)
        out, lengths = torch.empty_like(q), torch.full((b,), span)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        host_attention(out, q, kv, kv, lengths)
        torch.cuda.synchronize()
        seconds += time.perf_counter() - t0
    return seconds


def llama_breaks_row(opts: BenchOptions, on_step: StepCallback | None) -> Iterator[Measurement]:
    """The ``llama-breaks`` row (see the module)."""
    from torchreplay.models import build_llama

    model = build_llama(device="cuda")
    has_meta = importlib.util.find_spec("piecewise_cuda_graphs") is not None
    with torch.no_grad():
        model(*_inputs(model, 1))  # the process's one-time CUDA start (kernels load) is no one's
        torch.cuda.synchronize()
        sizes_s, sizes_captures = _capture_sizes(model)
        again_s, _ = _capture_sizes(model)
        first_use_s = _break_first_use(model, model.config.max_seq_len - 1)
        for batch in BATCHES:
            workload = f"Llama decode b{batch}, host-side lengths, 16 breaks"
            args = _inputs(model, batch)
            calls: dict[str, Callable[[], Any]] = {}
            first: dict[str, float] = {}
            failed: dict[str, str] = {}
            for method in _methods(opts):
                if method == META and not has_meta:
                    failed[method] = skipped("piecewise_cuda_graphs is not installed")
                    continue
                if on_step is not None:
                    on_step(workload, method)
                model.reset_cache()
                try:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    call = _build(method, model, args, batch)
                    call()
                    if method == REDUCE_OVERHEAD:
                        for _ in range(opts.compile_warmup):
                            call()
                    torch.cuda.synchronize()
                    first[method] = time.perf_counter() - t0
                    calls[method] = call
                except Exception as exc:  # noqa: BLE001 - one method must not end the row
                    failed[method] = f"failed: {short_reason(exc)}"
            timed = time_interleaved(calls, opts)
            yield from _measurements(workload, _methods(opts), timed, failed, first, batch, (sizes_s, sizes_captures, again_s, first_use_s))
            del calls
            release()


def _measurements(
    workload: str,
    methods: list[str],
    timed: dict[str, Any],
    failed: dict[str, str],
    first: dict[str, float],
    batch: int,
    sizes: tuple[float, int, float, float],
) -> Iterator[Measurement]:
    us = {m: t[0] for m, t in timed.items() if not isinstance(t, str)}
    eager = us.get(EAGER)
    for method in methods:
        t = timed.get(method)
        error = failed.get(method) or (f"failed: {t}" if isinstance(t, str) else None)
        note, values = None, None
        if method == TR_BREAKS and method in us:
            values = {}
            if MASKED in us and BREAKS_ALONE in us:
                target = us[MASKED] + us[BREAKS_ALONE] + 10.0 * 16
                values["target_us"] = target
                values["vs_target"] = us[method] / target
            if META in us:
                values["vs_meta"] = us[method] / us[META]
            if REDUCE_OVERHEAD in first and method in first:
                values["first_call_vs_ro"] = first[REDUCE_OVERHEAD] / first[method]
            (values["capture_32_sizes_s"], values["captures_32_sizes"], values["capture_32_again_s"],
             values["break_first_use_32_s"]) = sizes
            note = ", ".join(f"{k} {v:.3g}" for k, v in values.items())
        yield Measurement(
            row="llama-breaks",
            workload=workload,
            method=method,
            per_call_us=us.get(method),
            host_us=timed[method][1] if method in us else None,
            host_median_us=timed[method][2] if method in us else None,
            speedup=eager / us[method] if eager and method in us else None,
            error=error,
            first_call_s=first.get(method),
            note=note,
            values=values,
        )
