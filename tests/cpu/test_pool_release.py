"""When a pool's last owner goes, its memory goes back to the device (``core/pool.py``), also
when the owner was in a reference cycle (freed by the cyclic collector, which runs every
finalizer of a collection before it frees any of the garbage). Stands in for the CUDA calls:
``empty_cache`` records which stand-in blocks were still held when it ran."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import torchreplay.core.pool as pool_module
from torchreplay.core.pool import Pool


class _Block:
    """A tensor in the pool: alive while held."""

    live: set[int] = set()

    def __init__(self) -> None:
        _Block.live.add(id(self))
        weakref.finalize(self, _Block.live.discard, id(self))


class _Graph:
    def __init__(self) -> None:
        self.reset_calls = 0

    def reset(self) -> None:
        self.reset_calls += 1


class _Owner:
    """A graphed callable: its pool, its graphs and the outputs it holds in the pool."""

    def __init__(self, pool: Pool, cycle: bool) -> None:
        self.pool = pool
        self.graphs = [_Graph()]
        self.blocks = [_Block(), _Block()]
        self.me = self if cycle else None
        pool.track(self, self.graphs, lambda: None)


@pytest.fixture
def emptied(monkeypatch) -> list[int]:
    """Each ``torch.cuda.empty_cache()`` call: how many stand-in blocks were still held."""
    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(len(_Block.live)))
    monkeypatch.setattr(pool_module, "_empty_after_collection", False, raising=False)
    _Block.live.clear()
    return calls


@pytest.mark.parametrize("cycle", [False, True], ids=["freed at once", "in a cycle"])
def test_the_last_owner_gone_gives_the_pool_back_once_its_blocks_are_free(emptied, cycle) -> None:
    owner = _Owner(Pool(), cycle)
    graphs = owner.graphs
    gone = weakref.ref(owner)
    del owner
    gc.collect()
    assert gone() is None and not _Block.live
    assert graphs[0].reset_calls == 1
    # The cache was emptied after the last block was freed (the collection's end, at the latest).
    assert emptied and emptied[-1] == 0, emptied
    assert not pool_module._empty_after_collection


def test_a_pool_still_used_by_another_owner_is_kept(emptied) -> None:
    pool = Pool()
    first, second = _Owner(pool, cycle=False), _Owner(pool, cycle=True)
    del second
    gc.collect()
    assert emptied == []  # the first owner's graphs still use the pool's memory
    del first
    gc.collect()
    assert emptied and emptied[-1] == 0


def test_no_cache_is_emptied_while_a_stream_captures(emptied, monkeypatch) -> None:
    """Inside another tool's capture (a collection there runs the hook): wait for the next."""
    pool_module._empty_after_collection = True
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    gc.collect()
    assert emptied == [] and pool_module._empty_after_collection
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    gc.collect()
    assert emptied == [0] and not pool_module._empty_after_collection


def test_a_forked_child_does_not_touch_its_parents_cuda(emptied, monkeypatch) -> None:
    """A data loader's worker forked while the flag was set: torch marks CUDA uninitialized in
    the child, whose collections must not call into the parent's CUDA context."""
    pool_module._empty_after_collection = True
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    gc.collect()
    assert emptied == [] and not pool_module._empty_after_collection


def test_a_pool_torch_refused_takes_a_new_id_and_a_kept_graph_waits_for_a_member(monkeypatch) -> None:
    """torch never captures into a pool id again once its last graph is gone (its allocators
    assert): the pool takes a new id, and starts its capture order again. A graph kept for the
    pool (a capture that recorded nothing) is dropped when the next member registers."""
    ids = iter([(0, 1), (0, 2)])
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(ids))
    pool = Pool()
    assert pool.handle == (0, 1)
    pool.keep(kept := _Graph())
    assert pool.kept is kept
    pool.register(member := _Member())
    assert pool.kept is None and pool._members
    pool.renew()  # (its members' graphs of the old id go on: the capture order goes on)
    assert pool.handle == (0, 2) and pool._members and pool._retired == [(0, 1)]
    assert "retired=[(0, 1)]" in repr(pool)
    del member
    gc.collect()
    pool._forget()  # (the last owner gone)
    assert pool._retired == [] and not pool._members


class _Member:
    def invalidate_outputs(self) -> None:
        pass
