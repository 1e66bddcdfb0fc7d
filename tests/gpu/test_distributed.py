"""Collectives in graphs, on real ranks (spawned processes, each test bounded by a timeout).

- NCCL on every GPU there is (2 ranks on 2 GPUs; on a 1-GPU machine the same tests run one rank,
  which still captures NCCL kernels and DDP's bucketed all-reduce):
  a tensor-parallel MLP (column- then row-parallel linear, all_reduce) under
  ``tr.graph(sizes=)`` with a different local batch per rank equals the one-GPU reference at
  every size and every rank replays the same padded size; a DDP ``graph_step`` equals eager DDP
  for 20 steps; graphs, pools and the process group torn down in three orders exit cleanly.
- 2 ranks sharing GPU 0 (gloo group, graphs without collectives, ``sync_sizes=True``): the
  agreement around real replays: synced sizes, a rank above the largest size (every rank runs
  eagerly), ranks that captured different size lists, and a rank that skips a call all raise on
  every rank or agree; nothing hangs.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import torchreplay as tr
from torchreplay.config import RankConfig
from ranks import run_ranks

NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLD = min(2, NGPU)
SIZES = [1, 2, 4, 8, 16, 32]
D, H = 256, 1024


def _tp_weights(dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=dev).manual_seed(0)  # the same full weights on every rank
    w1 = torch.randn(H, D, device=dev, generator=g) / D**0.5
    w2 = torch.randn(D, H, device=dev, generator=g) / H**0.5
    return w1, w2


def _tp_shards(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shards of the MLP: ``w1``'s rows (column-parallel), ``w2``'s columns
    (row-parallel), on its own GPU."""
    w1, w2 = _tp_weights(torch.device("cuda", rank))
    shard = H // world
    return (w1[rank * shard:(rank + 1) * shard].contiguous(),
            w2[:, rank * shard:(rank + 1) * shard].contiguous())


def _tp_mlp(rank: int, world: int):
    """This rank's part of the TP MLP: its shards, and an ``all_reduce`` of the partial sums."""
    a, b = _tp_shards(rank, world)

    def tp_mlp(x: torch.Tensor) -> torch.Tensor:
        y = F.gelu(x @ a.t()) @ b.t()
        dist.all_reduce(y)
        return y

    return tp_mlp


def _tp_rows(base: int, i: int, rank: int, top: int = 32) -> int:
    """Rank ``rank``'s rows at call ``i``: ranks differ at every other call and above ``top``."""
    return max(1, base - 2 * rank) if i % 2 or base > top else base


def _tp_reference(x: torch.Tensor, common: int, rank: int, world: int) -> torch.Tensor:
    """What the TP MLP gives ``x``: the one-GPU reference in the ``common`` rows every rank has.
    A row only this rank has gets this rank's part alone: the other ranks' padding rows are
    zeros, which add nothing to the all_reduce (tensor parallelism needs every row on every
    rank; ranks with other rows are what ``sync_sizes`` keeps from hanging, not a TP layout)."""
    w1, w2 = _tp_weights(x.device)
    ref = F.gelu(x @ w1.t()) @ w2.t()
    if x.shape[0] > common:
        a, b = _tp_shards(rank, world)
        ref[common:] = F.gelu(x[common:] @ a.t()) @ b.t()
    return ref


def w_tp_mlp(rank: int, world: int) -> dict:
    dev = torch.device("cuda", rank)
    tp_mlp = _tp_mlp(rank, world)
    g = tr.graph(tp_mlp, torch.randn(SIZES[-1], D, device=dev), sizes=SIZES)
    gen = torch.Generator(device=dev).manual_seed(100)  # the same rows on every rank (TP)
    worst = 0.0
    batches = [1, 3, 5, 8, 13, 16, 17, 31, 32, 2] * 3 + [40]  # 40 and 38: above 32, eager
    padded = []
    for i, base in enumerate(batches):
        n = _tp_rows(base, i, rank)
        x = torch.randn(base, D, device=dev, generator=gen)[:n]
        y = g(x)
        ref = _tp_reference(x, min(_tp_rows(base, i, r) for r in range(world)), rank, world)
        assert y.shape == ref.shape
        worst = max(worst, ((y - ref).abs().max() / ref.abs().max()).item())
        padded.append(g.stats.size_hits.copy())
    return {
        "worst": worst,
        "hits": padded,
        "fallbacks": g.stats.fallbacks,
        "above_rows": y.shape[0],
        "collectives": [c.op for c in g.collectives],
        "agrees": g._ranks is not None,
        "explain": tr.explain(g),
    }


@pytest.mark.skipif(NGPU < 1, reason="needs CUDA")
def test_tensor_parallel_mlp_with_sizes_equals_the_one_gpu_reference() -> None:
    out = run_ranks(w_tp_mlp, WORLD, backend="nccl", timeout=240)
    assert all(s == "ok" for s, _ in out), out
    results = [v for _, v in out]
    for r in results:
        assert r["worst"] < 1e-4, r["worst"]
        assert r["collectives"] == ["allreduce_"]
        assert r["fallbacks"] == 1 and r["above_rows"] in (40, 38)  # the rank's own rows
        assert r["agrees"] == (WORLD > 1)
        assert "collectives: allreduce_(" in r["explain"] and "ranks: " in r["explain"], r["explain"]
    # Every rank replayed the same padded size at every call.
    assert all(r["hits"] == results[0]["hits"] for r in results)


