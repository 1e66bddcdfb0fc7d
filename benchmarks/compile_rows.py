"""Issue 10's benchmark rows: eager, reduce-overhead, backend="cudagraphs", tr.graph and the
torchreplay backend, one process, interleaved (each repeat times every variant in turn), median
microseconds per call. A variant that fails is a row entry, not a crash.

Usage: python benchmarks/compile_rows.py [--repeats 7] [--calls 50] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torchreplay as tr  # noqa: E402

DEV = "cuda"
#: --variants: only these variants (a comma-separated list); all when empty
VARIANTS: set[str] = set()


def mlp(width: int = 1024, depth: int = 12) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


class DataIf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = mlp(depth=6), mlp(depth=6)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:
            h = h * 2
        return self.b(h)


class Nonzero(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = mlp(depth=6), mlp(depth=6)

    def forward(self, x):
        h = self.a(x)
        idx = torch.nonzero(h > 0)
        return self.b(h), idx


def _time(fn, inputs, calls: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(calls):
        out = fn(inputs[i % len(inputs)])
        del out
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def row(name: str, model: nn.Module, shapes: list[tuple[int, ...]], repeats: int, calls: int, sizes=None):
    model = model.to(DEV).eval()
    inputs = [torch.randn(s, device=DEV) for s in shapes]
    variants = {}

    def add(label, make):
        if VARIANTS and label not in VARIANTS:
            return
        try:
            t0 = time.perf_counter()
            fn = make()
            with torch.no_grad():
                for x in inputs:
                    fn(x)
                torch.cuda.synchronize()
            variants[label] = (fn, time.perf_counter() - t0)
        except Exception as exc:  # a row entry, not a crash
            variants[label] = (None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}")

    torch._dynamo.reset()
    add("eager", lambda: model)
    add("reduce-overhead", lambda: torch.compile(model, mode="reduce-overhead"))
    add("cudagraphs", lambda: torch.compile(model, backend="cudagraphs"))
    if len(set(shapes)) == 1:
        add("tr.graph", lambda: tr.graph(model, inputs[0]))
    add("torchreplay", lambda: tr.compile(model, sizes=sizes))
    times: dict[str, list[float]] = {k: [] for k, (fn, _) in variants.items() if fn is not None}
    with torch.no_grad():
        for _ in range(repeats):
            for label in times:
                try:
                    times[label].append(_time(variants[label][0], inputs, calls))
                except Exception as exc:
                    variants[label] = (None, f"{type(exc).__name__}: {str(exc)[:120]}")
                    times[label] = []
    out = {"row": name}
    for label, (fn, info) in variants.items():
        if fn is None or not times.get(label):
            out[label] = f"fails ({info})" if isinstance(info, str) else "fails"
        else:
            out[label] = round(statistics.median(times[label]), 1)
            out[f"{label} first-call s"] = round(info, 2)
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--json")
    ap.add_argument("--rows", default="mlp,if,nonzero,sweep")
    ap.add_argument("--variants", default="", help="e.g. eager,tr.graph,torchreplay")
    a = ap.parse_args()
    VARIANTS.update(v for v in a.variants.split(",") if v)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    rows = []
    want = a.rows.split(",")
    try:
        if "mlp" in want:
            rows.append(row("12-layer MLP b8", mlp(), [(8, 1024)], a.repeats, a.calls))
        if "if" in want:
            rows.append(row("MLP, data-dependent if", DataIf(), [(8, 1024)], a.repeats, a.calls))
        if "nonzero" in want:
            rows.append(row("MLP, nonzero between blocks", Nonzero(), [(8, 1024)], a.repeats, a.calls))
        if "sweep" in want:
            rows.append(row("batch sweep 1..16", mlp(), [(b, 1024) for b in range(1, 17)],
                            a.repeats, a.calls, sizes=[1, 2, 4, 8, 16]))
    except Exception:
        traceback.print_exc()
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
