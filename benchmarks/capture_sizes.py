#!/usr/bin/env python3
"""Capture time and memory of many sizes: hand-written vs ``tr.graph(sizes=...)``.

For each model, captures every size of ``default_sizes(512)`` (1, 2, 4, 8, 16, ..., 512: 67 sizes)
and reports wall seconds and the extra reserved memory (MiB) of:

- ``hand-written, shared pool``: how one does it by hand (vLLM's pattern): one pool
  (``torch.cuda.graph_pool_handle()``), static inputs at the largest size sliced per size, three
  warm-up calls at the largest size only, then ``torch.cuda.graph(g, pool=pool)`` per size,
  largest first; each size's output is kept (it is what the caller reads).
- ``hand-written, largest alone``: the same for the largest size only.
- ``tr.graph sizes=``: ``tr.graph(fn, *args, sizes=default_sizes(512))``.
- ``tr.graph sizes=[512]``: the largest size alone through torchreplay.

Targets (issue 3): ``tr.graph sizes=`` within 2x the hand-written capture time, and its extra
memory within 1.2x of ``tr.graph sizes=[512]`` (memory grows with the largest size, not with the
number of sizes).

Method: each measurement runs twice and the second run is reported (the first pays for CUDA
context set-up, cuBLAS handles and workspaces, kernel loading). Seconds: ``time.perf_counter``
from a ``torch.cuda.synchronize()`` before construction to one after. Extra memory:
``torch.cuda.memory_reserved()`` with the graphs alive minus before, each read after
``gc.collect(); torch.cuda.empty_cache()``; warm-up and capture share one persistent side stream
per method, so no cuBLAS workspace is counted.

Usage: ``python benchmarks/capture_sizes.py [--model mlp|llama|all] [--max-size 512] [--json PATH]``
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torchreplay as tr  # noqa: E402
from torchreplay import bench  # noqa: E402

HAND = "hand-written, shared pool"
HAND_ALONE = "hand-written, largest alone"
TR_SIZES = "tr.graph sizes="
TR_ALONE = "tr.graph sizes=[largest]"
METHODS = (HAND, HAND_ALONE, TR_SIZES, TR_ALONE)

# One side stream for every hand-written warm-up and capture: a new stream per capture would get
# a new cuBLAS workspace (32 MiB and more) counted as captured memory.
_SIDE: torch.cuda.Stream | None = None


@dataclasses.dataclass
class Result:
    model: str
    method: str
    sizes: int
    seconds: float
    extra_mib: float
    pool_mib: float | None = None


def _reserved() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def capture_by_hand(fn: Callable[..., Any], args: tuple[torch.Tensor, ...], sizes: list[int],
                    warmup: int = 3) -> tuple[list[torch.cuda.CUDAGraph], list[Any]]:
    """Capture ``fn`` at every size (dim 0 of every argument), one pool, largest first."""
    global _SIDE
    if _SIDE is None:
        _SIDE = torch.cuda.Stream()
    side = _SIDE
    largest = max(sizes)
    static = [a.new_zeros((largest, *a.shape[1:])) for a in args]
    for s, a in zip(static, args):
        s[: a.shape[0]].copy_(a[:largest])
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(warmup):
            fn(*static)
    torch.cuda.current_stream().wait_stream(side)
    pool = torch.cuda.graph_pool_handle()
    graphs, outs = [], []
    with torch.no_grad():
        for size in sorted(sizes, reverse=True):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=side):
                outs.append(fn(*[s[:size] for s in static]))
            graphs.append(g)
    return graphs, outs


def measure(model: str, method: str, fn: Callable[..., Any], args: tuple[torch.Tensor, ...],
            sizes: list[int]) -> Result:
    """Build ``method``'s graphs twice; return the second build's seconds and extra memory."""
    result = None
    for _ in range(2):
        base = _reserved()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if method in (HAND, HAND_ALONE):
            held: Any = capture_by_hand(fn, args, sizes if method == HAND else [max(sizes)])
        else:
            held = tr.graph(fn, *args, sizes=sizes if method == TR_SIZES else [max(sizes)])
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        extra = _reserved() - base
        pool_mib = held.stats.pool_bytes / 2**20 if isinstance(held, tr.BucketedGraph) else None
        n = len(sizes) if method in (HAND, TR_SIZES) else 1
        result = Result(model, method, n, seconds, extra / 2**20, pool_mib)
        del held
        _reserved()
    assert result is not None
    return result


def _mlp() -> Iterator[tuple[str, Callable[..., Any], tuple[torch.Tensor, ...]]]:
    torch.manual_seed(0)
    layers = [nn.Linear(1024, 1024) for _ in range(16)]
    model = nn.Sequential(*layers).to("cuda", torch.bfloat16).eval().requires_grad_(False)
    yield "MLP 16 x Linear(1024, 1024), bf16", model, (
        torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16),
    )


def _llama(max_size: int) -> Iterator[tuple[str, Callable[..., Any], tuple[torch.Tensor, ...]]]:
    from torchreplay.models.llama import LlamaConfig, build_llama

    cfg = LlamaConfig(max_batch=max_size)  # the KV cache holds the largest batch
    model = build_llama(cfg, "cuda")  # bf16
    ids = torch.randint(0, cfg.vocab_size, (1, 1), device="cuda")  # [1, 1]
    positions = torch.full((1,), cfg.max_seq_len // 2, dtype=torch.long, device="cuda")  # [1]
    yield f"Llama decode ({cfg.n_layers} layers, hidden {cfg.dim}, bf16)", model, (ids, positions)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["mlp", "llama", "all"], default="all")
    parser.add_argument("--max-size", type=int, default=512)
    parser.add_argument("--json", help="write the results here")
    ns = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("capture_sizes: CUDA is not available; this benchmark captures CUDA graphs")
        return 2
    from rich.console import Console
    from rich.table import Table

    sizes = tr.default_sizes(ns.max_size)
    env = bench.environment()
    console = Console()
    console.print(f"{env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}; {len(sizes)} sizes "
                  f"({sizes[0]}..{sizes[-1]}), second of two runs")
    results: list[Result] = []
    sources = []
    if ns.model in ("mlp", "all"):
        sources.append(_mlp)
    if ns.model in ("llama", "all"):
        sources.append(lambda: _llama(ns.max_size))
    for source in sources:
        for name, fn, args in source():
            for method in METHODS:
                results.append(measure(name, method, fn, args, sizes))
                console.print(f"  {name}: {method}: {results[-1].seconds:.3f} s, "
                              f"{results[-1].extra_mib:.1f} MiB", highlight=False)
            del fn, args
            _reserved()

    table = Table(title="capture of many sizes: seconds and extra reserved memory")
    for col in ("model", "method", "sizes", "seconds", "vs hand-written", "extra MiB",
                "vs largest alone", "pool MiB"):
        table.add_column(col, justify="left" if col in ("model", "method") else "right")
    by = {(r.model, r.method): r for r in results}
    for r in results:
        hand = by.get((r.model, HAND if r.method in (HAND, TR_SIZES) else HAND_ALONE))
        alone = by.get((r.model, TR_ALONE if r.method.startswith("tr.") else HAND_ALONE))
        table.add_row(
            r.model, r.method, str(r.sizes), f"{r.seconds:.3f}",
            f"{r.seconds / hand.seconds:.2f}x" if hand else "-",
            f"{r.extra_mib:.1f}",
            f"{r.extra_mib / alone.extra_mib:.2f}x" if alone and alone.extra_mib else "-",
            "-" if r.pool_mib is None else f"{r.pool_mib:.1f}",
        )
    console.print(table)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"environment": env, "sizes": sizes,
                       "results": [dataclasses.asdict(r) for r in results]}, f, indent=2)
            f.write("\n")
        console.print(f"wrote {ns.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
