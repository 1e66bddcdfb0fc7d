"""Host cost of one tr.graph call against a hand-written graph, interleaved (CUDA only).

For the MLP and ResNet-50 b1 rows: the hand-written graph (the floor), ``outputs="static"``, and
the default ``"checked"`` policy with the caller dropping each output ("dropped") or keeping it
until the next call returns ("kept", as ``y = g(x)`` in a loop does), and "checked" without the
per-call check that the module's state stayed put (``core/placed.py``), to show what it costs;
then hand-written and "checked" given a different input tensor at each call (eight in turn: the
graph's copy node is pointed at each, _compat/copy_nodes.py), and the device time of those
calls back to back. 300 rounds of 10 calls,
the methods' order rotated each round; per method the min and median, and the paired difference
to the floor in the same round (median, 25th and 75th percentile): the machines are noisy, the
paired difference much less so. Then the same with the replay replaced by a no-op everywhere
("dry": the launch, identical for all, taken out), the cost of the single operations, and a
cProfile of 20000 checked calls. Usage: ``python benchmarks/host_overhead.py``.
"""
import sys, os, time, statistics, cProfile, pstats, io, itertools
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import torchreplay as tr
from torchreplay import _compat
from torchreplay.bench.timing import handwritten_graph
from _paired import device_us, interleaved
from torchreplay.core.placed import CHANGES
from torchreplay.models.factories import mlp_factory, resnet50_factory

def per_call(f, n=2000, reps=9):
    best = []
    for _ in range(reps):
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(n): f()
        best.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return min(best)

for row, fac in (("mlp", mlp_factory), ("resnet50", resnet50_factory)):
    torch.manual_seed(0)
    model, (x,) = fac()
    with torch.no_grad():
        hand = handwritten_graph(model, (x,), {})
    gs = tr.graph(model, x, outputs="static")
    gc_ = tr.graph(model, x)  # checked
    gk = tr.graph(model, x)  # checked, its outputs kept: a graph of its own, or the "dropped"
    # calls after a "kept" round would find the kept output held and make new tensors
    gc_unplaced = tr.graph(model, x)  # checked, without the per-call state check (core/placed.py)
    gc_unplaced._placed = None
    print(f"== {row}")
    def hand_call(): return hand()
    def static_call(): return gs(x)
    def checked_call(): return gc_(x)
    def checked_keep():
        global kept
        kept = gk(x)
    print(" real replays (host us/call):")
    interleaved({"hand": hand_call, "static": static_call, "checked (dropped)": checked_call, "checked (kept)": checked_keep,
                 "checked, no state check": lambda: gc_unplaced(x)})
    # A different input tensor at each call (eight in turn): the graph's copy node is pointed
    # at each (_compat/copy_nodes.py), where the same tensor again needs nothing.
    xs = [torch.randn_like(x) for _ in range(8)]
    rot_static = x.clone()
    side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3): model(rot_static)
    torch.cuda.current_stream().wait_stream(side)
    rot_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(rot_graph), torch.no_grad():
        rot_out = model(rot_static)
    hand_turn, ours_turn = itertools.cycle(xs), itertools.cycle(xs)
    def hand_rot():
        rot_static.copy_(next(hand_turn)); rot_graph.replay(); return rot_out
    def checked_rot(): return gc_(next(ours_turn))
    print(" real replays, a different input tensor at each call (host us/call):")
    interleaved({"hand": hand_rot, "checked (dropped)": checked_rot})
    # Device time of the same calls back to back (the GPU's pace, the host ahead of it): does
    # repointing the copy node cost the device anything? Seven alternating rounds of 300 calls.
    dev = {"hand": [], "checked (dropped)": []}
    for _ in range(7):
        dev["hand"].append(device_us(hand_rot)); dev["checked (dropped)"].append(device_us(checked_rot))
    print(" device time, the same calls back to back (us/call, median of 7 rounds): " + ", ".join(
        f"{k} {statistics.median(v):.1f}" for k, v in dev.items()))
    # dry: no replay anywhere (identical launch cost removed)
    noop = lambda: None
    hand_static = x.clone()
    def hand_dry():
        hand_static.copy_(x); noop(); return hand_static
    gs._replay = noop; gc_._replay = noop; gk._replay = noop; gc_unplaced._replay = noop
    print(" dry (no replay):")
    interleaved({"hand": hand_dry, "static": static_call, "checked (dropped)": checked_call, "checked (kept)": checked_keep,
                 "checked, no state check": lambda: gc_unplaced(x)}, rounds=400)
    # torch.inference_mode (serving): each method enters it per call, so the paired difference
    # is ours. Under it a checked output is an inference tensor, as eager's: made new per call
    # (no version counter to reuse it by), over the last call's storage when nothing holds it.
    gi = tr.graph(model, x)  # its own graph: its outputs are inference tensors
    inf = torch.inference_mode
    def hand_inf():
        with inf(): return hand()
    def checked_inf():
        with inf(): return gi(x)
    def checked_nograd():
        with torch.no_grad(): return gc2(x)
    gc2 = tr.graph(model, x)
    print(" real replays, each call in a context (host us/call):")
    interleaved({"hand, inference_mode": hand_inf, "checked, inference_mode": checked_inf,
                 "checked, no_grad": checked_nograd})
    o = gc_._outputs
    ptr, nbytes, metas = o.groups[0]
    S = _compat.alias_storage(ptr, o.device, nbytes)
    meta = metas[0][1]
    pl = gc_._placed  # the per-call state check, as inlined in Graphed.__call__
    pool = gc_.pool  # the per-call stream check (core/pool.py Pool.on_stream)
    print(" components:")
    for name, f in [("copy_", lambda: hand_static.copy_(x)),
                    ("alias_storage", lambda: _compat.alias_storage(ptr, o.device, nbytes)),
                    ("tensor_from_storage", lambda: _compat.tensor_from_storage(meta, S)),
                    ("invalidate_storage", lambda: _compat.invalidate_storage(_compat.alias_storage(ptr, o.device, nbytes), "x")),
                    ("storage_Use_Count", lambda: torch._C._storage_Use_Count(S._cdata)),
                    ("getrefcount", lambda: sys.getrefcount(S)),
                    ("emit", o.emit), ("copy_in", lambda: gc_._inputs.copy_in((x,), {})),
                    ("empty_like", lambda: torch.empty_like(x)),
                    ("a lambda (floor)", lambda: None),
                    ("stream check", lambda: _compat.current_stream(pool.index) != pool.stream),
                    ("autocast check", getattr(_compat, "any_autocast", lambda: False)),
                    ("state check", lambda: pl is not None and (pl.seen != CHANGES[0] or pl.table[pl.key].data_ptr() != pl.at) and pl.moved())]:
        print(f"   {name:22s} {per_call(f):7.3f}")
    pr = cProfile.Profile(); pr.enable()
    for _ in range(20000): gc_(x)
    pr.disable(); torch.cuda.synchronize()
    st = io.StringIO(); pstats.Stats(pr, stream=st).sort_stats("tottime").print_stats(14); print(st.getvalue()[-3500:])
    del hand, gs, gc_, gk, gi, gc2, model
    torch.cuda.empty_cache()
