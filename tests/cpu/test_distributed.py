"""distributed/ on the CPU: the collectives a call issues (gloo, one rank), the fingerprint, and
the ranks' agreement across real processes (2 and 3 ranks of a gloo group): sizes synced to the
largest, every kind of disagreement raising on every rank, a rank that does not come making the
others raise within the timeout (never a hang), and both exchanges (shared memory, the store).
The graphs themselves (NCCL in a capture) are in tests/gpu/test_distributed.py."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import torchreplay as tr
from torchreplay import _compat
from torchreplay.config import RankConfig
from torchreplay.distributed import EAGER, GRAPH, Agreement, CollectiveLog, agreement, fingerprint
from torchreplay.distributed import agree as agree_mod
from torchreplay.errors import ReplayInputError, UnsupportedError
from ranks import free_port, run_ranks

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is absent")


@pytest.fixture
def one_rank():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_collective_log_records_each_collective_in_order(one_rank) -> None:
    import torch.distributed._functional_collectives as fc

    x = torch.randn(6)
    out = torch.empty(6)
    with CollectiveLog() as log:
        y = x * 2  # not a collective
        dist.all_reduce(y)
        dist.broadcast(y, 0)
        dist.all_gather_into_tensor(out, x)
        z = fc.all_reduce(x.double(), "sum", dist.group.WORLD)
        fc.wait_tensor(z)
    ops = [c.op for c in log.collectives]
    assert ops == ["allreduce_", "broadcast_", "_allgather_base_", "all_reduce"]
    assert all(c.group == dist.group.WORLD.group_name and c.ranks == (0,) for c in log.collectives)
    assert [c.numel for c in log.collectives] == [6, 6, 6, 6]
    assert log.collectives[3].dtype == "float64"
    assert log.groups[dist.group.WORLD.group_name] is dist.group.WORLD


def test_fingerprint_is_stable_and_tells_captures_apart() -> None:
    a = fingerprint([[("allreduce_", "0", (0, 1), "float32", 1024)], (1, 2, 4)])
    assert a == fingerprint([[("allreduce_", "0", (0, 1), "float32", 1024)], (1, 2, 4)])
    assert a != fingerprint([[("allreduce_", "0", (0, 1), "float32", 2048)], (1, 2, 4)])
    assert a != fingerprint([[("allreduce_", "0", (0, 1), "float32", 1024)], (1, 4)])
    assert a not in (GRAPH, EAGER) and 0 < a < 2**62


def test_no_agreement_without_a_process_group_or_collectives(one_rank) -> None:
    assert agreement(RankConfig(), (), None, name="f") is None  # no collective, nothing asked
    # A group of one rank has nobody to agree with.
    assert agreement(RankConfig(sync_sizes=True), (), None, name="f", sizes=True) is None


def test_sync_sizes_without_a_process_group_is_refused() -> None:
    assert not _compat.dist_ready()
    assert agreement(RankConfig(), (), None, name="f") is None
    with pytest.raises(UnsupportedError, match="init_process_group"):
        agreement(RankConfig(sync_sizes=True), (), None, name="f", sizes=True)


def test_rank_config_and_graph_options_are_checked() -> None:
    with pytest.raises(ValueError, match="timeout"):
        RankConfig(timeout=0)
    with pytest.raises(ValueError, match="on_hang"):
        RankConfig(on_hang="abort")
    with pytest.raises(ValueError, match="sync_sizes"):
        RankConfig(sync_sizes="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs check=True"):
        RankConfig(sync_sizes=True, check=False)
    f = lambda x: x * 2  # noqa: E731
    with pytest.raises(TypeError, match="only apply with sizes"):
        tr.graph(f, torch.zeros(2), sync_sizes=True)
    with pytest.raises(TypeError, match="ranks must be"):
        tr.graph(f, torch.zeros(2), ranks={"check": False})


# -- several ranks ---------------------------------------------------------------------------


def _agree(kind: str, timeout: float = 20.0) -> Agreement:
    if kind == "store":  # what ranks on several hosts use
        orig = agree_mod._map_shared
        agree_mod._map_shared = lambda *a, **k: None
        try:
            return Agreement(dist.group.WORLD, "g", 12345, sync_sizes=True, timeout=timeout)
        finally:
            agree_mod._map_shared = orig
    return Agreement(dist.group.WORLD, "g", 12345, sync_sizes=True, timeout=timeout)


def w_sync(rank: int, world: int, kind: str) -> list:
    a = _agree(kind)
    agreed = [a((rank + 1) * (i + 1) % 7 + rank, GRAPH) for i in range(200)]
    return [a.kind, agreed]


@pytest.mark.parametrize("kind", ["shared memory", "store"])
def test_ranks_agree_on_the_largest_size(kind: str) -> None:
    out = run_ranks(w_sync, 3, kind)
    assert [s for s, _ in out] == ["ok"] * 3, out
    want = [max((r + 1) * (i + 1) % 7 + r for r in range(3)) for i in range(200)]
    for _, (used, agreed) in out:
        assert used == kind
        assert agreed == want


def w_disagree(rank: int, world: int, case: str) -> str:
    fp = 777 if case != "fingerprint" or rank == 0 else 778
    sync = case != "size"
    a = Agreement(dist.group.WORLD, "mlp", fp, sync_sizes=sync, timeout=20.0)
    for _ in range(3 if case != "fingerprint" else 0):
        a(4, GRAPH)  # agreed calls first (different captures disagree from the first call)
    choice = EAGER if case == "eager" and rank == 1 else GRAPH
    size = 8 if case == "size" and rank == 1 else 4
    try:
        a(size, choice)
    except ReplayInputError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("case", ["fingerprint", "eager", "size"])
def test_a_disagreement_raises_on_every_rank_naming_each_choice(case: str) -> None:
    out = run_ranks(w_disagree, 2, case)
    for status, msg in out:
        assert status == "ok", msg
        call = 1 if case == "fingerprint" else 4
        assert f"ranks disagree on what to run at call {call} of 'mlp'" in msg, msg
        assert "rank 0:" in msg and "rank 1:" in msg
    if case == "eager":
        assert "rank 1: eager" in out[0][1]
    if case == "size":
        assert "rank 0: its graph" in out[0][1] or "size 4" in out[0][1]
    if case == "fingerprint":
        assert "captured different graphs" in out[0][1]


def w_skip(rank: int, world: int, kind: str) -> list:
    a = _agree(kind, timeout=3.0)
    got = []
    for i in range(5):
        if rank == 1 and i == 2:
            continue  # this rank skips a call: rank 0 will wait at its 5th
        a(1, GRAPH)
        got.append(i)
    if rank == 0:
        return got
    # rank 1 comes back late, for one more call: it must refuse too, not replay alone
    time.sleep(4.0)
    try:
        a(1, GRAPH)
    except ReplayInputError as exc:
        return [str(exc)]
    return ["no error"]


def w_skip_rank0(rank: int, world: int, kind: str) -> list:
    try:
        return w_skip(rank, world, kind)
    except ReplayInputError as exc:
        return [str(exc)]


def test_a_rank_that_skips_a_call_makes_the_others_raise_within_the_timeout() -> None:
    start = time.monotonic()
    out = run_ranks(w_skip_rank0, 2, "shared memory", timeout=60)
    assert time.monotonic() - start < 40
    (s0, v0), (s1, v1) = out
    assert s0 == "ok" and s1 == "ok", out
    assert "waited 3 s at call 5 for rank(s) [1]" in v0[0], v0
    assert "gave up waiting" in v1[0], v1


def test_store_exchange_times_out_naming_the_missing_rank() -> None:
    out = run_ranks(w_skip_rank0, 2, "store", timeout=60)
    assert out[0][0] == "ok" and "waited 3 s at call 5 for rank(s) [1]" in out[0][1][0], out


class CountingStore:
    """The process group's store, counting every call made to it (a round trip each)."""

    def __init__(self, store: object) -> None:
        self._store = store
        self.calls = 0

    def __getattr__(self, name: str) -> object:
        method = getattr(self._store, name)

        def counted(*args: object, **kwargs: object) -> object:
            self.calls += 1
            return method(*args, **kwargs)

        return counted


