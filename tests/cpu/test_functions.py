"""A plain function that runs modules is watched as its modules (core/args.py ``called_module``,
core/snapshot.py ``StateSnapshot.running``), on the CPU: which modules are found and how they
are grouped, and ``tr.graph(fn, sizes=...)`` end to end with test_buckets' eager stand-in for
CUDA graphs (train/eval switches, hooks, buffers put back, row mixing refused)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import test_buckets
import torchreplay as tr
from torchreplay.core.args import ModuleGroup, called_module, roots_of
from torchreplay.core.snapshot import StateSnapshot
from torchreplay.errors import UnsupportedError

CPU = torch.device("cpu")
SIZES = [2, 4, 8]


@pytest.fixture
def cpu_graphs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    return test_buckets.install_cpu_graphs(monkeypatch.setattr)


class Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x) * self.calls


def test_the_modules_a_function_runs_are_found_in_order_and_their_buffers_put_back() -> None:
    torch.manual_seed(0)
    body, head, unused = Counted(), nn.Linear(6, 2), nn.Linear(6, 6)
    snap = StateSnapshot(None, CPU, find=True)
    with snap.running():
        head(body(torch.randn(3, 6)))
        body(torch.randn(3, 6))
    assert snap.called == [body, body.lin, head]  # each once, in the order first called
    assert body.calls.item() == 2
    snap.restore()
    assert body.calls.item() == 0
    body(torch.randn(3, 6))  # outside the block: no longer recorded
    assert len(snap.called) == 3 and unused not in snap.called


def test_without_find_or_save_the_snapshot_records_nothing_and_restores_nothing() -> None:
    m = Counted()
    plain = StateSnapshot(None, CPU)
    with plain.running():
        m(torch.randn(2, 6))
    assert plain.called is None
    unsaved = StateSnapshot(None, CPU, find=True, save=False)
    with unsaved.running():
        m(torch.randn(2, 6))
    unsaved.restore()
    assert unsaved.called == [m, m.lin] and m.calls.item() == 2


def test_one_root_is_the_module_itself_several_are_grouped() -> None:
    body = nn.Sequential(nn.Linear(6, 6), nn.ReLU())
    head = nn.Linear(6, 2)
    assert called_module([]) is None
    assert called_module([body, body[0], body[1]]) is body
    assert roots_of([body[0], body, head]) == [body, head]
    group = called_module([body, body[0], head])
    assert isinstance(group, ModuleGroup)
    assert list(group.children()) == [body, head]
    assert group.training == (True, True)
    head.eval()
    assert group.training == (True, False)  # a switch of either is seen by one comparison
    assert dict(group.named_children()).keys() == {"Sequential", "Linear"}
    twin = called_module([nn.Linear(2, 2), nn.Linear(2, 2)])
    assert list(dict(twin.named_children())) == ["Linear", "Linear_1"]


def test_a_function_graphed_with_sizes_follows_its_models_mode(cpu_graphs, caplog) -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 12), nn.Dropout(0.5), nn.Linear(12, 5)).eval()

    def fn(x):
        return m(x) + 1

    g = tr.graph(fn, torch.randn(3, 6), sizes=SIZES)
    assert g._module is m
    m.train()
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        for k in range(4):
            x = torch.randn(3, 6)
            torch.manual_seed(k)
            got = g(x)
            torch.manual_seed(k)
            torch.testing.assert_close(got, fn(x), rtol=0, atol=0)
    assert g.stats.fallbacks == 4
    assert sum("mode" in r.getMessage() for r in caplog.records) == 1
    m.eval()
    with torch.no_grad():
        x = torch.randn(3, 6)
        torch.testing.assert_close(g(x), fn(x))
    assert g.stats.replays == 1


def test_a_function_graphed_with_sizes_runs_a_new_hook_eagerly(cpu_graphs) -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 5)).eval()
    g = tr.graph(lambda x: m(x) * 2, torch.randn(3, 6), sizes=SIZES)
    seen = []
    m[2].register_forward_hook(lambda mod, i, o: seen.append(o))
    with torch.no_grad():
        g(torch.randn(3, 6))
    assert g.stats.fallbacks == 1 and len(seen) == 1


def test_graphing_a_function_with_sizes_puts_its_models_buffers_back(cpu_graphs) -> None:
    torch.manual_seed(0)
    m = Counted()
    with torch.no_grad():
        # lazy: the stand-in's captures run for real, where a CUDA capture runs nothing; only
        # the first, which the snapshot covers, comes at build
        tr.graph(lambda x: m(x) + 1, torch.randn(3, 6), sizes=SIZES, capture="lazy")
        assert m.calls.item() == 0  # probe, warm-ups and capture ran it: all put back


def test_sizes_refuse_a_functions_batch_norm_in_training_and_put_its_statistics_back(cpu_graphs) -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6)).train()
    before = m[1].running_mean.clone()
    with torch.no_grad(), pytest.raises(UnsupportedError, match="BatchNorm1d"):
        tr.graph(lambda x: m(x), torch.randn(4, 6), sizes=SIZES)
    torch.testing.assert_close(m[1].running_mean, before, rtol=0, atol=0)


def test_modules_another_thread_runs_meanwhile_are_not_recorded() -> None:
    import threading

    mine, theirs = nn.Linear(6, 6), nn.Linear(6, 6)
    snap = StateSnapshot(None, CPU, find=True)
    with snap.running():
        worker = threading.Thread(target=lambda: theirs(torch.randn(2, 6)))
        worker.start()
        worker.join()
        mine(torch.randn(2, 6))
    assert snap.called == [mine]
