"""Where the host time of a split goes (RESULTS.md, "the cost of a split"): the `compile-split-cost`
MLP (12 x Linear(1024)+GELU, batch 8) cut into 1 and 8 pieces by a custom op, timed through
`tr.compile` and through its piecewise runtime alone (no Dynamo), interleaved, with the single
operations of a split timed alone and a profile of the runtime's call. Needs CUDA.

Usage: ``PYTHONPATH=. python benchmarks/split_cost_profile.py [--profile]``
"""
from __future__ import annotations

import cProfile
import io
import pstats
import sys

import torch

sys.path.insert(0, ".")
import torchreplay as tr  # noqa: E402
from torchreplay import _compat  # noqa: E402
from torchreplay.bench.timing import BenchOptions, host_loop_us, time_interleaved  # noqa: E402
from torchreplay.models.blocks import SPLIT_STYLES, SplitMLP, split_mark_op, split_mark_out_op  # noqa: E402
from torchreplay.pieces.runtime import PiecewiseRuntime  # noqa: E402


def runtime_and_args(compiled, x):
    """The one runtime of ``compiled`` and the flat arguments Dynamo passes it."""
    seen = []
    original = PiecewiseRuntime.__call__

    def spy(self, *args, **kwargs):
        seen.append((self, args))
        return original(self, *args, **kwargs)

    PiecewiseRuntime.__call__ = spy
    try:
        compiled(x)
    finally:
        PiecewiseRuntime.__call__ = original
    assert len(seen) == 1, f"{len(seen)} runtimes called"
    return seen[0]


