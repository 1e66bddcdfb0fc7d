"""Where the replay path spends its host time: hand-written graph vs tr.graph per output policy.

A profiling aid for the hot path (not a benchmark row): it times, per call, the host-side cost of
issuing the call (no synchronisation in the loop) and the synchronised wall time, for a small
MLP whose GPU time is tiny, so host overhead dominates. Run on a CUDA machine:

    python benchmarks/replay_overhead.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn as nn

import torchreplay as tr


def _time(fn, x, n: int, sync: bool) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn(x)
    if sync:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def measure(fn, x, repeats: int = 7) -> tuple[float, float]:
    """Return (synchronised us per call, host-only us per call), medians of ``repeats``."""
    for _ in range(20):
        fn(x)
    wall = statistics.median(_time(fn, x, 200, True) for _ in range(repeats))
    # Host-only: a short burst, so the GPU queue never fills and blocks the launch calls.
    host = statistics.median(_time(fn, x, 20, False) for _ in range(repeats * 3))
    torch.cuda.synchronize()
    return wall, host


def main() -> None:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(24):
        layers += [nn.Linear(512, 512), nn.ReLU()]
    model = nn.Sequential(*layers).cuda().eval()
    x = torch.randn(8, 512, device="cuda")

    static_x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), torch.no_grad():
        static_y = model(static_x)

    def hand(inp):
        static_x.copy_(inp)
        g.replay()
        return static_y

    rows = {"hand-written": hand}
    for policy in ("checked", "static", "clone"):
        rows[f"tr.graph {policy}"] = tr.graph(model, x, outputs=policy)
    rows["eager"] = torch.no_grad()(model.forward)
    base_wall, base_host = measure(hand, x)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"{'row':24s} {'wall us':>9s} {'x floor':>8s} {'host us':>9s} {'+host us':>9s}")
    for name, fn in rows.items():
        wall, host = measure(fn, x)
        print(
            f"{name:24s} {wall:9.1f} {wall / base_wall:8.3f} {host:9.1f} {host - base_host:+9.1f}"
        )


if __name__ == "__main__":
    main()
