"""Timing helpers of the host-cost benchmarks (``host_overhead.py``, ``sizes_host.py``): methods
timed in interleaved rounds against the first one, and device time of calls back to back."""
import statistics
import time

import torch


def interleaved(methods: dict, rounds: int = 300, calls: int = 10, width: int = 36) -> None:
    """Time each method's ``calls`` calls per round, the order rotated each round, and print per
    method the min and median (us per call) and the paired difference to the first method in
    the same round (median, 25th and 75th percentile): the machines are noisy, the paired
    difference much less so."""
    names = list(methods)
    s: dict = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            f = methods[k]
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(calls):
                f()
            s[k].append((time.perf_counter() - t) / calls * 1e6)
    torch.cuda.synchronize()
    floor = names[0]
    for k in names:
        d = sorted(a - b for a, b in zip(s[k], s[floor]))
        q = lambda p: d[int(p * (len(d) - 1))]  # noqa: E731
        print(f"   {k:{width}s} min {min(s[k]):8.2f}  med {statistics.median(s[k]):8.2f}  "
              f"paired d vs floor: med {q(.5):+6.2f} p25 {q(.25):+6.2f} p75 {q(.75):+6.2f}")


def device_us(f, n: int = 300) -> float:
    """Device time of ``n`` calls of ``f`` back to back (the host ahead of the GPU), us per call."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    e0.record()
    for _ in range(n):
        f()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / n * 1000