def trace(rt, args) -> None:
    """Print one synchronized call's GPU timeline: each kernel or copy, when it starts after
    the call began, and how long it runs."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        rt(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            rt(*args)
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    cpu = [e for e in prof.events() if e.device_type != torch.autograd.DeviceType.CUDA
           and e.name in ("cudaGraphLaunch", "cudaLaunchKernel", "cudaMemcpyAsync",
                          "cudaDeviceSynchronize", "cudaStreamSynchronize")]
    events.sort(key=lambda e: e.time_range.start)
    cpu.sort(key=lambda e: e.time_range.start)
    if not events:
        print("no GPU events")
        return
    third = len(events) // 3
    last = events[-third:]
    t0 = min(e.time_range.start for e in last)
    busy = sum(e.time_range.elapsed_us() for e in last)
    span = max(e.time_range.end for e in last) - t0
    print(f"one call on the GPU: {len(last)} kernels/copies, busy {busy:.1f} us over {span:.1f} us")
    for e in last:
        print(f"  +{e.time_range.start - t0:8.1f} us  {e.time_range.elapsed_us():7.1f} us  {e.name[:70]}")
    host = [e for e in cpu if e.time_range.start >= t0 - 400]
    print("host launches of that call (start relative to the first GPU event):")
    for e in host[-40:]:
        print(f"  +{e.time_range.start - t0:8.1f} us  {e.time_range.elapsed_us():7.1f} us  {e.name}")


def raw_copy_rows(buf, y):
    """The copy of ``y`` into ``buf`` through the CUDA driver and runtime directly (ctypes), for
    comparison with ``buf.copy_(y)``."""
    import ctypes
    import os

    rows = {}
    idx = buf.device.index or 0
    raw = torch._C._cuda_getCurrentRawStream
    rows["_cuda_getCurrentRawStream(idx)"] = lambda: raw(idx)
    rows["y.data_ptr()"] = y.data_ptr
    with open("/proc/self/maps") as f:
        libs = sorted({line.split()[-1] for line in f if "libcud" in line})
    print("loaded:", *libs, sep="\n  ")
    try:
        drv = ctypes.CDLL("libcuda.so.1")
        f = drv.cuMemcpyDtoDAsync_v2
        f.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        f.restype = ctypes.c_int
        n = y.nbytes
        rows["driver cuMemcpyDtoDAsync_v2"] = lambda: f(buf.data_ptr(), y.data_ptr(), n, raw(idx))
        rc = f(buf.data_ptr(), y.data_ptr(), n, raw(idx))
        torch.cuda.synchronize()
        print("driver copy rc", rc, "equal", torch.equal(buf, y))
    except Exception as exc:  # noqa: BLE001
        print("driver:", exc)
    for lib in libs:
        if "cudart" not in lib:
            continue
        try:
            rt = ctypes.CDLL(os.path.basename(lib))
            g = rt.cudaMemcpyAsync
            g.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            g.restype = ctypes.c_int
            n = y.nbytes
            rows["runtime cudaMemcpyAsync"] = lambda: g(buf.data_ptr(), y.data_ptr(), n, 3, raw(idx))
            buf.zero_()
            rc = g(buf.data_ptr(), y.data_ptr(), n, 3, raw(idx))
            torch.cuda.synchronize()
            print("runtime copy rc", rc, "equal", torch.equal(buf, y))
        except Exception as exc:  # noqa: BLE001
            print("runtime:", exc)
    rows["torch._foreach_copy_([buf], [y])"] = lambda: torch._foreach_copy_([buf], [y])
    rows["empty_like(y)"] = lambda: torch.empty_like(y)
    return rows


def main() -> None:
    op = split_mark_op()
    torch.manual_seed(0)
    x = torch.randn(8, 1024, device="cuda")
    built = {}
    with torch.no_grad():
        for style, k in [("returns", 1), ("returns", 2), ("returns", 8), ("returns, copied", 8),
                         ("writes", 8), ("clone", 8)]:
            # "returns, copied": the next graph reads a buffer of its own, copied into every
            # call (before pieces/handoff.py): no private pool for its runtime
            made = _compat.private_allocations
            if style == "returns, copied":
                _compat.private_allocations = lambda index: None
            try:
                model = SplitMLP(k, style=style.split(",")[0]).cuda().eval()
                # another option value: a backend of its own (tr.compile shares one per class)
                c = tr.compile(model, splitting_ops=[SPLIT_STYLES[style.split(",")[0]]],
                               max_graphs=17 if style == "returns, copied" else 16)
                want = model(x)
                for _ in range(3):
                    torch.testing.assert_close(c(x), want)
                built[style, k] = (c, *runtime_and_args(c, x))
            finally:
                _compat.private_allocations = made
            rt = built[style, k][1]
            print(f"{style}, {k}: reads of eager values:",
                  sorted({type(b).__name__ for e in rt._entries.values() for g in e.graphs if g is not None
                          for _, b in g.copies}))
        calls = {}
        for (style, k), (c, rt, args) in built.items():
            calls[f"tr.compile, {style}, {k}"] = lambda c=c: c(x)
            calls[f"runtime alone, {style}, {k}"] = lambda rt=rt, args=args: rt(*args)
        res = time_interleaved(calls, BenchOptions(repeats=9, calls=100, warmup=20, host_calls=10))
        for name, v in res.items():
            print(f"{name:32s} per call {v[0]:8.1f} us  host min {v[1]:8.1f}  host median {v[2]:8.1f}")
        for what in ("tr.compile", "runtime alone"):
            a = res[f"{what}, returns, 1"]
            for style, k in built:
                if k > 1:
                    b = res[f"{what}, {style}, {k}"]
                    print(f"{what}, {style}, {k}: per split host min {(b[1] - a[1]) / (k - 1):+.1f} us, "
                          f"median {(b[2] - a[2]) / (k - 1):+.1f}, synchronized {(b[0] - a[0]) / (k - 1):+.1f}")
        out = torch.empty_like(x)
        for name, f in {"split_mark(x)": lambda: op(x),
                        "empty_like + split_mark_out(x, out)": lambda: split_mark_out_op()(x, torch.empty_like(x)),
                        "split_mark_out(x, out)": lambda: split_mark_out_op()(x, out),
                        "torch.clone(x)": lambda: torch.clone(x)}.items():
            med, lo = host_loop_us(f, samples=20)
            print(f"  the op alone, eager: {name:36s} {med:7.2f} us (min {lo:.2f})")

        rt, args = built["returns", 8][1], built["returns", 8][2]
        route = rt._route(args)
        entry = route.entry
        eager = [s for s in entry.steps if s[0] is None]
        graphed = [s for s in entry.steps if s[0] is not None]
        print(f"8 pieces: {len(graphed)} graphed steps, {len(eager)} eager steps")
        g = graphed[1][0]
        fn = eager[0][1]
        y = op(x)
        buf = torch.empty_like(y)
        env = [None] * 200
        reads = graphed[1][2]
        for pos, b in g.copies:
            env[reads[pos]] = y
        rows = {
            "op(x) (the OpOverloadPacket)": lambda: op(x),
            "op.default(x)": lambda: op.default(x),
            "eager piece fn (FX forward)": lambda: fn(x),
            "x.clone()": lambda: x.clone(),
            "graph.replay() of one piece": g.replay,
            "buf.copy_(y)": lambda: buf.copy_(y),
            "PieceGraph.copy_in": lambda: g.copy_in(reads, env),
            "y.shape != buf.shape": lambda: y.shape != buf.shape,
            "rt._route(args)": lambda: rt._route(args),
        }
        rows.update(raw_copy_rows(buf, y))
        kernel = _compat.custom_op_kernel(op.default, "cuda")
        bare = _compat.without_dynamo_guard(kernel)
        rows["the op's kernel, torch's Dynamo wrapper"] = lambda: kernel(x)
        if bare is not None:
            rows["the op's kernel, bare"] = lambda: bare(x)
        for name, f in rows.items():
            med, lo = host_loop_us(f, samples=20)
            print(f"  {name:34s} {med:7.2f} us (min {lo:.2f})")
        # The copy_in row refilled a tensor at the graph's handoff address into env: held, it
        # takes that block, and the profile's calls below would miss it and be demoted to copies.
        env.clear()
        rows.clear()

        if "--trace" in sys.argv:
            for key in (("returns", 8), ("writes", 8)):
                print(key)
                trace(built[key][1], built[key][2])
        if "--profile" in sys.argv:  # the runtime's call with 1, 2 and 8 pieces
            for key in (("returns", 1), ("returns", 2), ("returns", 8)):
                rt, args = built[key][1], built[key][2]
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(3000):
                    rt(*args)
                prof.disable()
                torch.cuda.synchronize()
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
                print(key, s.getvalue())


if __name__ == "__main__":
    main()
