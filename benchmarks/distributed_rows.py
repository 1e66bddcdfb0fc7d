"""Issue 13's benchmark rows on every GPU there is (2 ranks on 2 GPUs; one rank on one GPU,
where NCCL still runs its kernels), and the agreement's own cost between 2 ranks sharing GPU 0.

    python benchmarks/distributed_rows.py [--rows tp,agree,ddp-mlp,ddp-resnet50] [--json F]

Prints, per row, us per call (synchronized median over repeats, methods interleaved) and the
host-side minimum, for rank 0 (every rank's figures go to the JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from torchreplay.bench import distributed as rows  # noqa: E402
from torchreplay.bench.ranks import run_ranks  # noqa: E402


def _table(title: str, times: dict) -> None:
    print(f"\n{title}")
    for name, t in times.items():
        if isinstance(t, str):
            print(f"  {name:34s} failed: {t}")
        else:
            print(f"  {name:34s} {t[0]:9.1f} us   host min {t[1]:8.1f} us")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="tp,agree,ddp-mlp,ddp-resnet50")
    p.add_argument("--json", default="")
    a = p.parse_args()
    world = min(2, torch.cuda.device_count())
    print(f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}, "
          f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}; NCCL rows on {world} rank(s)")
    out: dict = {"world": world}
    for row in a.rows.split(","):
        if row == "tp":
            res = run_ranks(rows.tp_mlp, world, backend="nccl", timeout=500)
            out[row] = res
            status, v = res[0]
            if status != "ok":
                print(f"tp: {status}: {v}")
                continue
            print(f"\nTP MLP ({rows.LAYERS} layers, {rows.DIM}->{rows.HIDDEN}->{rows.DIM}, bf16), "
                  f"{world} rank(s); {v['agreement']}")
            for b in ("b1", "b8", "b32"):
                _table(f"  batch {b[1:]}", v[b])
            if "exchange" in v:
                _table("  agreeing on a size alone (median, min us per call)", v["exchange"])
        elif row == "agree":
            res = run_ranks(rows.agree_cost, 2, backend="gloo", timeout=300)
            out[row] = res
            for r, (status, v) in enumerate(res):
                if status != "ok":
                    print(f"agree rank {r}: {status}: {v}")
                    continue
                _table(f"agreement cost, rank {r} of 2 sharing GPU 0 ({v['agreement']})", v["times"])
        elif row.startswith("ddp-"):
            model = row[4:]
            res = run_ranks(rows.ddp_train, world, model, backend="nccl", timeout=500)
            out[row] = res
            status, v = res[0]
            if status != "ok":
                print(f"{row}: {status}: {v}")
                continue
            _table(f"DDP training step, {model}, per-GPU batch {v['batch']}, {world} rank(s)", v["times"])
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
