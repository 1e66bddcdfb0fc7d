"""The state guard of a recomputed backward (training/recompute.py ``_StateGuard``), on its own:
what it keeps and puts back, what it leaves alone, what it refuses; and the RNG reader's CPU
answer. The recompute itself is tested end to end in test_training.py (emulated) and
tests/gpu/test_training.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchreplay.training.recompute import _StateGuard, rng_reader


def test_a_tensor_made_before_is_put_back_without_moving_its_version() -> None:
    stat = torch.zeros(4)
    version = stat._version
    x = torch.randn(3, 4)
    with _StateGuard() as guard:
        stat.mul_(0.9).add_(x.mean(0), alpha=0.1)
        y = (x * 2).sum()
    assert not torch.equal(stat, torch.zeros(4))  # written inside
    seen = stat._version
    guard.restore()
    assert torch.equal(stat, torch.zeros(4)) and stat._version == seen > version
    assert len(guard.kept) == 1 and guard.read_back is None
    assert y.shape == ()


def test_a_tensor_made_inside_is_its_own_and_batch_norm_statistics_are_kept() -> None:
    rm, rv = torch.zeros(4), torch.ones(4)
    with _StateGuard() as guard:
        h = torch.randn(5, 4)
        h.add_(1.0)  # made inside: not kept
        F.batch_norm(h, rm, rv, training=True)  # unmarked in the kernel's schema: kept
    assert [t is rm or t is rv for t, _ in guard.kept] == [True, True]
    guard.restore()
    assert torch.equal(rm, torch.zeros(4)) and torch.equal(rv, torch.ones(4))


def test_a_read_after_a_write_is_named_and_an_update_is_not() -> None:
    stat = torch.zeros(4)
    with _StateGuard() as guard:
        stat.mul_(0.5).add_(1.0)  # an update reads what it writes: fine
    assert guard.read_back is None
    guard.restore()
    with _StateGuard() as guard:
        stat.add_(1.0)
        torch.ones(4) + stat  # reads the written value
    guard.restore()
    assert guard.read_back is not None and "(4,) torch.float32, read by aten.add" in guard.read_back


def test_a_sparse_argument_does_not_stop_it() -> None:
    stat = torch.zeros(3)
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (3,), check_invariants=True)
    with _StateGuard() as guard:
        stat.add_(1.0)
        (sparse + stat.to_sparse()).to_dense()
    guard.restore()
    assert torch.equal(stat, torch.zeros(3)) and guard.read_back is not None


def test_no_rng_reader_on_the_cpu() -> None:
    assert rng_reader(torch.device("cpu")) is None
