"""What the check of the plain values a graph froze (``core/frozen.py``) costs each call, on the
CPU with emulated graphs (``tests/cpu/test_buckets.install_cpu_graphs``), so only the check is
timed: deep random-weight Hugging Face models (a 32-layer Llama, a 24-layer BERT), the built-in
ResNet-50-like CNN in eval (its batch norms' modes), and the price of the write events on
Python >= 3.12 (``model.eval()`` on the Llama followed by a check, with the events on and off,
interleaved). RESULTS.md, session 77.

Usage: ``python benchmarks/frozen_check_cost.py`` from the repository root, under each Python
to compare (3.11 compares every value; 3.12 and newer only after a module write)."""
import sys, timeit
sys.path[:0] = [".", "tests/cpu"]  # (run from the repository root)
import torch
import test_buckets
import torchreplay as tr
from torchreplay.core import frozen
from torchreplay.models import CNNConfig, build_cnn
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM


class _Patch:
    def setattr(self, obj, name, value):
        setattr(obj, name, value)


test_buckets.install_cpu_graphs(_Patch().setattr)
where = f"Python {sys.version.split()[0]}"


def check_cost(values, number=5000):
    return min(timeit.repeat(values.changed, number=number, repeat=5)) / number * 1e6


llama = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=32,
                                     num_attention_heads=4, num_key_value_heads=2, use_cache=False)).eval()
bert = BertModel(BertConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=24,
                            num_attention_heads=4)).eval()
graphs = {}
for name, m in (("HF Llama, 32 layers", llama), ("HF BERT, 24 layers", bert)):
    graphs[name] = tr.graph(m, torch.randint(0, 128, (1, 8)))
graphs["built-in CNN, eval"] = tr.graph(build_cnn(CNNConfig(), "cpu").eval(), torch.randn(1, 3, 64, 64))
for name, g in graphs.items():
    values = g._reads.values
    print(f"{name}: {len(values.paths())} values, the check {check_cost(values):.2f} us a call ({where})")

if hasattr(sys, "monitoring") and frozen._TOOL and frozen._TOOL[0] is not None:
    values = graphs["HF Llama, 32 layers"]._reads.values
    code = torch.nn.Module.__setattr__.__code__
    mon = sys.monitoring

    def step():
        llama.eval()  # one write a module: 423 of them
        values.changed()

    times = {"events on": [], "events off": []}
    for _ in range(20):
        for key in times:
            if key == "events off":
                mon.set_local_events(frozen._TOOL[0], code, 0)
            times[key].append(timeit.timeit(step, number=50) / 50 * 1e6)
            if key == "events off":
                mon.set_local_events(frozen._TOOL[0], code, mon.events.PY_RETURN)
    print("model.eval() + the check, us:", {k: f"min {min(v):.1f} median {sorted(v)[10]:.1f}" for k, v in times.items()})