def w_store_calls(rank: int, world: int, kind: str = "shared memory", n: int = 200) -> list:
    store = CountingStore(_compat.default_store())
    made = _compat.default_store
    _compat.default_store = lambda: store  # (the agreement asks _compat for it when it is made)
    try:
        a = _agree(kind)
    finally:
        _compat.default_store = made
    built = store.calls
    for _ in range(n):
        a(1, GRAPH)
    return [a.kind, built, store.calls - built]


def test_shared_memory_exchange_makes_no_store_round_trip() -> None:
    # Ranks of one host exchange through the shared mapping: the store is used to set it up,
    # never at a call. The store's exchange, counted the same way, makes at least one call a
    # call (so the count itself is seen to work). (This was a timing comparison; an absolute
    # bound of 100 us failed once on a loaded machine, at 105 us.)
    out = run_ranks(w_store_calls, 2)
    assert all(s == "ok" for s, _ in out), out
    assert [v[0] for _, v in out] == ["shared memory"] * 2, out
    assert all(v[1] > 0 and v[2] == 0 for _, v in out), out  # set up through it, no call after
    store = run_ranks(w_store_calls, 2, "store")
    assert all(s == "ok" for s, _ in store) and [v[0] for _, v in store] == ["store"] * 2, store
    assert all(v[2] >= 200 for _, v in store), store


