"""The margin of the padding check of ``tr.graph(sizes=)`` (sizes/probe.py) on real models (CUDA).

For each model: the normwise relative difference between the real rows of a call padded to the
largest size and the same call unpadded, as the build's probe measures it, against the tolerance
of the output's dtype, and whether the build reported it. Models whose rows are independent
(what kernel choice per shape leaves: rounding) should sit far below the tolerance; models that
read the padding (a mean over the rows, HF BERT with its padded positions left unmasked) far above.
Only the largest size is captured (``capture="lazy"``): the probe is what is measured. The
breakable and compiled rows check at their first capture and first call instead (not yet run on
the GPU when written, session 44).
Then the state a padded call leaves (``--state``: only that): a prefill that writes a cache at
padded positions, the built-in Llama's cache rows past the batch, HF Llama with a StaticCache.
Usage: ``python benchmarks/padding_check.py [--state]``.
"""
import sys, os, logging, re
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import torch.nn as nn
import torchreplay as tr
from torchreplay.models.llama import LlamaConfig, build_llama

DEV = "cuda"


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def row(name, build, expect):
    handler = Lines()
    logger = logging.getLogger("torchreplay")
    logger.addHandler(handler)
    before = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        build()
    except Exception as exc:  # (a model this torch cannot run: say so, go on)
        print(f"{name:44s} failed: {type(exc).__name__}: {str(exc)[:120]}")
        return
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)
    diffs = [re.search(r"padding check: (.*?) of (\d+) rows padded to (\d+): relative difference (\S+) "
                       r"\(tolerance (\S+)\)", m) for m in handler.lines]
    diffs = [d for d in diffs if d]
    skipped = [m for m in handler.lines if "padding not checked" in m]
    reported = any("padding changes" in m for m in handler.lines)
    worst = max(diffs, key=lambda d: float(d.group(4)) / float(d.group(5)), default=None)
    if worst is None:
        print(f"{name:44s} not compared {skipped[:1]}")
        return
    ok = "ok" if reported == expect else "WRONG"
    print(f"{name:44s} {worst.group(1):22s} {worst.group(2):>3s}->{worst.group(3):<3s} "
          f"diff {float(worst.group(4)):9.3g}  tol {worst.group(5):>5s}  reported {str(reported):5s} "
          f"(expected {expect}: {ok})")


def llama(dtype, n):
    torch.manual_seed(0)
    cfg = LlamaConfig(n_layers=8, max_batch=32)
    model = build_llama(cfg, DEV, dtype, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (n, 1), device=DEV)
    pos = torch.full((n,), 5, dtype=torch.long, device=DEV)
    return lambda: tr.graph(model, ids, pos, sizes=[1, 2, 4, 8, 16, 32], capture="lazy")


def bert(dtype, dim, fill_mask, seq=20):
    transformers = __import__("transformers")
    cfg = transformers.BertConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=6,
                                  num_attention_heads=4, intermediate_size=1024,
                                  max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.BertModel(cfg, add_pooling_layer=False).to(DEV, dtype).eval()
    b = 5 if dim == 0 else 2
    ids = torch.randint(1, 1000, (b, seq), device=DEV)
    mask = torch.ones(b, seq, dtype=torch.long, device=DEV)
    sizes = [1, 2, 4, 8, 16, 32] if dim == 0 else [16, 32, 64]
    return lambda: tr.graph(lambda i, m: model(input_ids=i, attention_mask=m).last_hidden_state,
                            ids, mask, sizes=sizes, dim=dim, fill_value={1: fill_mask}, capture="lazy")


def gpt2(dtype):
    transformers = __import__("transformers")
    cfg = transformers.GPT2Config(vocab_size=1000, n_embd=256, n_layer=6, n_head=4, n_positions=128)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).to(DEV, dtype).eval()
    ids = torch.randint(0, 1000, (2, 20), device=DEV)
    return lambda: tr.graph(lambda i: model(input_ids=i).logits, ids, sizes=[16, 32, 64], dim=1,
                            capture="lazy")


def resnet(dtype, n):
    torchvision = __import__("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet50().to(DEV, dtype).eval()
    x = torch.randn(n, 3, 224, 224, device=DEV, dtype=dtype)
    return lambda: tr.graph(model, x, sizes=[1, 2, 4, 8, 16], capture="lazy")


def centred(dtype):
    torch.manual_seed(0)
    lin = nn.Linear(256, 256).to(DEV, dtype)
    x = torch.randn(5, 256, device=DEV, dtype=dtype)
    return lambda: tr.graph(lambda x: lin(x - x.mean(0)), x, sizes=[1, 2, 4, 8, 16, 32], capture="lazy")


def breakable_llama(dtype, n):
    """The built-in Llama with its host-lengths attention as a break (the check at the first
    capture, breaks/sized.py)."""
    from torchreplay.bench.breaks import _inputs
    from torchreplay.models.llama import host_attention
    model = build_llama(LlamaConfig(n_layers=8, max_batch=32), DEV, dtype, seed=0)
    args = _inputs(model, n)
    return lambda: tr.graph(model, *args, breaks=[host_attention], sizes=[1, 2, 4, 8, 16, 32],
                            capture="lazy")


def compiled(dtype, fn_of, n):
    """The compile backend (the check at the first call, pieces/padding.py)."""
    torch.manual_seed(0)
    fn = fn_of(nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256)).to(DEV, dtype))
    x = torch.randn(n, 256, device=DEV, dtype=dtype)
    return lambda: tr.compile(fn, sizes=[1, 2, 4, 8, 16, 32])(x)


