"""Models nobody here wrote, each tried as a new user would: `tr.graph` for inference (one shape,
then `sizes=`), `tr.make_graphed_callables` for training, `breaks="auto"` where the whole capture
is refused; every result compared with eager on fresh random inputs over several calls.

Prints one line per model and mode: ``ok`` with the largest difference, ``DIFF`` (larger than the
tolerance), ``refused`` (a TorchReplayError, its first line) or ``ERROR`` (anything else: a bug).
Not a test (it never fails); what it finds becomes one.

Usage (on a CUDA machine): ``PYTHONPATH=. python scripts/zoo.py [--only NAME,NAME]
[--modes infer,sizes,train,auto,trainauto,compile,compilesizes,compiletrain,compiletrainclone]
[--dtype bfloat16] [--json PATH] [--device cpu]`` (``cpu``: the compile modes without a GPU,
which try Dynamo, the split and Inductor, not the graphs; ``compiletrainclone``: trained through
the backend with ``options={"outputs": "clone"}``)
"""
from __future__ import annotations

import argparse
import copy
import json
import traceback
from typing import Any, Callable

import torch

import torchreplay as tr

DEV = "cuda"
DTYPE = torch.float32  # --dtype
B, S, V = 2, 16, 512


def _cfg(name: str, **kw: Any) -> Any:
    import transformers as T
    return getattr(T, name + "Config")(**kw)


def _cls(name: str) -> Any:
    import transformers as T
    return getattr(T, name)


SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=V, max_position_embeddings=128)


def decoders() -> dict[str, Callable[[], Any]]:
    out: dict[str, Callable[[], Any]] = {}
    plain = ["Llama", "Mistral", "Qwen2", "Qwen3", "Gemma", "Gemma2", "Phi3",
             "Olmo", "Olmo2", "Granite", "Cohere", "Starcoder2", "StableLm", "Phi"]
    for n in plain:
        kw = dict(SMALL)
        if n in ("Gemma", "Gemma2", "Gemma3Text", "Qwen3"):
            kw["head_dim"] = 16
        if n == "Phi":
            kw.pop("num_key_value_heads")
        if n == "Phi3":
            kw["pad_token_id"] = 0
        out[n] = (lambda n=n, kw=kw: _cls(n + "ForCausalLM")(_cfg(n, **kw)))
    out["GPT2"] = lambda: _cls("GPT2LMHeadModel")(_cfg("GPT2", n_embd=64, n_layer=2, n_head=4,
                                                        vocab_size=V, n_positions=128))
    out["GPTNeoX"] = lambda: _cls("GPTNeoXForCausalLM")(_cfg(
        "GPTNeoX", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, vocab_size=V, max_position_embeddings=128))
    out["OPT"] = lambda: _cls("OPTForCausalLM")(_cfg(
        "OPT", hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=V, max_position_embeddings=128, word_embed_proj_dim=64))
    out["Falcon"] = lambda: _cls("FalconForCausalLM")(_cfg(
        "Falcon", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=V))
    out["Bloom"] = lambda: _cls("BloomForCausalLM")(_cfg(
        "Bloom", hidden_size=64, n_layer=2, n_head=4, vocab_size=V))
    out["GPTJ"] = lambda: _cls("GPTJForCausalLM")(_cfg(
        "GPTJ", n_embd=64, n_layer=2, n_head=4, vocab_size=V, n_positions=128, rotary_dim=8))
    moe = dict(SMALL, num_local_experts=4, num_experts_per_tok=2)
    out["Mixtral"] = lambda: _cls("MixtralForCausalLM")(_cfg("Mixtral", **moe))
    out["Qwen2Moe"] = lambda: _cls("Qwen2MoeForCausalLM")(_cfg(
        "Qwen2Moe", **dict(SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                           shared_expert_intermediate_size=64)))
    out["Olmoe"] = lambda: _cls("OlmoeForCausalLM")(_cfg(
        "Olmoe", **dict(SMALL, num_experts=4, num_experts_per_tok=2)))
    try:
        import peft

        def lora() -> Any:
            base = _cls("LlamaForCausalLM")(_cfg("Llama", **SMALL))
            return peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        out["Llama+LoRA"] = lora
    except ImportError:
        pass
    out["Mamba"] = lambda: _cls("MambaForCausalLM")(_cfg(
        "Mamba", hidden_size=64, num_hidden_layers=2, vocab_size=V, state_size=8))
    return out