# -- tr.graph(sizes=) with agreeing ranks, the graphs emulated on the CPU (test_buckets.py) ----


def w_bucketed(rank: int, world: int, case: str) -> dict:
    import test_buckets

    test_buckets.install_cpu_graphs(setattr)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).eval()
    sizes = [1, 4, 8] if case == "sizes" and rank == 1 else [1, 2, 4, 8]
    g = tr.graph(model, torch.randn(8, 4), sizes=sizes, sync_sizes=True,
                 ranks=RankConfig(timeout=5.0))
    calls = {"sync": [(1, 3), (2, 2), (5, 1), (0, 2), (3, 4), (1, 3)],
             "above": [(2, 3), (3, 9)],
             "mode": [(2, 2), (2, 2)],
             "sizes": [(2, 2)]}[case]
    seen, errors, before = [], [], {}
    for i, pair in enumerate(calls):
        if case == "mode" and rank == 1 and i == 1:
            model.train()  # this rank would fall back eagerly, the other replay
        x = torch.randn(pair[rank], 4)
        try:
            with torch.no_grad():
                y = g(x)
        except ReplayInputError as exc:
            errors.append(str(exc))
            break
        with torch.no_grad():
            torch.testing.assert_close(y, model(x))
        now = dict(g.stats.size_hits)
        seen.append([s for s in now if now[s] != before.get(s, 0)])  # the size this call ran
        before = now
    return {"seen": seen, "errors": errors, "fallbacks": g.stats.fallbacks}


def test_bucketed_ranks_replay_the_size_of_the_largest_call() -> None:
    out = run_ranks(w_bucketed, 2, "sync")
    assert all(s == "ok" for s, _ in out), out
    (_, r0), (_, r1) = out
    assert r0["errors"] == [] == r1["errors"]
    # (1, 3) -> 4; (2, 2) -> 2; (5, 1) -> 8; (0, 2) -> 2 (rank 0 replays with no rows); ...
    assert r0["seen"] == r1["seen"] == [[4], [2], [8], [2], [4], [4]]


def test_bucketed_fallback_is_taken_by_every_rank_or_none() -> None:
    out = run_ranks(w_bucketed, 2, "above")
    assert all(s == "ok" for s, _ in out), out
    assert all(r["errors"] == [] and r["fallbacks"] == 1 for _, r in out), out


