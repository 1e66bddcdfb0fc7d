"""Timing helpers of the host-cost benchmarks (``host_overhead.py``, ``sizes_host.py``,
``input_grads_cost.py``, ``saved_inputs_cost.py``, ``function_watch.py``, ``mgc_adamw_split.py``):
methods timed in interleaved rounds against one of them, paired differences, and device time of
calls back to back."""
import statistics
import time

import torch


def paired_quantiles(xs: list, ys: list) -> tuple[float, float, float]:
    """The median, 25th and 75th percentile of ``x - y`` over paired samples (same round)."""
    d = sorted(a - b for a, b in zip(xs, ys))
    q = lambda p: d[int(p * (len(d) - 1))]  # noqa: E731
    return q(.5), q(.25), q(.75)


def interleaved(methods: dict, rounds: int = 300, calls: int = 10, width: int = 36,
                floor: str | None = None, sync_each: bool = False) -> dict:
    """Time each method's ``calls`` calls per round, the order rotated each round, and print per
    method the min and median (us per call) and the paired difference to ``floor`` (default:
    the first method) in the same round (median, 25th and 75th percentile): the machines are
    noisy, the paired difference much less so. ``sync_each``: a synchronize before each call,
    only the call timed (else the calls back to back). Returns the samples per method."""
    names = list(methods)
    s: dict = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            f = methods[k]
            torch.cuda.synchronize()
            total = 0.0
            t = time.perf_counter()
            for _ in range(calls):
                if sync_each:
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                f()
                if sync_each:
                    total += time.perf_counter() - t
            if not sync_each:
                total = time.perf_counter() - t
            s[k].append(total / calls * 1e6)
    torch.cuda.synchronize()
    floor = floor or names[0]
    for k in names:
        med, p25, p75 = paired_quantiles(s[k], s[floor])
        print(f"   {k:{width}s} min {min(s[k]):8.2f}  med {statistics.median(s[k]):8.2f}  "
              f"paired d vs {floor}: med {med:+6.2f} p25 {p25:+6.2f} p75 {p75:+6.2f}")
    return s


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
