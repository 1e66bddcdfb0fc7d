"""What a refused ``capture_begin`` leaves (``core/capture.py``, ``Segments.resume``), with
stand-ins for torch's graph and allocator calls: torch marks its RNG as capturing and routes
the pool's allocations before it can fail, so every failure is undone; a refusal because of the
pool id alone (torch never captures into an id again once its graphs are gone, and a capture
CUDA invalidated can leave the id marked as recording) takes a new id and begins again."""

from __future__ import annotations

import pytest
import torch

from torchreplay import _compat
from torchreplay.core import capture as capture_module
from torchreplay.core.capture import Segments
from torchreplay.core.pool import Pool


class _Graph:
    """A torch CUDA graph whose ``capture_begin`` fails with the next of ``failures``."""

    failures: list[str] = []
    begun: list[tuple[int, int]] = []

    def capture_begin(self, pool, capture_error_mode):
        if _Graph.failures:
            raise RuntimeError(_Graph.failures.pop(0))
        _Graph.begun.append(pool)


@pytest.fixture
def undone(monkeypatch):
    """The torch calls the undo makes, in order: ("pool", id) and ("rng",)."""
    calls: list[tuple] = []
    ids = iter([(0, 1), (0, 2), (0, 3)])
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(ids))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(capture_module.copy_nodes, "graph", lambda keep: _Graph())
    monkeypatch.setattr(_compat, "clear_cublas_workspaces", lambda: None)
    monkeypatch.setattr(_compat, "abandon_pool", lambda device, pool: calls.append(("pool", pool)))
    monkeypatch.setattr(_compat, "end_rng_capture", lambda gens=(): calls.append(("rng",)))
    _Graph.failures, _Graph.begun = [], []
    return calls


@pytest.mark.parametrize("why", [
    "it->second->use_count > 0 INTERNAL ASSERT FAILED at \"CachingHostAllocator.h\":773",
    "beginAllocateToPool: already recording to mempool_id",
], ids=["every graph of the id gone", "the id left recording"])
def test_a_pool_id_torch_refuses_is_undone_renewed_and_the_capture_begins(undone, why) -> None:
    pool = Pool()
    _Graph.failures = [why]
    segments = Segments(pool, "global", python_rng=False)
    segments.resume()
    assert undone == [("pool", (0, 1)), ("rng",)]  # what torch did before it failed, undone
    assert _Graph.begun == [(0, 2)] and pool.handle == (0, 2) and pool._retired == [(0, 1)]
    assert segments.open is not None


def test_another_failure_of_capture_begin_is_undone_and_raised(undone) -> None:
    pool = Pool()
    _Graph.failures = ["CUDA error: out of memory"]
    segments = Segments(pool, "global", python_rng=False)
    with pytest.raises(RuntimeError, match="out of memory"):
        segments.resume()
    assert undone == [("pool", (0, 1)), ("rng",)]
    assert pool.handle == (0, 1) and not pool._retired and segments.open is None


def test_a_new_id_refused_too_is_raised_not_retried_forever(undone) -> None:
    pool = Pool()
    _Graph.failures = ["beginAllocateToPool: already recording to mempool_id"] * 2
    segments = Segments(pool, "global", python_rng=False)
    with pytest.raises(RuntimeError, match="already recording"):
        segments.resume()
    assert undone == [("pool", (0, 1)), ("rng",), ("pool", (0, 2)), ("rng",)]
    assert segments.open is None


class _Segment(_Graph):
    """A graph that ends: ``nodes`` recorded, instantiated or not."""

    def __init__(self, keep: bool) -> None:
        self.keep, self.nodes, self.instantiated = keep, 0, False

    def capture_end(self) -> None:
        pass

    def instantiate(self) -> None:
        self.instantiated = True


def test_only_a_segment_that_begins_with_copy_nodes_keeps_its_template(undone, monkeypatch) -> None:
    """The first segment with the inputs' copy nodes, one after a break with none, one after a
    break with one new output: each kept template is instantiated at its cut, and a segment of
    nothing but its copy nodes is empty (as one of no work)."""
    made: list[_Segment] = []
    monkeypatch.setattr(capture_module.copy_nodes, "graph", lambda keep: made.append(_Segment(keep)) or made[-1])
    monkeypatch.setattr(capture_module.copy_nodes, "node_count", lambda g: g.nodes)
    segments = Segments(Pool(), "global", copies=2, python_rng=False)
    segments.resume()
    made[-1].nodes = 5  # the 2 copies and the call's work
    assert segments.cut() is made[0] and made[0].instantiated
    segments.resume()
    assert segments.cut() is made[1] and not made[1].instantiated  # (capture_end instantiates it)
    segments.resume(copies=1)
    made[-1].nodes = 1  # its copy alone: two breaks in a row
    assert segments.cut() is None and not made[2].instantiated
    assert [g.keep for g in made] == [True, False, True] and segments.empty == [False, False, True]