@pytest.mark.parametrize("case", ["mode", "sizes"])
def test_bucketed_disagreement_raises_on_every_rank(case: str) -> None:
    out = run_ranks(w_bucketed, 2, case)
    assert all(s == "ok" for s, _ in out), out
    for _, r in out:
        assert len(r["errors"]) == 1 and "ranks disagree" in r["errors"][0], r
    if case == "mode":
        assert "rank 1: eager" in out[0][1]["errors"][0]


def _doubled_sum(x: torch.Tensor) -> torch.Tensor:
    """Adds 1 to its argument in place, returns twice it summed over the ranks."""
    x.add_(1)
    y = x * 2
    dist.all_reduce(y)
    return y


def w_bucketed_padded(rank: int, world: int) -> list:
    import test_buckets

    test_buckets.install_cpu_graphs(setattr)
    g = tr.graph(_doubled_sum, torch.randn(8, 4), sizes=[2, 4, 8], sync_sizes=True,
                 ranks=RankConfig(timeout=5.0))
    gen = torch.Generator().manual_seed(0)  # the same rows on both ranks; rank 1 has fewer
    worst = []
    for base in (3, 12, 20, 7):  # 12 and 10 rows, 20 and 18: above 8, every rank eagerly
        x = torch.randn(base, 4, generator=gen)
        mine = x[: base - 2 * rank].clone()
        y = g(mine)
        # Rows both ranks have are summed twice; rows only rank 0 has meet rank 1's padding
        # rows (zeros, to which the call adds 1).
        ref = (x + 1) * 2
        ref[: base - 2] *= 2
        ref[base - 2:] += 2
        worst.append((y.shape[0], (y - ref[: mine.shape[0]]).abs().max().item(),
                      (mine - x[: mine.shape[0]] - 1).abs().max().item()))
    return [worst, g.stats.fallbacks]


def test_bucketed_ranks_above_the_largest_size_run_eagerly_at_the_same_rows() -> None:
    """A collective inside a call every rank runs eagerly gets the same shapes on every rank
    (the rows the largest call has; gloo raises on a mismatch, NCCL hangs): each rank's rows
    padded as a replay pads them, its own rows given back, its in-place writes kept."""
    out = run_ranks(w_bucketed_padded, 2)
    assert all(s == "ok" for s, _ in out), out
    for rank, (_, (rows, fallbacks)) in enumerate(out):
        assert [r[0] for r in rows] == [3 - 2 * rank, 12 - 2 * rank, 20 - 2 * rank, 7 - 2 * rank]
        assert all(r[1] < 1e-5 and r[2] < 1e-6 for r in rows), rows
        assert fallbacks == 2


# -- a replay that never ends: the watcher reports it (and ends the process by default) --------


class _Marker:
    """Stands for the CUDA event the watcher records after a call's GPU work."""

    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_a_replay_that_never_ends_is_reported_naming_the_graph_and_call(one_rank, caplog) -> None:
    from torchreplay.distributed.watch import _WATCHER

    markers: list[_Marker] = []

    def marker() -> _Marker:
        markers.append(_Marker(done=len(markers) < 2))  # the first call's work finishes
        return markers[-1]

    a = Agreement(dist.group.WORLD, "toy", fingerprint(["toy"]), sync_sizes=False, timeout=0.4,
                  marker=marker, on_hang="warn")
    time.sleep(0.3)
    assert markers == []  # nothing to watch before a call
    a(4, GRAPH)
    deadline = time.monotonic() + 5
    while len(markers) < 2 and time.monotonic() < deadline:  # a call gets two markers
        time.sleep(0.05)
    time.sleep(0.3)
    assert len(markers) == 2, markers  # then none while nothing is called
    a(4, GRAPH)  # its work never finishes: a collective waits for a rank that died
    with caplog.at_level("ERROR", logger="torchreplay.distributed.watch"):
        while "has not finished" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    assert len(markers) == 3, markers
    assert "rank 0: the GPU work up to call 2 of 'toy' has not finished after " in caplog.text
    assert "Every rank agreed to run that call" in caplog.text
    assert caplog.text.count("has not finished") == 1  # said once, not every second
    del _WATCHER.watched[a]