def main():
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, TF32 matmul "
          f"{torch.backends.cuda.matmul.allow_tf32}, TF32 cuDNN {torch.backends.cudnn.allow_tf32}")
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            t = str(dtype).removeprefix("torch.")
            row(f"Llama 8 layers decode, {t}, 3 rows", llama(dtype, 3), False)
            row(f"Llama 8 layers decode, {t}, 32 rows", llama(dtype, 32), False)
            row(f"HF BERT 6 layers, {t}, batch, masked", bert(dtype, 0, 0), False)
            row(f"HF BERT 6 layers, {t}, sequence, masked", bert(dtype, 1, 0), False)
            row(f"HF BERT 6 layers, {t}, sequence, unmasked", bert(dtype, 1, 1), True)
            row(f"HF GPT-2 6 layers, {t}, sequence (causal)", gpt2(dtype), False)
            row(f"torchvision ResNet-50, {t}, 3 images", resnet(dtype, 3), False)
            row(f"x - x.mean(0), then Linear, {t}", centred(dtype), True)
            row(f"breakable Llama 8 layers, {t}, 3 rows", breakable_llama(dtype, 3), False)
            row(f"compiled MLP, {t}, 5 rows", compiled(dtype, lambda m: m, 5), False)
            row(f"compiled MLP(x - x.mean(0)), {t}, 5 rows",
                compiled(dtype, lambda m: (lambda x: m(x - x.mean(0))), 5), True)
            torch._dynamo.reset()


def state_row(name, build, expect):
    """A build whose calls write state: the padding check's line, and whether it warned (a state
    the real rows keep that differs) or only noted the padding rows' own writes."""
    handler = Lines()
    logger = logging.getLogger("torchreplay")
    logger.addHandler(handler)
    try:
        g = build()
    except Exception as exc:
        print(f"{name:52s} failed: {type(exc).__name__}: {str(exc)[:160]}")
        return
    finally:
        logger.removeHandler(handler)
    warned = any("padding changes the state" in m for m in handler.lines)
    outputs = any("padding changes what" in m for m in handler.lines)
    ok = "ok" if warned == expect else "WRONG"
    print(f"{name:52s} state warning {str(warned):5s} (expected {expect}: {ok}); outputs reported {outputs}; "
          f"build {g.stats.capture_seconds:.2f} s")
    print(f"    {g.stats.padding_check[:400]}")


class Prefill(nn.Module):
    """Each token's key into a sequence cache at its position (index_copy_)."""

    def __init__(self, dim=256, slots=128):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("cache", torch.zeros(slots, dim))

    def forward(self, x, pos):
        k = self.proj(x)
        self.cache.index_copy_(0, pos, k)
        return torch.relu(k)


def prefill(fill):
    torch.manual_seed(0)
    m = Prefill().to(DEV)
    x, pos = torch.randn(20, 256, device=DEV), torch.arange(20, device=DEV)
    return lambda: tr.graph(m, x, pos, sizes=[16, 32, 64], fill_value={"pos": fill}, capture="lazy")


def hf_llama_prefill(fill):
    """HF Llama's prefill into a StaticCache, padded along the sequence: the padding tokens'
    cache_position is the fill value."""
    transformers = __import__("transformers")
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(DEV).eval()
    cache = transformers.StaticCache(config=cfg, max_cache_len=128)
    ids = torch.randint(1, 1000, (1, 20), device=DEV)
    cp = torch.arange(20, device=DEV)

    def step(ids, cp):
        return model(input_ids=ids, past_key_values=cache, cache_position=cp, use_cache=True).logits

    step(ids, cp)  # (the cache's tensors are made at its first update)
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            t.zero_()
    return lambda: tr.graph(step, ids, cp, sizes=[16, 32, 64], dim={"ids": 1, "cp": 0},
                            fill_value={"cp": fill}, capture="lazy")


def state_rows():
    print("-- state a padded call leaves (module buffers, Python state): float32")
    state_row("built-in Llama 8 layers decode, 3 rows (cache rows)", llama(torch.float32, 3), False)
    state_row("breakable Llama 8 layers, 3 rows (cache rows)", breakable_llama(torch.float32, 3), False)
    state_row("prefill index_copy_, 20 -> 32, positions padded 0", prefill(0), True)
    state_row("prefill index_copy_, 20 -> 32, positions padded 127", prefill(127), False)
    state_row("HF Llama StaticCache prefill, 20 -> 32, positions 0", hf_llama_prefill(0), True)
    # (transformers 5 writes at its own cumulative_length, not at cache_position, and advances
    # it by the padded length: a warning whatever the fill)
    state_row("HF Llama StaticCache prefill, 20 -> 32, positions 127", hf_llama_prefill(127), True)


if __name__ == "__main__":
    if "--state" not in sys.argv:
        main()
    with torch.no_grad():
        state_rows()
