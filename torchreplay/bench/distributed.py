"""Rows on several ranks (each function runs on every rank, under :func:`run_ranks`).

- ``tp_mlp``: the tensor-parallel MLP decode step of issue 13 (8 layers, 1024 -> 4096 -> 1024,
  bf16, column- then row-parallel with an all_reduce per layer) at batch 1, 8 and 32: eager, a
  hand-written graph per batch, ``tr.graph(sizes=[1, 8, 32])`` with the ranks' agreement (on when
  there is more than one rank), and the same with ``RankConfig(check=False)``.
- ``agree_cost``: the exchange alone, between ranks sharing one GPU (gloo group): a small MLP
  under ``tr.graph(sizes=)`` with ``sync_sizes=True`` against the same without agreement.
- ``ddp_train``: a DDP training step (built-in MLP, or ResNet-50) at per-GPU batch 8: eager DDP
  against ``tr.graph_step`` (AdamW capturable and fused).
Every rank times the same methods in the same order (``time_interleaved``), so the collectives of
one rank's calls pair with the other's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import torchreplay as tr
from torchreplay.bench.timing import BenchOptions, handwritten_graph, time_interleaved
from torchreplay.config import RankConfig

__all__ = ["tp_mlp", "agree_cost", "ddp_train"]

LAYERS, DIM, HIDDEN = 8, 1024, 4096


def _opts(repeats: int, calls: int) -> BenchOptions:
    return BenchOptions(repeats=repeats, calls=calls, warmup=10, host_calls=10, compile=False)


def tp_mlp(rank: int, world: int, repeats: int = 9, calls: int = 50) -> dict[str, Any]:
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(0)
    shard = HIDDEN // world
    weights = []
    for _ in range(LAYERS):
        a = torch.randn(shard, DIM, device=dev, dtype=torch.bfloat16, generator=g) / DIM**0.5
        b = torch.randn(DIM, shard, device=dev, dtype=torch.bfloat16, generator=g) / HIDDEN**0.5
        weights.append((a, b))

    def step(x: torch.Tensor) -> torch.Tensor:
        for a, b in weights:
            y = F.gelu(x @ a.t()) @ b.t()
            dist.all_reduce(y)
            x = x + y
        return x

    sizes = [1, 8, 32]
    sample = torch.randn(32, DIM, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        checked = tr.graph(step, sample, sizes=sizes)
        unchecked = tr.graph(step, sample, sizes=sizes, ranks=RankConfig(check=False))
    out: dict[str, Any] = {"agreement": repr(checked._ranks), "world": world}
    for batch in sizes:
        x = torch.randn(batch, DIM, device=dev, dtype=torch.bfloat16)
        with torch.no_grad():
            hand = handwritten_graph(step, (x,), {})
            calls_ = {
                "eager": lambda: step(x),
                "hand-written graph": hand,
                "tr.graph(sizes=)": lambda: checked(x),
                "tr.graph(sizes=), check=False": lambda: unchecked(x),
            }
            out[f"b{batch}"] = time_interleaved(calls_, _opts(repeats, calls))
    if checked._ranks is not None:
        out["exchange"] = _exchange_cost(checked._ranks)
    return out


def _exchange_cost(agreement: Any) -> dict[str, tuple[float, float]]:
    """What agreeing on a size costs one call on the host, alone (every rank calls the same
    number of times, so the calls pair up): our agreement, and the alternatives a serving
    engine uses (vLLM's data-parallel padding all-reduces the ranks' sizes over a gloo group;
    over NCCL it needs a GPU tensor and a sync to read the result). Median and minimum us per
    call over loops of many calls, so the ranks' skew at a loop's start is spread thin."""
    from torchreplay.bench.timing import host_loop_us
    from torchreplay.distributed.agree import GRAPH

    gloo = dist.new_group(backend="gloo")
    on_cpu = torch.zeros(1, dtype=torch.int64)
    on_gpu = torch.zeros(1, dtype=torch.int64, device="cuda")

    def gloo_max() -> None:
        on_cpu[0] = 8
        dist.all_reduce(on_cpu, op=dist.ReduceOp.MAX, group=gloo)

    def nccl_max() -> None:
        on_gpu.fill_(8)
        dist.all_reduce(on_gpu, op=dist.ReduceOp.MAX)
        on_gpu.item()

    out = {
        "tr agreement (sync_sizes)": host_loop_us(lambda: agreement(8, GRAPH), n=2000),
        "all_reduce of the size, gloo": host_loop_us(gloo_max, n=200, samples=9),
        "all_reduce of the size, NCCL + .item()": host_loop_us(nccl_max, n=200, samples=9),
    }
    dist.destroy_process_group(gloo)
    return out


def agree_cost(rank: int, world: int, repeats: int = 9, calls: int = 200) -> dict[str, Any]:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256)).to(dev).eval()
    sample = torch.randn(8, 256, device=dev)
    with torch.no_grad():
        synced = tr.graph(model, sample, sizes=[1, 2, 4, 8], sync_sizes=True)
        alone = tr.graph(model, sample, sizes=[1, 2, 4, 8])
    x = torch.randn(4 + rank, 256, device=dev)
    with torch.no_grad():
        res = time_interleaved(
            {"agreed (sync_sizes)": lambda: synced(x), "no agreement": lambda: alone(x)},
            _opts(repeats, calls),
        )
    return {"agreement": repr(synced._ranks), "times": res}


def ddp_train(rank: int, world: int, model_name: str = "mlp", repeats: int = 5,
              calls: int = 20) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torchreplay.models import MLPConfig, build_mlp, resnet50

    dev = torch.device("cuda", torch.cuda.current_device())
    batch = 8

    def build(graphed: bool) -> tuple[Any, Any]:
        if model_name == "mlp":
            model = build_mlp(MLPConfig(), dev)
        else:
            model = resnet50(dev).train()
        if graphed:
            with tr.capture_stream(dev):
                ddp = DDP(model, device_ids=[dev.index])
        else:
            ddp = DDP(model, device_ids=[dev.index])
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, capturable=True, fused=True)
        return ddp, opt

    if model_name == "mlp":
        x = torch.randn(batch, 512, device=dev)
        target = torch.randn(batch, 512, device=dev)
        loss_fn = F.mse_loss
    else:
        x = torch.randn(batch, 3, 224, 224, device=dev)
        target = torch.randint(0, 1000, (batch,), device=dev)
        loss_fn = F.cross_entropy

    def make_step(ddp: Any, opt: Any) -> Any:
        def train_step(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=False)
            loss = loss_fn(ddp(x), target)
            loss.backward()
            opt.step()
            return loss.detach()

        return train_step

    eager_ddp, eager_opt = build(False)
    eager = make_step(eager_ddp, eager_opt)
    g_ddp, g_opt = build(True)
    graphed = tr.graph_step(make_step(g_ddp, g_opt), x, target)
    res = time_interleaved(
        {"eager DDP": lambda: eager(x, target), "tr.graph_step": lambda: graphed(x, target)},
        _opts(repeats, calls),
    )
    return {"model": model_name, "batch": batch, "times": res}