class _Owner:
    """Stands for a graph: its pool's ``release`` records that it was released."""

    def __init__(self, released: list) -> None:
        self.pool = self
        self.released = released
        self._ranks = None  # as a graph without an agreement has
        self.name = "unchecked"

    def release(self, owner: object) -> None:
        self.released.append(owner)


def test_graphs_are_released_when_their_group_is_destroyed(one_rank) -> None:
    """NCCL's destroy waits until every graph that captured one of the group's collectives is
    destroyed (a hang when the group is destroyed first): the watcher sees the main thread in
    ``destroy_process_group`` and releases the graphs of that group, with an agreement or
    without (``check=False``); later calls of an agreeing graph raise, naming why."""
    import threading

    from torchreplay.core.pool import release_with
    from torchreplay.distributed import Collective
    from torchreplay.distributed.watch import _WATCHER

    world, other = dist.group.WORLD, dist.new_group([0])
    released: list = []
    done = threading.Event()
    a = Agreement(world, "toy", fingerprint(["toy"]), sync_sizes=False, timeout=2.0,
                  marker=lambda: _Marker(done=True))
    a(4, GRAPH)
    agreeing, unchecked, elsewhere = _Owner(released), _Owner(released), _Owner(released)
    held = [Collective("allreduce_", world.group_name, (0,), "float32", 4)]
    release_with(agreeing, held, a)
    release_with(unchecked, held)
    release_with(elsewhere, [Collective("allreduce_", other.group_name, (0,), "float32", 4)])
    release_with(_Owner(released), [])  # no collectives: nothing to release
    # Stands for torch's: the watcher knows it by its name and file.
    ns: dict = {}
    code = "def destroy_process_group(group=None):\n    return wait()\n"
    exec(compile(code, "torch/distributed/distributed_c10d.py", "exec"),
         {"wait": lambda: (done.wait(10), list(released))[1]}, ns)

    def wait_for(n: int) -> None:
        deadline = time.monotonic() + 10
        while len(released) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        done.set()

    try:
        threading.Thread(target=wait_for, args=(1,), daemon=True).start()
        assert ns["destroy_process_group"](other) == [elsewhere]  # a subgroup: its graphs only
        a(4, GRAPH)  # not that group's: replays on
        done.clear()
        threading.Thread(target=wait_for, args=(3,), daemon=True).start()
        # The default group (destroying it destroys every group): the rest, within a period.
        assert ns["destroy_process_group"](world) == [elsewhere, agreeing, unchecked]
        with pytest.raises(ReplayInputError, match="its process group was destroyed"):
            a(4, GRAPH)
        assert agreeing._ranks is None  # the agreement it was given raises (above)
        with pytest.raises(ReplayInputError, match="'unchecked': its process group was destroyed"):
            unchecked._ranks(0, GRAPH)  # what a graph without an agreement calls from now on
    finally:
        _WATCHER.watched.pop(a, None)
        dist.destroy_process_group(other)


_ENDS = """
import os, sys, time
sys.path.insert(0, {root!r})
import torch.distributed as dist
from torchreplay.distributed import Agreement, GRAPH
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT={port!r})
dist.init_process_group("gloo", rank=0, world_size=1)
class Never:
    def query(self):
        return False
a = Agreement(dist.group.WORLD, "toy", 7, sync_sizes=False, timeout=0.3, marker=Never)
a(4, GRAPH)
time.sleep(20)
print("not ended")
"""


def test_a_replay_that_never_ends_ends_the_process_by_default() -> None:
    import subprocess
    import sys
    from pathlib import Path

    from torchreplay.distributed.watch import HANG_EXIT

    root = str(Path(__file__).resolve().parents[2])
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _ENDS.format(root=root, port=str(free_port()))],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == HANG_EXIT, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert time.monotonic() - start < 15
    assert "not ended" not in proc.stdout
    assert "call 1 of 'toy' has not finished" in proc.stderr, proc.stderr[-2000:]
    assert f"ending this process (exit code {HANG_EXIT})" in proc.stderr


