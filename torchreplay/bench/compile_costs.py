"""What the torchreplay backend costs beside time per call: memory for many sizes
(``compile-memory``) and host time per split (``compile-split-cost``).

- ``compile-memory``: ``tr.compile(mlp, sizes=1..32)`` vs ``tr.compile(mlp, sizes=[32])``, each
  compiled and called once at batch 32 (which captures every size, largest first, in one pool),
  in a process already warmed by one untimed build (the side stream, cuBLAS, Inductor). Measured
  against a baseline taken just before, after ``gc.collect(); torch.cuda.synchronize();
  torch.cuda.empty_cache()``: ``torch.cuda.memory_reserved()`` (read after the same clean-up, so
  it counts what the graphs hold, not the cache), ``torch.cuda.memory_allocated()`` and the pools'
  own bytes (``rt.stats.pool_bytes``). Target: all sizes within 1.2x of the largest alone
  (reserved), since sizes share one pool and one set of buffers.
- ``compile-split-cost``: the same 12-layer MLP (batch 8) cut into k pieces by a splitting op
  (:class:`~torchreplay.models.blocks.SplitMLP`) of three styles: a Python custom op returning a
  new tensor (k = 2, 4, 8; the runtime copies its output into the next graph's buffer), a Python
  custom op writing its out argument (k = 8; nothing to copy, as vLLM's attention ops), and
  ``torch.clone`` named as the splitting op (k = 8; an op with no Python of its own); all timed
  interleaved with the uncut model (k = 1). Each k > 1 notes ``(t_k - t_1) / (k - 1)``, the host
  time (no sync in the loop) and the synchronized time each split adds, and, with each op timed
  alone eagerly (its own launch, which any piecewise backend pays), the part that is ours:
  per split minus the op alone. A replay calls a custom op's kernel without the dispatcher
  (``pieces/direct.py``), so for the custom ops "the op alone" is that kernel called alone the
  same way (the eager call through ``torch.ops`` is timed too). Each k > 1 is also compiled
  without ``splitting_ops`` (the op captured inside one graph: one whole graph of the same work,
  with the same Python for Dynamo to guard), and notes its split cost over that build too.
  Target: <= 20 us of host time per split.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from typing import Any, Iterator

import torch

from torchreplay.bench.compile import BATCH, DEPTH, WIDTH, compile_summary, own_frame
from torchreplay.bench.timing import (
    BenchOptions,
    Measurement,
    StepCallback,
    cuda_generator,
    release,
    short_reason,
    time_interleaved,
)
from torchreplay.pieces.direct import direct_call

__all__ = [
    "MEMORY_SIZES",
    "SPLIT_PIECES",
    "compile_memory_row",
    "compile_split_cost_row",
]

log = logging.getLogger(__name__)

#: ``compile-memory``: the sizes of the many-size compile; the other has only the largest.
MEMORY_SIZES: tuple[int, ...] = tuple(range(1, 33))
#: ``compile-split-cost``: the splitting-op styles and numbers of pieces timed (the first is the
#: uncut model, the baseline of every style).
SPLIT_PIECES: tuple[tuple[str, int], ...] = (
    ("returns", 1), ("returns", 2), ("returns", 4), ("returns", 8), ("writes", 8), ("clone", 8),
)
_STYLE_WORDS = {
    "returns": "a custom op returning a new tensor",
    "writes": "a custom op writing its out argument",
    "clone": "torch.clone",
}
_MIB = 2**20


def _settled_reserved() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def _memory_of(model: torch.nn.Module, x: torch.Tensor, sizes: tuple[int, ...]) -> dict[str, float]:
    """Compile and call once; return seconds, captures and bytes (reserved, allocated, pool)."""
    import torchreplay as tr

    torch.compiler.reset()
    reserved0 = _settled_reserved()
    allocated0 = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    compiled = tr.compile(model, sizes=sizes)
    with torch.no_grad():
        y = compiled(x)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    del y
    runtimes = compiled.backend.runtimes
    out = {
        "first_call_s": seconds,
        "captures": float(sum(rt.stats.captures for rt in runtimes)),
        "pool_mib": sum(rt.stats.pool_bytes for rt in runtimes) / _MIB,
        "reserved_mib": (_settled_reserved() - reserved0) / _MIB,
        "allocated_mib": (torch.cuda.memory_allocated() - allocated0) / _MIB,
    }
    del compiled, runtimes
    torch.compiler.reset()
    release()
    return out


def compile_memory_row(opts: BenchOptions, on_step: StepCallback | None) -> Iterator[Measurement]:
    """The ``compile-memory`` row: memory of ``tr.compile`` with sizes 1..32 vs 32 alone."""
    from torchreplay.models.blocks import gelu_mlp

    largest = max(MEMORY_SIZES)
    name = (f"memory: MLP {DEPTH} x Linear({WIDTH}, {WIDTH})+GELU, fp32, tr.compile sizes "
            f"1..{largest} vs {largest} alone, first call at batch {largest}")
    model = gelu_mlp(DEPTH, WIDTH).cuda().eval()
    x = torch.randn(largest, WIDTH, device="cuda", generator=cuda_generator())  # [32, 1024]
    variants = {f"tr.compile sizes=[{largest}]": (largest,),
                f"tr.compile sizes=1..{largest} ({len(MEMORY_SIZES)} sizes)": MEMORY_SIZES}
    if on_step is not None:
        on_step(name, "warm-up build (not reported)")
    try:
        _memory_of(model, x, (largest,))
    except Exception as exc:  # noqa: BLE001 - reported by the measured builds below
        log.debug("compile-memory: the warm-up build failed: %s", exc)
    measured: dict[str, dict[str, float]] = {}
    results = []
    for label, sizes in variants.items():
        if on_step is not None:
            on_step(name, label)
        try:
            measured[label] = _memory_of(model, x, sizes)
        except Exception as exc:  # noqa: BLE001 - one failing method must not end the table
            log.warning("%s / %s %s", name, label, short_reason(exc))
            results.append(Measurement("compile-memory", name, label, error=short_reason(exc)))
            continue
        m = measured[label]
        note = (f"reserved +{m['reserved_mib']:.1f} MiB, allocated +{m['allocated_mib']:.1f} MiB, "
                f"pools {m['pool_mib']:.1f} MiB; {m['captures']:.0f} capture(s)")
        results.append(Measurement("compile-memory", name, label, first_call_s=m["first_call_s"],
                                   note=note, values=m))
    alone, many = (measured.get(label) for label in variants)
    if alone is not None and many is not None:
        ratios = {f"{key}_ratio": many[key] / alone[key]
                  for key in ("reserved_mib", "pool_mib", "allocated_mib") if alone[key] > 0}
        if "reserved_mib_ratio" in ratios:
            last = results[-1]
            extra = (f"; {ratios['reserved_mib_ratio']:.2f}x the reserved memory of sizes=[{largest}] "
                     f"(target <= 1.2x)")
            if "pool_mib_ratio" in ratios:
                extra += f", pools {ratios['pool_mib_ratio']:.2f}x"
            results[-1] = dataclasses.replace(last, note=(last.note or "") + extra,
                                              values={**(last.values or {}), **ratios})
    return iter(results)


def compile_split_cost_row(opts: BenchOptions, on_step: StepCallback | None) -> Iterator[Measurement]:
    """The ``compile-split-cost`` row: host time per split, from k pieces against one."""
    from torchreplay.models.blocks import SPLIT_STYLES, SplitMLP, split_mark_op, split_mark_out_op

    import torchreplay as tr

    name = (f"cost of a split: MLP {DEPTH} x Linear({WIDTH}, {WIDTH})+GELU, batch {BATCH}, fp32, "
            "cut into k pieces by a splitting op")
    x = torch.randn(BATCH, WIDTH, device="cuda", generator=cuda_generator())  # [8, 1024]
    out = torch.empty_like(x)
    calls: dict[str, Any] = {}
    built: dict[str, Any] = {}
    first: dict[str, float] = {}
    results: list[Measurement] = []
    labels = {
        (f"tr.compile, {k} piece{'s' if k > 1 else ''}" if k == 1 or style == "returns" else
         f"tr.compile, {k} pieces, {_STYLE_WORDS[style]}"): (style, k)
        for style, k in SPLIT_PIECES
    }
    # the same models with the op inside one graph: one whole graph of the same work
    unsplit = {f"tr.compile, the {k}-piece model not split ({_STYLE_WORDS[style]} in the graph)": (style, k)
               for style, k in SPLIT_PIECES if k > 1}
    eager_labels = {style: f"the splitting op alone, eager: {_STYLE_WORDS[style]}" for style in SPLIT_STYLES}
    alone = {eager_labels["returns"]: lambda: split_mark_op()(x),
             eager_labels["writes"]: lambda: split_mark_out_op()(x, out),
             eager_labels["clone"]: lambda: torch.clone(x)}
    # what a replay calls for a custom op: its kernel, without the dispatcher
    op_labels = dict(eager_labels)
    for style, op, args in (("returns", split_mark_op(), [x]), ("writes", split_mark_out_op(), [x, out])):
        kernel = direct_call(op.default, args, {})
        if kernel is not None:
            op_labels[style] = f"the splitting op's kernel alone, as a replay calls it: {_STYLE_WORDS[style]}"
            alone[op_labels[style]] = lambda kernel=kernel, args=args: kernel(*args)
    compiled: Any = None
    torch.compiler.reset()
    try:
        with torch.no_grad():
            for label, (style, k) in [*labels.items(), *unsplit.items()]:
                if on_step is not None:
                    on_step(name, label)
                try:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    model = SplitMLP(k, DEPTH, WIDTH, style=style).cuda().eval()
                    ops = [] if label in unsplit else [SPLIT_STYLES[style]]
                    frame = own_frame(model, f"split_{style}_{k}_{len(ops)}")  # a Dynamo cache each
                    compiled = tr.compile(frame, splitting_ops=ops)
                    torch.testing.assert_close(compiled(x), model(x))
                    torch.cuda.synchronize()
                    first[label] = time.perf_counter() - t0
                    built[label] = compiled
                    calls[label] = lambda c=compiled: c(x)
                except Exception as exc:  # noqa: BLE001 - one failing method must not end the table
                    log.warning("%s / %s %s", name, label, short_reason(exc))
                    results.append(Measurement("compile-split-cost", name, label, error=short_reason(exc)))
            calls.update(alone)
            if on_step is not None:
                on_step(name, f"timing {len(calls)} methods interleaved")
            timings = time_interleaved(calls, opts)
        results += [
            Measurement("compile-split-cost", name, label, *t, first_call_s=first.get(label))
            if isinstance(t, tuple) else
            Measurement("compile-split-cost", name, label, error=t, first_call_s=first.get(label))
            for label, t in timings.items()
        ]
        return iter(_split_notes(results, labels, built, op_labels, list(alone), unsplit))
    finally:
        compiled = None
        calls.clear()
        built.clear()
        torch.compiler.reset()
        release()


def _split_notes(
    results: list[Measurement],
    labels: dict[str, tuple[str, int]],
    built: dict[str, Any],
    op_labels: dict[str, str],
    alone_labels: list[str],
    unsplit: dict[str, tuple[str, int]] | None = None,
) -> list[Measurement]:
    """Note on each k > 1 what each split adds over one piece, and how much of that is ours
    (over the splitting op's own time alone, ``op_labels[style]``); and, where ``unsplit`` has
    the same model compiled without the split (``(style, k)``), what each split adds over it;
    on each k what was made."""
    unsplit = unsplit or {}
    by_label = {m.method: m for m in results}
    one = next((by_label.get(label) for label, (_, k) in labels.items() if k == 1), None)
    whole = {key: by_label.get(label) for label, key in unsplit.items()}
    order = [*labels, *unsplit, *alone_labels]
    out = []
    for m in sorted(results, key=lambda m: order.index(m.method) if m.method in order else len(order)):
        style, k = labels.get(m.method) or unsplit.get(m.method) or ("", 0)
        if not k or m.per_call_us is None or m.method not in built:
            out.append(m)
            continue
        parts, values = [], {}
        if k > 1 and m.method in labels and one is not None and one.per_call_us is not None and one.host_us is not None:
            assert m.host_us is not None
            values["host_us_per_split"] = (m.host_us - one.host_us) / (k - 1)
            values["per_call_us_per_split"] = (m.per_call_us - one.per_call_us) / (k - 1)
            parts.append(f"{values['host_us_per_split']:+.1f} us host per split (target <= 20 us), "
                         f"{values['per_call_us_per_split']:+.1f} us synchronized")
            op = by_label.get(op_labels.get(style, ""))
            if op is not None and op.host_us is not None:
                values["ours_host_us_per_split"] = values["host_us_per_split"] - op.host_us
                parts.append(f"{values['ours_host_us_per_split']:+.1f} us of it ours (the op alone: "
                             f"{op.host_us:.1f} us)")
            same = whole.get((style, k))
            if same is not None and same.host_us is not None and same.per_call_us is not None:
                values["host_us_per_split_same_model"] = (m.host_us - same.host_us) / (k - 1)
                values["per_call_us_per_split_same_model"] = (m.per_call_us - same.per_call_us) / (k - 1)
                parts.append(f"{values['host_us_per_split_same_model']:+.1f} us host per split over the "
                             f"same model not split, {values['per_call_us_per_split_same_model']:+.1f} "
                             "us synchronized")
        text, counts = compile_summary(built[m.method])
        parts.append(text)
        values.update(counts)
        out.append(dataclasses.replace(m, note="; ".join(parts), values=values))
    return out
