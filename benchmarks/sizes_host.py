"""Host cost of a ``tr.graph(sizes=)`` call against a hand-written padded graph, interleaved
(CUDA only): the MLP (one argument) and the built-in Llama's decode step (two: ids, positions),
a call of 13 rows into the graph of 16, with the same input tensors at every call and with a
different one at each (eight in turn: the size graph's copy node is repointed, _compat/copy_nodes.py);
then the device time of the latter back to back. 300 rounds of 10 calls, the methods' order
rotated each round; the paired difference to the hand-written graph in the same round (median,
25th and 75th percentile). Usage: ``python benchmarks/sizes_host.py``."""
import itertools, os, statistics, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import torchreplay as tr
from torchreplay.bench.timing import handwritten_padded
from torchreplay.models.factories import llama_factory, mlp_factory
from _paired import device_us, interleaved


N = 13
for row, factory, sizes in (("mlp", lambda: mlp_factory(N), [1, 2, 4, 8, 16]),
                            ("llama", lambda: llama_factory(N), [1, 2, 4, 8, 16, 24, 32])):
    torch.manual_seed(0)
    model, args = factory()
    with torch.no_grad():
        hand = handwritten_padded(model, args, {}, 16)
        g = tr.graph(model, *args, sizes=sizes)
        turns = [tuple(a.clone() if not a.is_floating_point() else torch.randn_like(a) for a in args) for _ in range(8)]
        hand_turn, ours_turn = itertools.cycle(turns), itertools.cycle(turns)
        print(f"== {row} ({len(args)} tensor arguments, {N} rows into the graph of 16; graph copies: {g.stats.graph_copies})")
        print(" the same input tensors at every call (host us/call):")
        interleaved({"hand-written padded": hand, "tr.graph sizes= (checked)": lambda: g(*args)}, width=34)
        # the hand-written call copies from the sample tensors: give it the next tensors by
        # writing them into the samples (one copy each, in both methods' rounds alike)
        def hand_rot():
            for a, b in zip(args, next(hand_turn)): a.copy_(b)
            return hand()
        def ours_rot():
            nxt = next(ours_turn)
            for a, b in zip(args, nxt): a.copy_(b)  # the same extra copies as hand_rot
            return g(*nxt)
        print(" a different input tensor at each call (host us/call; both pay the same extra copies):")
        interleaved({"hand-written padded": hand_rot, "tr.graph sizes= (checked)": ours_rot}, width=34)
        dev = {"hand-written padded": [], "tr.graph sizes= (checked)": []}
        for _ in range(5):
            dev["hand-written padded"].append(device_us(hand_rot, 200))
            dev["tr.graph sizes= (checked)"].append(device_us(ours_rot, 200))
        print(" device time back to back (us/call, median of 5): " + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in dev.items()))
    del model, hand, g
    torch.cuda.empty_cache()