def test_shared_exchange_takes_a_post_only_when_its_checksum_matches() -> None:
    """On a CPU that reorders stores (ARM), a reader may see a rank's call number before its
    values: that post must read as not there yet, never as stale values."""
    import mmap
    import threading

    from torchreplay.distributed.agree import _FIELDS, SharedExchange, _checksum

    mm = mmap.mmap(-1, 2 * 2 * _FIELDS * 8 + 64)
    me, peer = SharedExchange(mm, 2, 0, checked=True), SharedExchange(mm, 2, 1, checked=True)
    mv = memoryview(mm).cast("q")
    o = peer._slot(1, 1)
    mv[o + 1], mv[o + 2], mv[o + 3] = 9, 9, 9  # the values of an older post
    mv[o] = 1  # call 1's number, seen first

    def finish() -> None:
        time.sleep(0.05)
        mv[o + 1], mv[o + 2], mv[o + 3] = 5, 77, GRAPH
        mv[o + 4] = _checksum(1, 5, 77, GRAPH)

    t = threading.Thread(target=finish)
    t.start()
    got = me(1, (4, 77, GRAPH), 5.0)
    t.join()
    assert got == [(4, 77, GRAPH), (5, 77, GRAPH)]
    assert peer(1, (5, 77, GRAPH), 5.0) == got  # the peer's own read of the same call
    mv.release()


def test_a_rank_posting_while_another_gives_up_is_decided_under_the_lock() -> None:
    """The race the lock closes: A's wait ran out, B posts just then. A gives up only after
    looking again under the lock, and B, whose call comes late against A's post, looks for a
    give-up under the same lock: both go ahead (or, had A given up first, both raise)."""
    import fcntl
    import mmap
    import tempfile
    import threading

    from torchreplay.distributed.agree import _FIELDS, SharedExchange

    nbytes = 2 * 2 * _FIELDS * 8 + 64
    with tempfile.NamedTemporaryFile() as f:
        f.truncate(nbytes)
        fds = [os.open(f.name, os.O_RDWR) for _ in range(3)]
        mms = [mmap.mmap(fd, nbytes) for fd in fds[:2]]
        a = SharedExchange(mms[0], 2, 0, lock_fd=fds[0])
        b = SharedExchange(mms[1], 2, 1, lock_fd=fds[1])
        fcntl.flock(fds[2], fcntl.LOCK_EX)  # held: A's give-up and B's late look both wait
        got: dict[str, object] = {}

        def run(name: str, ex: SharedExchange, value: int) -> None:
            try:
                got[name] = ex(1, (value, 77, GRAPH), 0.3)
            except TimeoutError:
                got[name] = "gave up"

        ta = threading.Thread(target=run, args=("a", a, 4))
        ta.start()
        time.sleep(0.6)  # A's 0.3 s ran out; it waits for the lock to give up
        assert "a" not in got
        tb = threading.Thread(target=run, args=("b", b, 6))
        tb.start()
        time.sleep(0.2)  # B posted, found A's post, and waits for the lock too (A posted long ago)
        assert "b" not in got
        fcntl.flock(fds[2], fcntl.LOCK_UN)
        ta.join(5)
        tb.join(5)
        assert got == {"a": [(4, 77, GRAPH), (6, 77, GRAPH)], "b": [(4, 77, GRAPH), (6, 77, GRAPH)]}
        a.close()
        b.close()
        os.close(fds[2])


# -- the torch.compile backend: collectives read from the FX graph, the agreeing front ----------