def _mlp(dev: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(D, H), torch.nn.GELU(), torch.nn.Linear(H, D)
    ).to(dev).eval()


def _drive(g, ref, plan: list, rank: int, hits, gen=None) -> dict:
    """Call ``g`` with this rank's rows of each pair of ``plan`` (``None``: this rank skips the
    call) against ``ref``: the worst difference, ``hits()`` after each call, and the error that
    stopped the run, if any."""
    dev = torch.device("cuda", 0)
    worst, seen, errors = 0.0, [], []
    for pair in plan:
        if pair[rank] is None:
            continue
        x = torch.randn(pair[rank], D, device=dev, generator=gen)
        try:
            with torch.no_grad():
                y = g(x)
        except tr.ReplayInputError as exc:
            errors.append(str(exc))
            break
        with torch.no_grad():
            worst = max(worst, (y - ref(x)).abs().max().item())
        seen.append(hits())
    return {"worst": worst, "hits": seen, "errors": errors}


def w_shared_gpu(rank: int, world: int, case: str) -> dict:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(0)
    model = _mlp(dev)
    sizes = [1, 2, 4, 8] if not (case == "sizes" and rank == 1) else [1, 4, 8]
    g = tr.graph(model, torch.randn(8, D, device=dev), sizes=sizes, sync_sizes=True,
                 ranks=RankConfig(timeout=5.0))
    gen = torch.Generator(device=dev).manual_seed(7 + rank)
    plan = {"sync": [(1, 3), (2, 2), (5, 1), (8, 7), (3, 4)] * 4,
            "above": [(2, 3), (4, 12), (1, 1)],
            "sizes": [(2, 2)],
            "skip": [(1, 1), (1, None), (1, 1), (1, 1)]}[case]
    out = _drive(g, model, plan, rank, lambda: dict(g.stats.size_hits), gen)
    return {**out, "fallbacks": g.stats.fallbacks}


@pytest.mark.skipif(NGPU < 1, reason="needs CUDA")
def test_ranks_replay_the_same_padded_size() -> None:
    out = run_ranks(w_shared_gpu, 2, "sync", timeout=240)
    assert all(s == "ok" for s, _ in out), out
    r0, r1 = out[0][1], out[1][1]
    assert r0["errors"] == [] and r1["errors"] == []
    assert r0["worst"] < 1e-4 and r1["worst"] < 1e-4
    assert r0["hits"] == r1["hits"]  # the same size, call by call
    # (1, 3) -> both replay 4; (5, 1) -> both 8
    assert r0["hits"][0][4] == 1 and r0["hits"][2][8] == 1


@pytest.mark.skipif(NGPU < 1, reason="needs CUDA")
def test_one_rank_above_the_largest_size_makes_every_rank_run_eagerly() -> None:
    out = run_ranks(w_shared_gpu, 2, "above", timeout=240)
    assert all(s == "ok" for s, _ in out), out
    for _, r in out:
        assert r["errors"] == [] and r["fallbacks"] == 1 and r["worst"] < 1e-4


@pytest.mark.skipif(NGPU < 1, reason="needs CUDA")
def test_ranks_that_captured_different_sizes_raise_on_every_rank() -> None:
    out = run_ranks(w_shared_gpu, 2, "sizes", timeout=240)
    assert all(s == "ok" for s, _ in out), out
    for _, r in out:
        assert len(r["errors"]) == 1 and "captured different graphs" in r["errors"][0], r


@pytest.mark.skipif(NGPU < 1, reason="needs CUDA")
def test_a_rank_that_skips_a_call_makes_every_caller_raise_not_hang() -> None:
    out = run_ranks(w_shared_gpu, 2, "skip", timeout=120)
    assert all(s == "ok" for s, _ in out), out
    r0, r1 = out[0][1], out[1][1]
    # rank 0 waits at its 4th call for rank 1, which made only 3: it raises after 5 s.
    assert len(r0["errors"]) == 1 and "for rank(s) [1]" in r0["errors"][0], r0
    assert r1["errors"] == [] and len(r1["hits"]) == 3  # its three calls were answered


def w_ddp(rank: int, world: int, steps: int, on_stream: bool = True) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = torch.device("cuda", rank)

    def make(graphed: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(),
            torch.nn.Linear(256, 8),
        ).to(dev)
        if graphed and on_stream:  # DDP keeps its gradient accumulators from construction
            with tr.capture_stream(dev):
                ddp = DDP(model, device_ids=[rank])
        else:
            ddp = DDP(model, device_ids=[rank])
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, capturable=True)
        return ddp, opt

    ddp, opt = make(True)
    ref, ref_opt = make(False)

    def step(model, optimizer, x, y):
        optimizer.zero_grad(set_to_none=False)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    gen = torch.Generator(device=dev).manual_seed(11 + rank)
    x0, y0 = torch.randn(8, 64, device=dev, generator=gen), torch.randn(8, 8, device=dev, generator=gen)
    try:
        graphed = tr.graph_step(lambda x, y: step(ddp, opt, x, y), x0, y0)
    except tr.CaptureError as exc:
        if on_stream:
            raise
        return {"error": str(exc)}
    worst_loss = 0.0
    for _ in range(steps):
        x = torch.randn(8, 64, device=dev, generator=gen)
        y = torch.randn(8, 8, device=dev, generator=gen)
        loss = graphed(x, y).clone()
        ref_loss = step(ref, ref_opt, x, y)
        worst_loss = max(worst_loss, (loss - ref_loss).abs().item())
    worst_param = max(
        (p - q).abs().max().item() for p, q in zip(ddp.parameters(), ref.parameters())
    )
    flat = torch.cat([p.detach().flatten() for p in ddp.parameters()]).cpu()
    return {
        "loss": worst_loss,
        "param": worst_param,
        "flat": flat,
        "replays": graphed.stats.replays,
        "collectives": len(graphed.collectives),
    }


