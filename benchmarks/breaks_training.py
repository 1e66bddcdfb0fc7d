"""Training with breaks (``tr.make_graphed_callables(model, args, breaks=...)``): one training step
(forward, cross-entropy, backward, SGD step), interleaved, against eager and, where the model can
be graphed whole, against one graph of the whole model (the upper bound). RESULTS.md, "Training
with breaks".

- HF Llama (random weights, 4 layers, hidden 512, fp32, batch 4 x 64 tokens), broken at its
  attention module, or only at SDPA's kernel op; its attention can be captured, so the whole
  model graphed is the bound.
- The same Llama with Liger's Triton RMSNorm and SwiGLU (``torch.autograd.Function``s between
  the breaks), when ``liger_kernel`` is installed.
- The GPU test's toy model (6 blocks, hidden 256, batch 4 x 32) whose attention reads host-side
  lengths (``tolist``) that change every step: it cannot be graphed whole.

Usage: ``PYTHONPATH=. python benchmarks/breaks_training.py``
"""
import copy
import importlib.util
import sys

sys.path.insert(0, ".")
sys.path.insert(0, "tests/gpu")

import torch
import torch.nn.functional as F
import transformers
from transformers.models.llama import modeling_llama

import torchreplay as tr
from torchreplay.bench.timing import BenchOptions, time_interleaved

import test_breaks_training as toy  # noqa: E402  (the GPU test's host-lengths model)

torch.backends.cuda.matmul.allow_tf32 = False
OPTS = BenchOptions(repeats=15, calls=20, warmup=5, host_calls=5)


def steps(make, sample, batch, breaks: dict, whole: bool):
    """name -> one training step, for eager, graphed around each ``breaks`` (name -> breaks=),
    and (``whole``) one graph of the whole model."""
    out = {}
    torch.manual_seed(0)
    base = make()
    for name in ["eager", *breaks] + (["whole graph"] if whole else []):
        m = copy.deepcopy(base)
        try:
            if name in breaks:
                tr.make_graphed_callables(m, sample, breaks=breaks[name])
                print(tr.explain(m).splitlines()[0])
            elif name == "whole graph":
                tr.make_graphed_callables(m, sample)
        except Exception as exc:  # noqa: BLE001 - a row that cannot be built says why
            print(f"{name}: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)

        def step(m=m, opt=opt):
            args, targets = batch()
            opt.zero_grad(set_to_none=True)
            logits = m(*args)
            logits = getattr(logits, "logits", logits)
            F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
            opt.step()

        out[name] = step
    return out


def llama():
    cfg = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=128, use_cache=False,
    )
    return transformers.LlamaForCausalLM(cfg).cuda().train()


def liger_llama():
    """The same Llama with Liger's Triton RMSNorm and SwiGLU (``torch.autograd.Function``s) in
    every layer, put in by hand (no patching of transformers)."""
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    model = llama()
    cfg = model.config
    for layer in model.model.layers:
        for name in ("input_layernorm", "post_attention_layernorm"):
            setattr(layer, name, LigerRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps).cuda())
        mlp = LigerSwiGLUMLP(cfg).cuda()
        mlp.load_state_dict(layer.mlp.state_dict())
        layer.mlp = mlp
    return model


LLAMA_BREAKS = {
    "breaks=[LlamaAttention]": [modeling_llama.LlamaAttention],
    "breaks=[SDPA kernel op]": ["aten._scaled_dot_product_efficient_attention"],
}
ids = torch.randint(0, 1024, (4, 64), device="cuda")
rows = {"HF Llama 4x512, b4 x 64": steps(llama, (ids,), lambda: ((ids,), ids), LLAMA_BREAKS, whole=True)}
if importlib.util.find_spec("liger_kernel") is None:  # (a wheel carried to the GPU machine)
    print("liger_kernel is not installed: no Liger row")
else:
    rows["HF Llama 4x512 + Liger RMSNorm, SwiGLU, b4 x 64"] = steps(
        liger_llama, (ids,), lambda: ((ids,), ids), LLAMA_BREAKS, whole=True
    )
toy.H, toy.T, toy.B = 256, 32, 4
g = torch.Generator(device="cuda").manual_seed(0)
sample = toy._batch(g)


def toy_batch():
    ids, lengths = toy._batch(g)
    return (ids, lengths), ids


rows["host-lengths toy 6x256, b4 x 32"] = steps(
    lambda: toy.Model(layers=6).cuda(), sample, toy_batch, {"breaks=[HostAttention]": [toy.HostAttention]}, whole=False
)
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
print("| model | method | step (us) | vs eager | host (us, min) |")
print("|---|---|---|---|---|")
for row, calls in rows.items():
    res = time_interleaved(calls, OPTS)
    eager = res["eager"][0]
    for name, r in res.items():
        if isinstance(r, str):
            print(f"| {row} | {name} | failed: {r} | | |")
        else:
            print(f"| {row} | {name} | {r[0]:.0f} | {eager / r[0]:.2f}x | {r[1]:.0f} |")