def test_the_collectives_of_a_dynamo_graph_are_read_from_its_nodes(one_rank) -> None:
    import torch.distributed._functional_collectives as fc

    from torchreplay.compile.ranks import collectives_in

    def f(x):
        y = x * 2
        dist.all_reduce(y)
        return fc.all_gather_tensor(y.relu(), 0, dist.group.WORLD) + 1

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(f, backend=keep)(torch.randn(4, 3))
    found, groups = collectives_in(graphs[0])
    name = dist.group.WORLD.group_name
    assert [c.op for c in found] == ["all_reduce", "all_gather_into_tensor"], found
    assert all(c.group == name and c.ranks == (0,) and c.dtype == "float32" for c in found)
    assert [c.numel for c in found] == [12, 12]
    assert groups == {name: dist.group.WORLD}
    torch._dynamo.reset()


class _StubRuntime:
    """What AgreedRuntime uses of a PiecewiseRuntime, on the CPU: its sizes and its calls."""

    def __init__(self, sizes: list[int]) -> None:
        from torchreplay.pieces.program import Input, Program

        self.sizes, self.name, self.calls, self.fallbacks = sizes, "graph 0", [], []
        self.program = Program((Input("x", "tensor", dim=0),), [], (0,), (0,))

    def rows(self, leaves):
        return leaves[0].shape[0]

    def _bucket(self, n):
        return next((s for s in self.sizes if s >= n), -1)

    def __call__(self, *args, size=None):
        self.calls.append(("graph", size))
        return (args[0],)

    def _run_ungraphed(self, args):
        self.calls.append(("eager", args[0].shape[0]))  # the rows it runs at
        return (args[0],)

    def _count_fallback(self, reason):
        self.fallbacks.append(reason)


def w_compiled(rank: int, world: int, case: str) -> dict:
    from torchreplay.compile.ranks import AgreedRuntime

    rt = _StubRuntime([2, 4, 8] if case == "sizes" and rank == 1 else [2, 4, 8, 16])
    from torchreplay.distributed import Collective

    ranks = RankConfig(sync_sizes=case != "nosync", timeout=5.0)
    # without sync_sizes, what makes an agreement is a collective inside
    held = [Collective("all_reduce", "0", (0, 1), "float32", 8)] if case == "nosync" else []
    a = agreement(ranks, held, None, name="graph 0", parts=[tuple(rt.sizes)], sizes=True)
    front = AgreedRuntime(rt, a)
    rows = {"sync": [(3, 7), (1, 2)], "above": [(3, 20)], "sizes": [(3, 3)], "nosync": [(3, 7)]}
    errors, got = [], []
    for pair in rows[case]:
        try:
            got.append(front(torch.randn(pair[rank], 2))[0].shape[0])
        except ReplayInputError as exc:
            errors.append(str(exc))
            break
    return {"calls": rt.calls, "errors": errors, "fallbacks": len(rt.fallbacks), "rows": got}


@pytest.mark.parametrize("case", ["sync", "above", "sizes", "nosync"])
def test_compiled_graphs_agree_like_tr_graph(case: str) -> None:
    out = run_ranks(w_compiled, 2, case)
    assert all(s == "ok" for s, _ in out), out
    r0, r1 = (v for _, v in out)
    if case == "sync":  # 3 and 7 rows: both replay 8; 1 and 2: both 2
        assert r0["calls"] == r1["calls"] == [("graph", 8), ("graph", 2)], out
    elif case == "above":  # 20 rows on rank 1, above 16: both run without graphs, at 20 rows
        assert r0["calls"] == r1["calls"] == [("eager", 20)] and r0["fallbacks"] == 1, out
        assert r0["rows"] == [3] and r1["rows"] == [20], out  # each rank gets its own rows
    else:  # other size lists, or other sizes without sync_sizes: both raise, nothing runs
        assert r0["calls"] == r1["calls"] == [] and r0["errors"] and r1["errors"], out
        assert "ranks disagree" in r0["errors"][0], out


def test_compile_config_takes_a_rank_config() -> None:
    from torchreplay.config import CompileConfig

    with pytest.raises(ValueError, match="RankConfig"):
        CompileConfig(ranks="sync")  # type: ignore[arg-type]
    assert CompileConfig(ranks=RankConfig(sync_sizes=True)).ranks.sync_sizes