def encoders() -> dict[str, Callable[[], Any]]:
    enc = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, vocab_size=V, max_position_embeddings=128)
    out: dict[str, Callable[[], Any]] = {}
    for n in ["Bert", "Roberta", "Electra", "DebertaV2", "Albert", "ModernBert"]:
        kw = dict(enc)
        if n == "Albert":
            kw["embedding_size"] = 32
        if n == "ModernBert":
            kw.update(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
        out[n] = (lambda n=n, kw=kw: _cls(n + "Model")(_cfg(n, **kw)))
    out["DistilBert"] = lambda: _cls("DistilBertModel")(_cfg(
        "DistilBert", dim=64, hidden_dim=128, n_layers=2, n_heads=4, vocab_size=V))
    return out


def seq2seq() -> dict[str, Callable[[], Any]]:
    return {
        "T5": lambda: _cls("T5ForConditionalGeneration")(_cfg(
            "T5", d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=V)),
        "Bart": lambda: _cls("BartForConditionalGeneration")(_cfg(
            "Bart", d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=V,
            max_position_embeddings=128)),
    }


def vision() -> dict[str, Callable[[], Any]]:
    out: dict[str, Callable[[], Any]] = {
        "ViT": lambda: _cls("ViTModel")(_cfg(
            "ViT", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, image_size=32, patch_size=8)),
        "ConvNext": lambda: _cls("ConvNextModel")(_cfg(
            "ConvNext", hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], image_size=32)),
        "Swin": lambda: _cls("SwinModel")(_cfg(
            "Swin", image_size=32, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
            window_size=4)),
    }
    try:
        import timm
        for n in ["resnet18", "efficientnet_b0", "vit_tiny_patch16_224", "convnext_atto"]:
            out["timm:" + n] = (lambda n=n: timm.create_model(n, pretrained=False, num_classes=10))
    except ImportError:
        pass
    try:
        import torchvision
        for n in ["mobilenet_v3_small", "efficientnet_b0", "regnet_y_400mf"]:
            out["tv:" + n] = (lambda n=n: getattr(torchvision.models, n)(num_classes=10))
    except ImportError:
        pass
    return out


def all_models() -> dict[str, Callable[[], Any]]:
    """Every model of the zoo by name (timm's, torchvision's and peft's where installed)."""
    return {**decoders(), **encoders(), **seq2seq(), **vision()}


def inputs(name: str, b: int, gen: torch.Generator) -> tuple[tuple, dict]:
    def ids(s: int = S) -> torch.Tensor:
        return torch.randint(0, V, (b, s), device=DEV, generator=gen)
    if name in encoders():
        return (), {"input_ids": ids(), "attention_mask": torch.ones(b, S, dtype=torch.long, device=DEV)}
    if name in seq2seq():
        return (), {"input_ids": ids(), "decoder_input_ids": ids(8)}
    if name.startswith(("timm:", "tv:")):
        hw = 224 if "vit" in name else 64
        return (torch.randn(b, 3, hw, hw, device=DEV, generator=gen).to(DTYPE),), {}
    if name in vision():
        return (), {"pixel_values": torch.randn(b, 3, 32, 32, device=DEV, generator=gen).to(DTYPE)}
    return (), {"input_ids": ids()}


def leaves(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if hasattr(x, "to_tuple"):
        x = x.to_tuple()
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in leaves(v)]
    return []


def maxdiff(a: Any, b: Any) -> float:
    la, lb = leaves(a), leaves(b)
    if len(la) != len(lb):
        raise AssertionError(f"{len(la)} tensors vs eager's {len(lb)}")
    d = 0.0
    for x, y in zip(la, lb):
        if x.shape != y.shape:
            raise AssertionError(f"shape {tuple(x.shape)} vs eager's {tuple(y.shape)}")
        if x.is_floating_point():
            d = max(d, (x.float() - y.float()).abs().max().item() / (1 + y.float().abs().max().item()))
        elif not torch.equal(x, y):
            d = max(d, float("inf"))
    return d


def lm(name: str) -> bool:
    return name in decoders()


def run_infer(name: str, build: Callable[[], Any], sizes: bool, breaks: Any = None) -> float:
    torch.manual_seed(0)
    model = build().to(DEV, DTYPE).eval()
    gen = torch.Generator(DEV).manual_seed(1)
    extra = {"use_cache": False} if lm(name) or name in seq2seq() else {}
    a, kw = inputs(name, 4 if sizes else B, gen)
    opts: dict[str, Any] = {"sizes": [1, 2, 4, 8]} if sizes else {}
    if breaks is not None:
        opts["breaks"] = breaks
    with torch.no_grad():
        g = tr.graph(model, *a, sample_kwargs={**kw, **extra}, **opts)
        if breaks is not None:
            print(tr.explain(g))
        d = 0.0
        for i in range(6):
            a, kw = inputs(name, [3, 1, 8, 5, 2, 4][i] if sizes else B, gen)
            want = model(*a, **kw, **extra)
            got = g(*a, **kw, **extra)
            d = max(d, maxdiff(got, want))
    _no_eager_calls(name, g)
    return d


