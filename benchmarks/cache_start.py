"""Cold vs warm start of the compile cache (issue 12), each start a fresh process.

For each model: ``tr.compile`` started cold (its cache, Inductor's and Triton's caches all empty),
then warm (all of them as the cold start left them), then warm with only torchreplay's cache
(Inductor's and Triton's caches emptied again: what our entries carry alone); and
``torch.compile(mode="reduce-overhead")`` cold, then warm (its own caches as its cold start left
them: the anchor). Each process reports, from the moment the parent started it:

- ``imports``: Python, torch and torchreplay imported;
- ``built``: the model built and on the GPU;
- ``first``: three calls done (the first graphed output: reduce-overhead records at its second
  call and replays at its third; ours captures every listed size at the first);
- ``compile+capture`` = ``first`` - ``built``: the part a cache can save.

Every process also checks its output against eager on fresh inputs (max abs difference), and the
``tr.compile`` ones count Inductor compiles (``compile_fx`` calls) and cache hits.

Models: ``data-if`` (a Dynamo graph break), ``bert`` (HF BERT), ``llama-67`` (the built-in Llama,
67 sizes captured at the first call) and ``llama-1`` (the same, one shape: like for like with
reduce-overhead, which records the one shape it is called with).

Python's bytecode: an installed torch has its modules compiled to bytecode, and Python keeps the
bytecode of what it imports later. A machine that keeps none (``PYTHONDONTWRITEBYTECODE``, as on
the GPU machines here) compiles the sources of every module torch imports lazily, at every start,
inside ``compile+capture``. So, by default, every start here shares one bytecode folder
(``PYTHONPYCACHEPREFIX``), filled by an untimed start of each kind first; ``--no-bytecode``
leaves the environment as it is.

``--kinds inductor`` starts ``torch.compile(model)`` (Inductor, no CUDA graphs); ``aot`` runs
torch's own AOT precompile of the fullgraph models
(``torch.compile(forward, fullgraph=True).aot_compile(...)`` with the model as an argument, saved, then
``torch.compiler.load_compiled_function``; Inductor without CUDA graphs): its warm start skips
Dynamo's trace too, which no cache of ours can, so it shows how low a warm start can go.

Usage: ``python benchmarks/cache_start.py [--models data-if,bert,llama-67,llama-1]
[--kinds tr,ro,aot] [--no-bytecode] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r'''
import json, sys, time
T0 = float(sys.argv[1]); MODEL = sys.argv[2]; MODE = sys.argv[3]
import torch
import torchreplay as tr
t_imports = time.time()
import torch._inductor.compile_fx as cfx
compiles = []
_inner = cfx.compile_fx
def _counting(*a, **k):
    compiles.append(1)
    return _inner(*a, **k)
cfx.compile_fx = _counting  # counts Inductor compiles in this benchmark process only
dev = torch.device("cuda")
torch.manual_seed(0)
sizes = None
if MODEL == "data-if":
    from torchreplay.models.blocks import DataDependentIf
    model = DataDependentIf().to(dev).eval()
    make = lambda: (torch.randn(8, 1024, device=dev),)
elif MODEL == "bert":
    from torchreplay.models.blocks import bert_encoder
    model = bert_encoder().to(dev).eval()
    def make():
        ids = torch.randint(0, 30000, (4, 64), device=dev)
        mask = torch.ones(4, 64, dtype=torch.long, device=dev)
        for r, n in enumerate((64, 48, 33, 17)):
            mask[r, n:] = 0
        return ids, mask
elif MODEL in ("llama-67", "llama-1"):
    from torchreplay.models.llama import LlamaConfig, build_llama
    from torchreplay.sizes.plan import default_sizes
    cfg = LlamaConfig(max_batch=512)
    model = build_llama(cfg, dev)
    sizes = default_sizes() if MODEL == "llama-67" else None
    make = lambda: (torch.randint(0, cfg.vocab_size, (8, 1), device=dev),
                    torch.full((8,), cfg.max_seq_len // 2, dtype=torch.long, device=dev))
torch.cuda.synchronize()
t_built = time.time()
if MODE == "tr":
    c = tr.compile(model, sizes=sizes)
elif MODE == "aot":  # torch's precompile (Inductor, no CUDA graphs): Dynamo's trace saved too
    import os
    def forward(m, *a):  # the model as an argument: the saved function holds no module
        return m(*a)
    torch._dynamo.config.enable_aot_compile = True  # off by default in torch 2.11
    path = os.environ["AOT_FILE"]
    if os.path.exists(path):
        with open(path, "rb") as f:
            loaded = torch.compiler.load_compiled_function(f, f_globals=globals())
    else:
        with torch.no_grad():
            loaded = torch.compile(forward, fullgraph=True).aot_compile(((model, *make()), {}))
        loaded.save_compiled_function(path)
    c = lambda *a: loaded(model, *a)
elif MODE == "inductor":  # torch.compile's default: Inductor, no CUDA graphs
    c = torch.compile(model)
else:
    c = torch.compile(model, mode="reduce-overhead")
with torch.no_grad():
    args = make()
    for _ in range(3):
        y = c(*args)
    torch.cuda.synchronize()
    t_first = time.time()
    diff = 0.0
    for _ in range(10):
        args = make()
        diff = max(diff, (c(*args) - model(*args)).abs().max().item())
out = {"imports": t_imports - T0, "built": t_built - T0, "first": t_first - T0,
       "compile_capture": t_first - t_built, "max_diff": diff, "inductor_compiles": len(compiles)}
if MODE == "tr":
    cache = c.backend.cache
    outcomes = cache.outcomes if cache is not None else []
    out["hits"] = sum(o.status == "hit" for o in outcomes)
    out["pieces"] = len(outcomes)
    out["compile_seconds"] = c.backend.compile_seconds
    out["capture_seconds"] = sum(r.stats.capture_seconds for r in c.backend.runtimes)
print("RESULT " + json.dumps(out))
'''


def _start(model: str, mode: str, dirs: dict[str, str]) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}",
           "TORCHINDUCTOR_CACHE_DIR": dirs["inductor"], "TRITON_CACHE_DIR": dirs["triton"],
           "TORCHREPLAY_CACHE_DIR": dirs["ours"], "AOT_FILE": os.path.join(dirs["ours"], "aot.bin")}
    if dirs.get("pycache"):  # Python's bytecode kept between the starts, as an install has it
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = dirs["pycache"]
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", CHILD, repr(t0), model, mode], env=env,
                         capture_output=True, text=True, timeout=1800)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        return {"error": (out.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(lines[-1][len("RESULT "):])


def _fresh(root: Path, *names: str) -> None:
    for name in names:
        shutil.rmtree(root / name, ignore_errors=True)
        (root / name).mkdir(parents=True)


def run(models: list[str], bytecode: bool = True, kinds: tuple[str, ...] = ("tr", "ro")
        ) -> list[dict[str, object]]:
    """Start each model cold then warm, for each kind: ``tr`` (and warm with our cache only),
    ``ro`` (reduce-overhead) and ``aot`` (torch's precompile; fullgraph models only)."""
    labels = {"tr": ("tr.compile cold", "tr.compile warm"),
              "ro": ("reduce-overhead cold", "reduce-overhead warm"),
              "inductor": ("torch.compile default cold", "torch.compile default warm"),
              "aot": ("torch precompile cold", "torch precompile warm")}
    rows: list[dict[str, object]] = []
    pycache = tempfile.mkdtemp(prefix="cache-start-pycache-") if bytecode else ""
    for model in models:
        todo = [k for k in kinds if not (k == "aot" and model == "data-if")]
        root = Path(tempfile.mkdtemp(prefix=f"cache-start-{model}-"))
        dirs = {k: str(root / k) for k in ("inductor", "triton", "ours")}
        dirs["pycache"] = pycache
        if bytecode:  # one start of each kind writes the bytecode of what it imports; not timed
            for mode in todo:
                _fresh(root, "inductor", "triton", "ours")
                _start(model, mode, dirs)
        for mode in todo:
            _fresh(root, "inductor", "triton", "ours")
            starts = [(label, ()) for label in labels[mode]]
            if mode == "tr":
                starts.append(("tr.compile warm (our cache only)", ("inductor", "triton")))
            for label, emptied in starts:
                _fresh(root, *emptied)
                rows.append({"model": model, "start": label, **_start(model, mode, dirs)})
                print(rows[-1], flush=True)
        shutil.rmtree(root, ignore_errors=True)
    if pycache:
        shutil.rmtree(pycache, ignore_errors=True)
    return rows


def table(rows: list[dict[str, object]]) -> str:
    head = ("| model | start | imports s | compile+capture s | first output s | hits | "
            "Inductor compiles | max diff |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['start']} | failed: {r['error']} |||||")
            continue
        hits = f"{r['hits']}/{r['pieces']}" if "hits" in r else "-"
        lines.append(
            f"| {r['model']} | {r['start']} | {r['imports']:.1f} | {r['compile_capture']:.2f} | "
            f"{r['first']:.1f} | {hits} | {r['inductor_compiles']} | {r['max_diff']:.2e} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="data-if,bert,llama-67,llama-1")
    p.add_argument("--json", default=None)
    p.add_argument("--no-bytecode", action="store_true",
                   help="every start compiles Python's sources (a machine that keeps no bytecode)")
    p.add_argument("--kinds", default="tr,ro",
                   help="tr (tr.compile), ro (reduce-overhead), inductor (torch.compile's "
                        "default, no graphs), aot (torch's AOT precompile: "
                        "Inductor, no graphs, fullgraph models; a warm start without Dynamo's trace)")
    ns = p.parse_args()
    rows = run(ns.models.split(","), bytecode=not ns.no_bytecode, kinds=tuple(ns.kinds.split(",")))
    print(table(rows))
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