@pytest.mark.skipif(NGPU < 1, reason="needs CUDA")
def test_ddp_graph_step_equals_eager_ddp() -> None:
    out = run_ranks(w_ddp, WORLD, 20, backend="nccl", timeout=300)
    assert all(s == "ok" for s, _ in out), out
    for _, r in out:
        assert r["replays"] == 20 and r["collectives"] >= 1
        assert r["loss"] < 1e-5 and r["param"] < 1e-5, r
    # DDP keeps the parameters identical across ranks; so must the graph.
    assert all(torch.equal(r["flat"], out[0][1]["flat"]) for _, r in out)


@pytest.mark.skipif(NGPU < 1, reason="needs CUDA")
def test_ddp_built_on_the_default_stream_gets_the_fix_named() -> None:
    out = run_ranks(w_ddp, WORLD, 1, False, backend="nccl", timeout=300)
    assert all(s == "ok" for s, _ in out), out
    for _, r in out:
        assert "with tr.capture_stream()" in r["error"], r


_KEEP: list = []


def _doubled_sum(t: torch.Tensor) -> torch.Tensor:
    """Twice ``t``, summed over the ranks (one all_reduce)."""
    y = t * 2
    dist.all_reduce(y)
    return y


def w_teardown(rank: int, world: int, order: str) -> str:
    import os

    dev = torch.device("cuda", rank)
    x = torch.randn(4, D, device=dev)
    f = _doubled_sum
    g = tr.graph(f, x, sizes=[1, 2, 4])
    small = tr.graph(f, x)
    for _ in range(3):
        g(x)
        small(x)
    torch.cuda.synchronize()
    if order == "graphs first":
        del g, small
        gc.collect()
        dist.destroy_process_group()
    elif order == "group first":
        dist.destroy_process_group()
        del g, small
        gc.collect()
    else:  # both alive at interpreter exit
        _KEEP.extend([g, small])
        os.environ["TR_KEEP_GROUP"] = "1"
    return order


@pytest.mark.skipif(NGPU < 1, reason="needs CUDA")
@pytest.mark.parametrize("order", ["graphs first", "group first", "at exit"])
def test_teardown_in_any_order_exits_cleanly(order: str, tmp_path) -> None:
    """Exit code 0 on every rank, and no word of leaked resources where the program destroyed
    its group (kept alive to the exit, the group is the program's to destroy: torch warns
    then that ``destroy_process_group()`` was not called, which is right)."""
    exits: list = []
    out = run_ranks(w_teardown, WORLD, order, backend="nccl", timeout=180, exits=exits,
                    stderr_dir=str(tmp_path))
    assert all(s == "ok" for s, _ in out), out
    assert exits == [0] * WORLD, exits
    for r in range(WORLD):
        err = (tmp_path / f"rank{r}.err").read_text()
        assert "Traceback" not in err and "illegal" not in err.lower(), err
        if order != "at exit":
            assert "leak" not in err.lower(), err


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's row-parallel output: all_reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g


