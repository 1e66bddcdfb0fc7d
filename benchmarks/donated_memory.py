"""What compiling training pieces without donated buffers costs in device memory (CUDA only).

Since session 54 the compile backend compiles each training piece with AOT autograd's donated
buffers off (``_compat.inductor_compile``, ``compile_fx_inner(donate=False)``): with them,
Inductor's backward may write a gradient into a saved activation's memory, which lies in the
forward graph's pool (HF Gemma2 and BART raised StaleOutputError in the backward). Donated
buffers let the backward reuse that memory; without them its own pool holds those buffers.

HF BERT (4 layers, hidden 512, fp32) trained through ``tr.compile``, batch 8 x 256, 5 SGD steps,
each method in a fresh process (the caching allocator keeps what a process ever reserved):
eager; ``torch.compile`` (Inductor, no graphs, donated buffers on: torch's default);
``tr.compile`` as shipped (donated buffers off); ``tr.compile`` with them on again (this script
undoes the two switches in its own process only; BERT trained equal to eager that way in session
54). Reported: the weights alone, the peak of allocated and of reserved memory over the steps
(a graph pool's blocks count as reserved), the runtimes' pool bytes, and the largest difference
of the loss and gradients from eager's at the last step.

Usage: ``PYTHONPATH=. python benchmarks/donated_memory.py``"""
import json
import subprocess
import sys

METHODS = ["eager", "inductor", "tr.compile (donated off)", "tr.compile (donated on)"]
BATCH, TOKENS = 8, 256


def _donate_again() -> None:
    """Undo the backend's two switches for this process: a benchmark's comparison, not a mode."""
    import torch._functorch.config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    import torchreplay._compat as compat

    inner = compat.compile_fx_inner

    def compile_fx_inner(gm, example_inputs, *, donate=True, **kwargs):
        return inner(gm, example_inputs, donate=True, **kwargs)

    def inductor_compile(gm, example_inputs, inner_compile=None):
        if inner_compile is None:
            return compile_fx(gm, list(example_inputs))
        with functorch_config.patch(enable_autograd_cache=False):
            return compile_fx(gm, list(example_inputs), inner_compile=inner_compile)

    compat.compile_fx_inner = compile_fx_inner
    compat.inductor_compile = inductor_compile


def one(method: str) -> dict:
    import copy

    import torch
    import transformers

    import torchreplay as tr

    torch.backends.cuda.matmul.allow_tf32 = False
    if method == "tr.compile (donated on)":
        _donate_again()
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=2000, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
        intermediate_size=2048, max_position_embeddings=512, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = transformers.BertForMaskedLM(cfg).cuda().train()
    ref = copy.deepcopy(model)
    weights = torch.cuda.memory_allocated()
    if method == "inductor":
        run = torch.compile(model)
    elif method.startswith("tr.compile"):
        run = tr.compile(model, cache_dir=None)
    else:
        run = model
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=1e-3)
    gen = torch.Generator("cuda").manual_seed(1)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    diff = 0.0
    for step in range(5):
        ids = torch.randint(0, cfg.vocab_size, (BATCH, TOKENS), device="cuda", generator=gen)
        losses = []
        for m, o in ((run, opt), (ref, opt_ref)):
            o.zero_grad(set_to_none=True)
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
        if step == 4:
            diff = max([(losses[0] - losses[1]).abs().item()] + [
                (p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())])
        opt.step()
        opt_ref.step()
    torch.cuda.synchronize()
    pools = 0
    if method.startswith("tr.compile"):
        pools = sum(r.stats.pool_bytes for r in run.backend.runtimes)  # (a pool each: training)
    mib = 2**20
    return {"weights": weights / mib, "peak allocated": torch.cuda.max_memory_allocated() / mib,
            "peak reserved": torch.cuda.max_memory_reserved() / mib, "pools": pools / mib, "diff": diff}


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] in METHODS:
        print("RESULT " + json.dumps(one(sys.argv[1])))
        sys.exit(0)
    print(f"HF BERT for masked LM, 4 layers, hidden 512, fp32, batch {BATCH} x {TOKENS}; with an "
          "eager copy trained alongside (both counted in every row)")
    print("| method | weights MiB (both) | peak allocated MiB | peak reserved MiB | graph pools MiB | max diff vs eager |")
    print("|---|---|---|---|---|---|")
    for m in METHODS:
        run = subprocess.run([sys.executable, __file__, m], capture_output=True, text=True)
        line = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
        if run.returncode or not line:
            print(f"| {m} | failed: {(run.stderr.strip().splitlines() or ['?'])[-1][:150]} | | | | |")
            continue
        r = json.loads(line[-1][7:])
        print(f"| {m} | {r['weights']:.0f} | {r['peak allocated']:.0f} | {r['peak reserved']:.0f} | "
              f"{r['pools']:.0f} | {r['diff']:.1e} |", flush=True)
