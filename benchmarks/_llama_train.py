"""The training step the ``breaks_training_*`` benchmarks measure: a random-weight HF Llama (4
layers, hidden 512, vocab 1024, fp32, TF32 off) on a batch of 4 x 64 tokens, with the break at
SDPA's kernel op; one SGD step on the cross-entropy of predicting the input."""
import time

import torch
import torch.nn.functional as F
import transformers

BREAK = "aten._scaled_dot_product_efficient_attention"


def llama_and_tokens():
    """The model (seeded, on the GPU, in training mode) and the token batch."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=128, use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).cuda().train()
    return model, torch.randint(0, 1024, (4, 64), device="cuda")


def stepper(model, ids):
    """One training step of ``model`` on ``ids``, as a function."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(ids).logits.flatten(0, 1), ids.flatten()).backward()
        opt.step()
    return step


def block(step, n: int = 10) -> tuple[float, float]:
    """``n`` calls of ``step`` from an idle GPU: host us per call, and us per call until the
    GPU is done."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        step()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host, (time.perf_counter() - t) / n * 1e6