class _CopyToTP(torch.autograd.Function):
    """Megatron's column-parallel input: identity forward, all_reduce backward."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        g = g.clone()
        dist.all_reduce(g)
        return g


class _TPBlock(torch.nn.Module):
    def __init__(self, rank: int, world: int, dev: torch.device) -> None:
        super().__init__()
        a, b = _tp_shards(rank, world)
        self.a = torch.nn.Parameter(a.to(dev))
        self.b = torch.nn.Parameter(b.to(dev))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToTP.apply(x)
        return _ReduceFromTP.apply(F.gelu(x @ self.a.t()) @ self.b.t())


def w_mgc(rank: int, world: int) -> dict:
    import copy

    dev = torch.device("cuda", rank)
    block = _TPBlock(rank, world, dev)
    ref = copy.deepcopy(block)
    x0 = torch.randn(8, D, device=dev, requires_grad=True)
    graphed = tr.make_graphed_callables(block, (x0,))
    gen = torch.Generator(device=dev).manual_seed(3)  # the same inputs on every rank (TP)
    worst = 0.0
    for _ in range(10):
        x = torch.randn(8, D, device=dev, generator=gen)
        xg, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        yg, yr = graphed(xg), ref(xr)
        g = torch.randn_like(yr)
        yg.backward(g)
        yr.backward(g)
        for a, b in [(yg, yr), (xg.grad, xr.grad), (block.a.grad, ref.a.grad),
                     (block.b.grad, ref.b.grad)]:
            worst = max(worst, (a - b).abs().max().item())
        for p in [*block.parameters(), *ref.parameters()]:
            p.grad = None
    runner = graphed.forward  # a module comes back with its forward graphed, as torch's does
    return {"worst": worst, "collectives": [c.op for c in runner.collectives],
            "agrees": runner._ranks is not None}


@pytest.mark.skipif(NGPU < 1, reason="needs CUDA")
def test_make_graphed_callables_with_collectives_in_forward_and_backward() -> None:
    out = run_ranks(w_mgc, WORLD, backend="nccl", timeout=240)
    assert all(s == "ok" for s, _ in out), out
    for _, r in out:
        assert r["worst"] < 1e-4, r
        assert r["collectives"] == ["allreduce_", "allreduce_"]  # forward's, then backward's
        assert r["agrees"] == (WORLD > 1)


def w_functional(rank: int, world: int) -> dict:
    import torch.distributed._functional_collectives as fc

    dev = torch.device("cuda", rank)

    def f(x):
        y = fc.all_reduce(x * (rank + 1), "sum", dist.group.WORLD)
        return fc.wait_tensor(y) + 1

    g = tr.graph(f, torch.randn(16, device=dev))
    worst = 0.0
    for i in range(20):
        x = torch.randn(16, device=dev, generator=torch.Generator(device=dev).manual_seed(i))
        worst = max(worst, (g(x) - f(x)).abs().max().item())
    return {"worst": worst, "collectives": [c.op for c in g.collectives]}


@pytest.mark.skipif(NGPU < 1, reason="needs CUDA")
def test_functional_collectives_in_a_graph() -> None:
    out = run_ranks(w_functional, WORLD, backend="nccl", timeout=240)
    assert all(s == "ok" for s, _ in out), out
    for _, r in out:
        assert r["worst"] < 1e-5 and r["collectives"] == ["all_reduce"], r


def w_every_collective(rank: int, world: int) -> dict:
    """all_reduce, all_gather_into_tensor, reduce_scatter_tensor and broadcast in one graph,
    each rank with inputs of its own (so the gathered and broadcast values differ by rank)."""
    dev = torch.device("cuda", rank)
    n = 16

    def f(x: torch.Tensor):
        summed = x * 2
        dist.all_reduce(summed)
        gathered = torch.empty(world * n, device=dev)
        dist.all_gather_into_tensor(gathered, x)
        scattered = torch.empty(n, device=dev)
        dist.reduce_scatter_tensor(scattered, gathered.sin())
        root = x + 1
        dist.broadcast(root, src=0)
        return summed, gathered, scattered, root

    g = tr.graph(f, torch.randn(n, device=dev))
    worst = 0.0
    for i in range(20):
        gen = torch.Generator(device=dev).manual_seed(100 * i + rank)
        x = torch.randn(n, device=dev, generator=gen)
        got = [t.clone() for t in g(x)]
        for a, b in zip(got, f(x)):
            worst = max(worst, (a - b).abs().max().item())
    return {"worst": worst, "collectives": [c.op for c in g.collectives]}


@pytest.mark.skipif(NGPU < 1, reason="needs CUDA")
def test_every_collective_kind_in_a_graph_equals_eager() -> None:
    out = run_ranks(w_every_collective, WORLD, backend="nccl", timeout=240)
    assert all(s == "ok" for s, _ in out), out
    for _, r in out:
        assert r["worst"] < 1e-5, r
        ops = r["collectives"]
        assert len(ops) == 4, r
        for want, op in zip(("allreduce", "allgather", "reduce_scatter", "broadcast"), ops):
            assert want in op, r


class _GatherSP(torch.autograd.Function):
    """Sequence parallelism: all_gather the rows forward, reduce_scatter the gradient back."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        world = dist.get_world_size()
        out = x.new_empty(world * x.shape[0], *x.shape[1:])
        dist.all_gather_into_tensor(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        world = dist.get_world_size()
        out = g.new_empty(g.shape[0] // world, *g.shape[1:])
        dist.reduce_scatter_tensor(out, g.contiguous())
        return out


class _SPBlock(torch.nn.Module):
    def __init__(self, dev: torch.device) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights on every rank
        self.lin = torch.nn.Linear(D, D).to(dev)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(_GatherSP.apply(x)).tanh()


def w_mgc_gather(rank: int, world: int) -> dict:
    import copy

    dev = torch.device("cuda", rank)
    graphed = _SPBlock(dev)
    eager = copy.deepcopy(graphed)
    lin, ref = graphed.lin, eager.lin
    x0 = torch.randn(4, D, device=dev, requires_grad=True)
    tr.make_graphed_callables(graphed, (x0,))
    worst = 0.0
    for i in range(10):
        gen = torch.Generator(device=dev).manual_seed(10 * i + rank)  # rows of its own
        x = torch.randn(4, D, device=dev, generator=gen)
        xg, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        yg, yr = graphed(xg), eager(xr)
        gout = torch.randn(yr.shape, device=dev, generator=gen)
        yg.backward(gout)
        yr.backward(gout)
        for a, b in [(yg, yr), (xg.grad, xr.grad), (lin.weight.grad, ref.weight.grad)]:
            worst = max(worst, (a - b).abs().max().item())
        for p in [*lin.parameters(), *ref.parameters()]:
            p.grad = None
    return {"worst": worst, "collectives": [c.op for c in graphed.forward.collectives]}


@pytest.mark.skipif(NGPU < 1, reason="needs CUDA")
def test_make_graphed_callables_with_all_gather_forward_and_reduce_scatter_backward() -> None:
    out = run_ranks(w_mgc_gather, WORLD, backend="nccl", timeout=240)
    assert all(s == "ok" for s, _ in out), out
    for _, r in out:
        assert r["worst"] < 1e-4, r
        ops = r["collectives"]
        assert any("allgather" in op for op in ops), r
        assert any("reduce_scatter" in op for op in ops), r


@pytest.mark.skipif(NGPU < 2, reason="needs 2 GPUs")
def test_graphs_on_two_devices_of_one_process() -> None:
    graphs, refs = [], []
    for i in range(2):
        dev = torch.device("cuda", i)
        model = _mlp(dev)
        graphs.append(tr.graph(model, torch.randn(8, D, device=dev), sizes=[2, 8]))
        refs.append(model)
    assert graphs[0].pool is not graphs[1].pool
    for _ in range(10):
        for i in (1, 0):
            x = torch.randn(5, D, device=f"cuda:{i}")
            with torch.no_grad():
                torch.testing.assert_close(graphs[i](x), refs[i](x))


@pytest.mark.skipif(NGPU < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("front", ["graph", "training", "breaks"])
def test_a_graph_on_the_second_gpu_called_with_the_first_current_replays(front: str) -> None:
    """A graph on cuda:1 called while cuda:0 is current (no nn.DataParallel replica calls it)
    replays under its own device, equal to eager, forward and gradients, over fresh inputs."""
    dev = torch.device("cuda", 1)
    model, ref = _mlp(dev), _mlp(dev)
    ref.load_state_dict(model.state_dict())
    x = torch.randn(8, D, device=dev)
    if front == "training":
        g = tr.make_graphed_callables(model, (x,))
    else:
        g = tr.graph(model, x, breaks=[model[1]] if front == "breaks" else None)
    torch.cuda.set_device(0)
    for _ in range(6):
        x = torch.randn(8, D, device=dev)
        with torch.set_grad_enabled(front == "training"):
            got, want = g(x), ref(x)
        torch.testing.assert_close(got, want)
        if front == "training":
            got.square().mean().backward()
            want.square().mean().backward()
            for a, b in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(a.grad, b.grad)
                a.grad = b.grad = None
        assert torch.cuda.current_device() == 0
    assert g.forward.stats.replays == 6 if front == "training" else g.stats.replays == 6


def _host_scale(y: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A break: reads host values (cannot be captured), returns a new tensor."""
    return y * (1.0 + float(lengths.sum()) / 100.0)


def w_breaks(rank: int, world: int) -> dict:
    dev = torch.device("cuda", rank)
    a, b = _tp_shards(rank, world)

    def f(x, lengths):
        y = F.gelu(x @ a.t()) @ b.t()
        dist.all_reduce(y)  # in the first segment
        y = _host_scale(y, lengths)
        z = F.gelu(y @ a.t()) @ b.t()
        dist.all_reduce(z)  # in the second
        return z

    lengths = torch.tensor([3, 4])
    g = tr.graph(f, torch.randn(8, D, device=dev), lengths, breaks=[_host_scale])
    worst = 0.0
    for i in range(10):
        x = torch.randn(8, D, device=dev)
        lens = torch.randint(0, 50, (2,))
        worst = max(worst, ((g(x, lens) - f(x, lens)).abs().max()).item())
    return {"worst": worst}


@pytest.mark.skipif(NGPU < 1, reason="needs CUDA")
def test_breakable_graph_with_a_collective_in_each_segment() -> None:
    out = run_ranks(w_breaks, WORLD, backend="nccl", timeout=240)
    assert all(s == "ok" for s, _ in out), out
    assert all(r["worst"] < 1e-3 for _, r in out), out


def _host_gelu(y: torch.Tensor) -> torch.Tensor:
    """A break (runs eagerly between the two segments)."""
    return F.gelu(y)


def w_breaks_sizes(rank: int, world: int) -> dict:
    """The TP MLP with a break after its all_reduce, under ``sizes=``: ranks with other rows
    replay one padded size, and above the largest size every rank runs the call eagerly at the
    rows of the largest call (an all_reduce of one shape on every rank, not a hang)."""
    dev = torch.device("cuda", rank)
    a, b = _tp_shards(rank, world)

    def f(x):
        y = F.gelu(x @ a.t()) @ b.t()
        dist.all_reduce(y)
        return _host_gelu(y)

    g = tr.graph(f, torch.randn(8, D, device=dev), sizes=[2, 4, 8], breaks=[_host_gelu])
    gen = torch.Generator(device=dev).manual_seed(100)  # the same rows on every rank (TP)
    worst, rows = 0.0, []
    for i, base in enumerate([3, 8, 5, 12, 2, 7]):  # 12 and 10 rows: above 8
        n = _tp_rows(base, i, rank, top=8)
        x = torch.randn(base, D, device=dev, generator=gen)[:n]
        y = g(x)
        common = min(_tp_rows(base, i, r, top=8) for r in range(world))
        ref = F.gelu(_tp_reference(x, common, rank, world))
        worst = max(worst, ((y - ref).abs().max() / ref.abs().max()).item())
        rows.append(y.shape[0] == n)
    return {"worst": worst, "rows": all(rows), "fallbacks": g.stats.fallbacks,
            "agrees": g._ranks is not None}


@pytest.mark.skipif(NGPU < 1, reason="needs CUDA")
def test_breakable_graph_with_sizes_and_a_collective_pads_every_rank_alike() -> None:
    out = run_ranks(w_breaks_sizes, WORLD, backend="nccl", timeout=240)
    assert all(s == "ok" for s, _ in out), out
    for _, r in out:
        assert r["worst"] < 1e-4 and r["rows"] and r["fallbacks"] == 1, r
        assert r["agrees"] == (WORLD > 1), r


def w_shared_breaks(rank: int, world: int, case: str) -> dict:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(0)
    model = _mlp(dev)

    def f(x):
        return model[2](_host_gelu(model[0](x)))

    sizes = [2, 8] if case == "sizes" and rank == 1 else [2, 4, 8]
    g = tr.graph(f, torch.randn(8, D, device=dev), sizes=sizes, breaks=[_host_gelu],
                 sync_sizes=True, ranks=RankConfig(timeout=5.0))
    plan = {"sync": [(1, 3), (2, 2), (5, 1), (3, 4)] * 3, "above": [(2, 9)], "sizes": [(2, 2)]}[case]
    out = _drive(g, f, plan, rank, lambda: dict(g.stats.size_hits))
    before: dict = {}
    seen = []  # the size each call replayed
    for now in out["hits"]:
        seen.append([s for s in now if now[s] != before.get(s, 0)])
        before = now
    return {**out, "seen": seen, "fallbacks": g.stats.fallbacks}


@pytest.mark.skipif(NGPU < 1, reason="needs CUDA")
@pytest.mark.parametrize("case", ["sync", "above", "sizes"])
def test_breakable_graph_ranks_agree(case: str) -> None:
    out = run_ranks(w_shared_breaks, 2, case, timeout=240)
    assert all(s == "ok" for s, _ in out), out
    (_, r0), (_, r1) = out
    if case == "sync":
        assert r0["errors"] == [] == r1["errors"] and r0["worst"] < 1e-4 and r1["worst"] < 1e-4
        assert r0["seen"] == r1["seen"] == [[4], [2], [8], [4]] * 3
    elif case == "above":
        assert r0["errors"] == [] == r1["errors"] and r0["fallbacks"] == r1["fallbacks"] == 1
        assert r0["worst"] < 1e-4
    else:
        for r in (r0, r1):
            assert len(r["errors"]) == 1 and "captured different graphs" in r["errors"][0], r


_HANG = """
import os, sys, time, torch
sys.path.insert(0, {root!r})
import torch.distributed as dist
import torchreplay as tr
from torchreplay.distributed import GRAPH, Agreement, _cuda_marker
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT={port!r})
dist.init_process_group("gloo", rank=0, world_size=1)
x = torch.randn(4096, device="cuda")
g = tr.graph(lambda t: t * 2 + 1, x)
a = Agreement(dist.group.WORLD, "stuck", 7, sync_sizes=False, timeout=1.0,
              marker=_cuda_marker(torch.cuda.current_stream()))
end = time.monotonic() + 3  # no false alarm: 3 s of agreed replays whose work finishes
while time.monotonic() < end:
    a(4, GRAPH)
    x = torch.randn(4096, device="cuda")
    torch.testing.assert_close(g(x), x * 2 + 1)
print("no false alarm", flush=True)
a(4, GRAPH)
start = time.monotonic()
torch.cuda._sleep(int(40e9))  # ~20 s of GPU work after an agreed call: a collective that waits
torch.cuda.synchronize()  # the main thread blocks here; the watcher ends the process first
print(f"not ended: synchronized after {{time.monotonic() - start:.1f}} s", flush=True)
"""


@pytest.mark.skipif(NGPU < 1, reason="needs CUDA")
def test_gpu_work_that_never_finishes_after_an_agreed_call_ends_the_process_naming_it() -> None:
    """The watcher with real CUDA events, while the main thread is blocked in a synchronize:
    the process ends within seconds of the timeout (exit code 3), naming the graph and call;
    replays whose work finishes never trip it."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    from ranks import free_port
    from torchreplay.distributed.watch import HANG_EXIT

    root = str(Path(__file__).resolve().parents[2])
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _HANG.format(root=root, port=str(free_port()))],
                          capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    assert "no false alarm" in proc.stdout, (proc.stdout, proc.stderr[-3000:])
    assert proc.returncode == HANG_EXIT and "not ended" not in proc.stdout, (
        proc.returncode, proc.stdout, proc.stderr[-3000:])
    assert "the GPU work up to call" in proc.stderr and "of 'stuck' has not finished" in proc.stderr
    assert took < 60, took


def w_dies(rank: int, world: int) -> str:
    import os

    dev = torch.device("cuda", rank)
    x = torch.randn(4, D, device=dev, generator=torch.Generator(device=dev).manual_seed(0))
    g = tr.graph(_doubled_sum, x, ranks=RankConfig(timeout=5.0))  # the same x on every rank
    for _ in range(3):
        torch.testing.assert_close(g(x), x * 2 * world)
    torch.cuda.synchronize()
    if rank == 1:  # posts the next call, then dies before its replay
        g._ranks(0, tr.distributed.GRAPH)
        os._exit(0)
    g(x)
    torch.cuda.synchronize()  # waits for rank 1 inside the all_reduce; the watcher ends this
    return "not ended"


@pytest.mark.skipif(NGPU < 2, reason="needs 2 GPUs")
def test_a_rank_that_dies_after_the_agreement_ends_the_others_naming_the_graph() -> None:
    from torchreplay.distributed.watch import HANG_EXIT

    exits: list = []
    out = run_ranks(w_dies, 2, backend="nccl", timeout=90, exits=exits)
    assert out[0][1] != "not ended" and exits[0] == HANG_EXIT, (out, exits)


# -- the torch.compile backend: collectives in compiled pieces, ranks that agree ---------------


def w_compiled_tp(rank: int, world: int) -> dict:
    dev = torch.device("cuda", rank)
    tp_mlp = _tp_mlp(rank, world)
    c = tr.compile(tp_mlp, sizes=SIZES)
    gen = torch.Generator(device=dev).manual_seed(100)  # the same rows on every rank (TP)
    worst, hits, rows = 0.0, [], []
    for i, base in enumerate([32, 1, 3, 5, 8, 13, 16, 17, 31, 2] * 2 + [40]):  # 40: above 32
        n = _tp_rows(base, i, rank)
        x = torch.randn(base, D, device=dev, generator=gen)[:n]
        with torch.no_grad():
            y = c(x)
        ref = _tp_reference(x, min(_tp_rows(base, i, r) for r in range(world)), rank, world)
        worst = max(worst, ((y - ref).abs().max() / ref.abs().max()).item())
        hits.append(dict(c.backend.runtimes[0].stats.size_hits))
        rows.append(y.shape[0] == n)
    (rt,) = c.backend.runtimes
    return {
        "worst": worst,
        "hits": hits,
        "rows": all(rows),
        "replays": rt.stats.replays,
        "fallbacks": rt.stats.fallbacks,
        "agrees": getattr(rt, "agreement", None) is not None,
        "explain": tr.explain(c),
    }


@pytest.mark.skipif(NGPU < 1, reason="needs CUDA")
def test_compiled_tensor_parallel_mlp_with_sizes_equals_the_one_gpu_reference() -> None:
    """``tr.compile(sizes=)`` on a TP MLP whose ``dist.all_reduce`` Dynamo turns into a
    functional collective inside a compiled, captured piece; ranks with different local batches
    replay the same padded size (2 GPUs; with one, the collective runs in the graph alone)."""
    out = run_ranks(w_compiled_tp, WORLD, backend="nccl", timeout=300)
    assert all(s == "ok" for s, _ in out), out
    results = [v for _, v in out]
    for r in results:
        assert r["worst"] < 2e-3, r["worst"]
        assert r["replays"] >= 19 and r["fallbacks"] == 1 and r["rows"], r["explain"]
        assert r["agrees"] == (WORLD > 1), r["explain"]
    assert all(r["hits"] == results[0]["hits"] for r in results)


def w_compiled_shared(rank: int, world: int, case: str) -> dict:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(0)
    model = _mlp(dev)
    sizes = [1, 4, 8] if case == "sizes" and rank == 1 else [1, 2, 4, 8]
    c = tr.compile(model, sizes=sizes, ranks=RankConfig(sync_sizes=True, timeout=20.0))
    gen = torch.Generator(device=dev).manual_seed(7 + rank)
    plan = {"sync": [(1, 3), (2, 2), (5, 1), (8, 7), (3, 4)] * 3,
            "above": [(2, 3), (4, 12), (1, 1)],
            "sizes": [(2, 2)]}[case]
    out = _drive(c, model, plan, rank, lambda: dict(c.backend.runtimes[0].stats.size_hits), gen)
    rt = c.backend.runtimes[0]
    return {**out, "fallbacks": rt.stats.fallbacks, "explain": tr.explain(c)}


@pytest.mark.skipif(NGPU < 1, reason="needs CUDA")
@pytest.mark.parametrize("case", ["sync", "above", "sizes"])
def test_compiled_graphs_of_two_ranks_agree(case: str) -> None:
    """Two ranks sharing GPU 0 (gloo), ``tr.compile(sizes=, ranks=RankConfig(sync_sizes=True))``:
    both replay the size the larger call needs; one rank above the largest size makes both run
    without graphs; other size lists raise on both."""
    out = run_ranks(w_compiled_shared, 2, case, timeout=300)
    assert all(s == "ok" for s, _ in out), out
    r0, r1 = out[0][1], out[1][1]
    if case == "sizes":
        for r in (r0, r1):
            assert len(r["errors"]) == 1 and "captured different graphs" in r["errors"][0], r
        return
    assert r0["errors"] == [] and r1["errors"] == [], (r0, r1)
    assert r0["worst"] < 1e-4 and r1["worst"] < 1e-4
    assert r0["hits"] == r1["hits"], (r0["hits"], r1["hits"])
    assert "ranks: Agreement(" in r0["explain"], r0["explain"]
    if case == "sync":  # (1, 3) -> both replay 4; (5, 1) -> both 8
        assert r0["hits"][0] == {4: 1} and r0["hits"][2][8] == 1, r0["hits"]
    else:
        assert r0["fallbacks"] == r1["fallbacks"] == 1, (r0, r1)


def w_fsdp(rank: int, world: int, reshard: bool, steps: int) -> dict:
    """FSDP2 (``fully_shard`` per block) with each block compiled by ``tr.compile``: the same
    batch on every rank, so the gradients equal one unsharded model's."""
    import copy

    from torch.distributed.fsdp import fully_shard

    from torchreplay.models.blocks import ResidualBlock

    dev = torch.device("cuda", rank)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[ResidualBlock(64) for _ in range(4)]).to(dev)
    model = copy.deepcopy(ref)
    for block in model:
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model)
    blocks = [tr.compile(b) for b in model]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    gen = torch.Generator(device=dev).manual_seed(5)
    worst, captures = 0.0, []
    for _ in range(steps):
        x = torch.randn(8, 64, device=dev, generator=gen)
        h = x
        for b in blocks:
            h = b(h)
        h.square().mean().backward()
        ref(x).square().mean().backward()
        for p, q in zip(ref.parameters(), model.parameters()):
            g = q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad
            worst = max(worst, ((g - p.grad).abs().max() / p.grad.abs().max()).item())
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        runtimes = blocks[0].backend.runtimes
        captures.append(sum(r.stats.captures for r in runtimes))
    reasons: dict[str, int] = {}
    for r in runtimes:
        for why, n in r.fallback_reasons.items():
            reasons[why] = reasons.get(why, 0) + n
    return {
        "worst": worst,
        "captures": captures,
        "replays": sum(r.stats.replays for r in runtimes),
        "reasons": reasons,
    }