def _no_eager_calls(name: str, graphed: Any) -> None:
    """An equal result proves nothing if the calls ran eagerly: none may have (a Python value
    the model read and its eager calls between ours rewrote, a mode, a hook)."""
    stats = getattr(graphed, "stats", None) or getattr(getattr(graphed, "forward", None), "stats", None)
    if stats is not None and stats.fallbacks:
        raise AssertionError(f"{name}: {stats.fallbacks} call(s) ran eagerly: {stats}")


def run_compile(name: str, build: Callable[[], Any], sizes: bool = False) -> float:
    """``torch.compile(backend="torchreplay")`` against eager at batches 2, 2, 3, 2, 5 (with
    ``sizes``: ``options={"sizes": [1, 2, 4, 8]}``, the batches padded)."""
    torch.manual_seed(0)
    model = build().to(DEV).eval()
    gen = torch.Generator(DEV).manual_seed(1)
    extra = {"use_cache": False} if lm(name) or name in seq2seq() else {}
    options = {"options": {"sizes": [1, 2, 4, 8]}} if sizes else {}
    compiled = torch.compile(model, backend="torchreplay", **options)
    before = _graphed_counts()
    d = 0.0
    with torch.no_grad():
        for b in [2, 2, 3, 2, 5]:
            a, kw = inputs(name, b, gen)
            e = maxdiff(compiled(*a, **kw, **extra), model(*a, **kw, **extra))
            print(f"    batch {b}: {e:.2e}", flush=True)
            d = max(d, e)
    if d > 1e-3:
        print(tr.explain(compiled))
    # (an equal result proves nothing if the calls ran ungraphed: say what replayed)
    print(graphed_report(since=before), flush=True)
    return d


def run_train(
    name: str, build: Callable[[], Any], breaks: Any = None, report: list[str] | None = None,
    compiled: bool = False, options: dict[str, Any] | None = None,
) -> float:
    """The largest difference from eager of the loss and every gradient over 4 steps;
    ``report`` gets ``tr.explain`` of the graphed model where breaks are given; ``compiled``:
    ``torch.compile(backend="torchreplay")`` in place of ``tr.make_graphed_callables``, with
    ``options`` (the backend's)."""
    torch.manual_seed(0)
    ref = build().to(DEV).train()
    model = copy.deepcopy(ref)
    gen = torch.Generator(DEV).manual_seed(1)
    a, kw = inputs(name, B, gen)
    if lm(name):
        kw["labels"] = kw["input_ids"]
        kw["use_cache"] = False
    opts = {"breaks": breaks} if breaks is not None else {}
    if compiled:
        graphed = torch.compile(model, backend="torchreplay", options=options or {})
        before = _graphed_counts()
    else:
        graphed = tr.make_graphed_callables(model, a, sample_kwargs=kw, **opts)
    if breaks is not None:
        text = tr.explain(graphed)
        print(text)
        if report is not None:
            report.append(text)
    d = 0.0
    for step in range(4):
        a, kw = inputs(name, B, gen)
        if lm(name):
            kw["labels"] = kw["input_ids"]
            kw["use_cache"] = False
        outs = []
        for m in (graphed, ref):
            torch.manual_seed(100 + step)
            out = m(*a, **kw)
            loss = out.loss if hasattr(out, "loss") and out.loss is not None else sum(
                t.float().square().mean() for t in leaves(out) if t.is_floating_point())
            loss.backward()
            outs.append(loss.detach())
        d = max(d, maxdiff(outs[0], outs[1]))
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            if (p.grad is None) != (q.grad is None):
                raise AssertionError(f"{n}.grad is {p.grad is None and 'None' or 'set'}, eager's is not")
            if p.grad is not None:
                d = max(d, maxdiff(p.grad, q.grad))
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    if compiled:
        print(graphed_report(since=before), flush=True)
    else:
        _no_eager_calls(name, graphed)
    return d


def _graphed_counts() -> dict[int, tuple[int, int]]:
    """Replays and ungraphed calls so far of each ``backend="torchreplay"`` runtime alive."""
    from torchreplay.compile.backend import runtimes_by_name

    return {id(r): (r.stats.replays, r.stats.fallbacks) for r in runtimes_by_name()}