@pytest.mark.skipif(NGPU < 1, reason="needs CUDA")
@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp2_blocks_compiled_one_by_one_equal_eager(reshard: bool) -> None:
    """FSDP2 reallocates a block's unsharded parameters around every call (after its forward
    with ``reshard_after_forward=True``, after its backward otherwise). The block's output, the
    next block's input, must stay readable when its graph is dropped (before, a
    StaleOutputError), the gradients equal eager's, and once the parameters are seen to keep
    moving the blocks run without graphs (counted) instead of being captured every step."""
    out = run_ranks(w_fsdp, WORLD, reshard, 12, backend="nccl", timeout=300)
    assert all(s == "ok" for s, _ in out), out
    for _, r in out:
        assert r["worst"] < 3e-3, r
        # no captures in the last 4 of 12 steps: on 2 ranks (H200 x2) the last capture came
        # at step 5 (captures so far 5, 10, 14, 17, 19, 19, 19, 19), one step later than on
        # one rank, so 8 steps with the last 4 checked left the rule too little room
        assert r["captures"][-1] == r["captures"][-5], r
        moving = any("moves to new memory" in why for why in r["reasons"])
        # resharded after every forward, the parameters always move; else, maybe not
        assert moving if reshard else (moving or r["replays"] >= 8 * 4), r


def w_ddp_compiled(rank: int, world: int, regional: bool, steps: int) -> dict:
    """DDP with ``tr.compile``: the whole DDP module (through Dynamo's DDP optimizer, which
    splits a graph at gradient buckets: one here) or each block inside it; the same batch on
    every rank."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    from torchreplay.models.blocks import ResidualBlock

    dev = torch.device("cuda", rank)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[ResidualBlock(64) for _ in range(4)]).to(dev)
    inner = copy.deepcopy(ref)
    if regional:
        from torchreplay.compile.backend import Backend

        backend = Backend()
        for block in inner:
            block.compile(backend=backend)
        model = DDP(inner, device_ids=[rank])
    else:
        model = tr.compile(DDP(inner, device_ids=[rank]))
        backend = model.backend
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, inner)]
    gen = torch.Generator(device=dev).manual_seed(5)
    worst = 0.0
    for _ in range(steps):
        x = torch.randn(8, 64, device=dev, generator=gen)
        model(x).square().mean().backward()
        ref(x).square().mean().backward()
        for p, q in zip(ref.parameters(), inner.parameters()):
            worst = max(worst, ((q.grad - p.grad).abs().max() / p.grad.abs().max()).item())
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    runtimes = backend.runtimes
    return {
        "worst": worst,
        "runtimes": len(runtimes),
        "replays": sum(r.stats.replays for r in runtimes),
        "fallbacks": sum(r.stats.fallbacks for r in runtimes),
        "reasons": [why for r in runtimes for why in r.fallback_reasons],
    }


@pytest.mark.skipif(NGPU < 1, reason="needs CUDA")
@pytest.mark.parametrize("regional", [False, True], ids=["whole", "each block"])
def test_ddp_with_tr_compile_equals_eager(regional: bool) -> None:
    """``tr.compile`` of a DDP model, or of each block inside one, trains like eager DDP: the
    gradients equal eager's at every step, and the forward and backward graphs replay."""
    out = run_ranks(w_ddp_compiled, WORLD, regional, 10, backend="nccl", timeout=300)
    assert all(s == "ok" for s, _ in out), out
    for _, r in out:
        assert r["worst"] < 3e-3, r
        assert r["runtimes"] >= 2 and r["replays"] >= 8 * r["runtimes"], r
        assert r["fallbacks"] == 0, r