def graphed_report(since: dict[int, tuple[int, int]] | None = None) -> str:
    """One line on the graphs ``backend="torchreplay"`` made in this process: replays and
    calls run without their graph (with why), so an equal result that ran ungraphed shows;
    ``since``: :func:`_graphed_counts` before the calls to report (only what came after)."""
    from torchreplay.compile.backend import runtimes_by_name

    since = since or {}
    # (the runtimes that replayed or fell back since: Dynamo's cache keeps earlier models')
    runtimes = [r for r in runtimes_by_name()
                if (r.stats.replays, r.stats.fallbacks) != since.get(id(r), (0, 0))]
    replays = sum(r.stats.replays - since.get(id(r), (0, 0))[0] for r in runtimes)
    fallbacks = sum(r.stats.fallbacks - since.get(id(r), (0, 0))[1] for r in runtimes)
    why: dict[str, int] = {}
    for r in runtimes:
        for reason, n in r.fallback_reasons.items():
            why[reason[:90]] = why.get(reason[:90], 0) + n
    return f"GRAPHED runtimes {len(runtimes)} replays {replays} fallbacks {fallbacks} " + "; ".join(
        f"{n}x {reason}" for reason, n in sorted(why.items(), key=lambda kv: -kv[1])
    )


def run_compile_train(name: str, build: Callable[[], Any], options: dict[str, Any] | None = None) -> float:
    """:func:`run_train` through ``torch.compile(backend="torchreplay", options=options)``, with
    Inductor's dropout on eager's random numbers (its own draws others)."""
    with torch._inductor.config.patch(fallback_random=True):
        return run_train(name, build, compiled=True, options=options)


MODES: dict[str, Callable[[str, Callable[[], Any]], float]] = {
    "infer": lambda n, b: run_infer(n, b, sizes=False),
    "sizes": lambda n, b: run_infer(n, b, sizes=True),
    "auto": lambda n, b: run_infer(n, b, sizes=False, breaks="auto"),
    "train": run_train,
    "trainauto": lambda n, b: run_train(n, b, breaks="auto"),
    "compile": lambda n, b: run_compile(n, b),
    "compilesizes": lambda n, b: run_compile(n, b, sizes=True),
    "compiletrain": run_compile_train,
    "compiletrainclone": lambda n, b: run_compile_train(n, b, {"outputs": "clone"}),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="")
    p.add_argument("--modes", default="infer,sizes,train", help=",".join(MODES))
    p.add_argument("--tol", type=float, default=1e-3)
    p.add_argument("--dtype", default="float32", help="inference modes only")
    p.add_argument("--json", default="", help="also write every result to this file")
    p.add_argument("--device", default="cuda",
                   help="cpu: the compile modes without CUDA graphs (Dynamo, the split, Inductor)")
    args = p.parse_args()
    global DTYPE, DEV
    DTYPE = getattr(torch, args.dtype)
    DEV = args.device
    if DEV == "cpu" or "compile" in args.modes:  # transformers wraps every model's forward in
        # one function: Dynamo's limit of 8 would run the rest eagerly (on the GPU too)
        torch._dynamo.config.recompile_limit = 256
        torch._dynamo.config.accumulated_recompile_limit = 4096
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    only = [s for s in args.only.split(",") if s]
    results = []
    for name, build in all_models().items():
        if only and name not in only:
            continue
        for mode in args.modes.split(","):
            row: dict[str, Any] = {"model": name, "mode": mode}
            try:
                d = MODES[mode](name, build)
                row.update(result="ok" if d <= args.tol else "DIFF", diff=d)
                print(f"{name:24s} {mode:6s} {row['result']:7s} {d:.2e}", flush=True)
            except tr.errors.TorchReplayError as e:
                first = str(e).strip().splitlines()[0][:220]
                row.update(result="refused", error=f"{type(e).__name__}: {first}")
                print(f"{name:24s} {mode:6s} refused {row['error']}", flush=True)
            except Exception as e:  # noqa: BLE001 - a bug to report
                row.update(result="ERROR", error=f"{type(e).__name__}: {str(e)[:300]}")
                print(f"{name:24s} {mode:6s} ERROR   {row['error']}", flush=True)
                tb = traceback.format_exc().splitlines()
                print("    " + "\n    ".join(tb[-8:]), flush=True)
            results.append(row)
            if DEV == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
    counts = {k: sum(r["result"] == k for r in results) for k in ("ok", "refused", "DIFF", "ERROR")}
    print("summary:", ", ".join(f"{v} {k}" for k, v in counts.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "dtype": args.dtype, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
