"""core/rewind.py: what a build's calls write in place into the large tensors of Python state
(a cache object's keys, a memory bank kept as a plain attribute) is put back after the build,
by saving only what each write overwrites. Small tensors are copied whole (test_effects.py)."""

from __future__ import annotations

import copy
import gc
import logging

import pytest
import torch
import torch.nn as nn

import test_buckets
import torchreplay as tr
from test_effects import capture_like
from torchreplay.core.rewind import Rewind
from torchreplay.core.snapshot import StateSnapshot

CPU = torch.device("cpu")
ROWS = 1024  # keys of (2, 4, ROWS, 64) float32: 2 MiB, over the 1 MiB copied whole


def test_every_kind_of_write_is_put_back_last_first_and_only_what_it_overwrote_is_kept() -> None:
    k = torch.randn(2, 4, ROWS, 64)
    bank = torch.randn(300_000)
    orig_k, orig_bank = k.clone(), bank.clone()
    rewind = Rewind([k, bank])
    with rewind:
        for i in range(3):
            k.index_copy_(2, torch.tensor([5, 6]), torch.randn(2, 4, 2, 64))  # a KV cache's step
            k[:, :, torch.tensor([0, 0])] = torch.randn(2, 4, 2, 64)  # index_put_, repeated rows
            k[:, :, 10:12].copy_(torch.randn(2, 4, 2, 64))  # a view
            k[:, :, torch.tensor([1])] += 1  # read, then written
            k[k > 3] = 0  # a boolean mask
            bank.add_(1.5)  # the whole tensor
            torch.add(bank[:4], 1, out=bank[4:8])  # out=
    assert not torch.equal(k, orig_k) and not torch.equal(bank, orig_bank)
    # rows, not whole caches: 3 x (2 + 2 + 2 + 1 rows of 2x4x64 floats, the mask's elements),
    # the bank's whole storage for each add_
    assert rewind.saved_bytes < 3 * (bank.nbytes + 8 * 2 * 4 * 64 * 4) + k.nbytes // 4
    rewind.undo()
    assert torch.equal(k, orig_k) and torch.equal(bank, orig_bank)
    assert rewind.saved_bytes == 0
    rewind.undo()  # nothing left: a no-op
    assert torch.equal(k, orig_k)


def test_an_index_advanced_in_place_after_the_write_and_a_region_written_again() -> None:
    k, pos = torch.randn(8, 64, 1024), torch.tensor([3])
    orig = k.clone()
    rewind = Rewind([k])
    with rewind:
        for _ in range(3):
            k.index_copy_(0, pos, torch.randn(1, 64, 1024))
            pos.add_(1)  # the position counter, advanced in place after each write
            k.zero_()  # the same whole region each time: saved once
            k[pos] = 1.0
    assert rewind.saved_bytes < 2 * k.nbytes
    rewind.undo()
    assert torch.equal(k, orig)


def test_tensors_not_watched_and_reads_are_not_recorded() -> None:
    k, other = torch.randn(4, 8), torch.randn(4, 8)
    rewind = Rewind([k])
    with rewind:
        other.add_(1)
        (k * 2).sum()
    assert rewind.saved_bytes == 0
    rewind.undo()


class Cache:
    """A KV cache object of the caller's (not a module, so not a buffer): each step writes its
    rows at the positions it is given, and reads the cache."""

    def __init__(self) -> None:
        self.keys = torch.zeros(2, 4, ROWS, 64)

    def update(self, pos: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        self.keys.index_copy_(2, pos, k)
        return self.keys


def step(x: torch.Tensor, pos: torch.Tensor, cache: Cache) -> torch.Tensor:
    keys = cache.update(pos, x.view(2, 4, 1, 64).expand(2, 4, pos.numel(), 64))
    return (keys[:, :, :16] * x.view(2, 4, 1, 64)).sum(-1)


def test_a_build_leaves_the_callers_large_cache_as_it_was() -> None:
    # The sample's position 0 holds the caller's prompt: the warm-ups and the capture wrote the
    # sample's row over it, four times, and kept it (a silently wrong cache, every logit after).
    cache = Cache()
    cache.keys[:, :, :6] = torch.randn(2, 4, 6, 64)  # a prompt at rows 0..5
    before = cache.keys.clone()
    err, _ = capture_like(step, torch.randn(512), torch.tensor([0]), cache)
    assert err is None
    assert torch.equal(cache.keys, before)


@pytest.mark.parametrize("capture", ["ahead", "lazy"])
def test_tr_graph_with_a_large_cache_in_an_argument_equals_eager(monkeypatch, capture) -> None:
    test_buckets.install_cpu_graphs(monkeypatch.setattr)
    cache = Cache()
    cache.keys[:, :, :6] = torch.randn(2, 4, 6, 64)
    ref = copy.deepcopy(cache)

    def decode(x: torch.Tensor, pos: torch.Tensor, c: Cache) -> torch.Tensor:  # x: [B, 512]
        keys = c.update(pos, x[0].view(2, 4, 1, 64))  # the first row's (a real one)
        return x * keys[:, :, :16].sum()

    g = tr.graph(decode, torch.randn(1, 512), torch.tensor([0]), cache, sizes=[1, 2, 4],
                 dim={"x": 0, "pos": None}, capture=capture)
    assert torch.equal(cache.keys, ref.keys)
    for p, n in zip(range(6, 12), (1, 3, 2, 4, 1, 2)):
        x, pos = torch.randn(n, 512), torch.tensor([p])
        torch.testing.assert_close(g(x, pos, cache), decode(x, pos, ref))
        assert torch.equal(cache.keys, ref.keys)


def test_a_large_accumulator_on_a_module_is_put_back() -> None:
    class Bank(nn.Module):  # a running sum kept as a plain attribute, not a buffer
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.total = torch.zeros(512, 1024)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            self.total.add_(y.sum())
            return y * self.total[0, 0]

    m = Bank()
    err, _ = capture_like(m, torch.randn(4, 8), modules=[m])
    assert err is None
    assert int(m.total.count_nonzero()) == 0  # as the caller left it: no call was made


# -- a module's large buffers (gpt-fast's KV caches are registered buffers) --------------------


class BufferCache(nn.Module):
    """gpt-fast's layout: the KV cache a registered buffer (2 MiB), written with ``index_put_``
    at the positions each call is given, next to a small buffer (copied whole)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.register_buffer("keys", torch.zeros(8 * ROWS, 64))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.keys[pos] = self.lin(x[:1])  # the first row's (a real one)
        self.calls.add_(1)
        return x * self.keys[:16].sum()


def _prompted() -> BufferCache:
    m = BufferCache()
    with torch.no_grad():
        m.keys[:6] = torch.randn(6, 64)  # a prompt at rows 0..5
    return m


def test_a_snapshot_records_what_a_large_buffer_loses_instead_of_copying_it() -> None:
    m = _prompted()
    before = m.keys.clone()
    snap = StateSnapshot(m, CPU)
    assert snap.saved_bytes < m.keys.nbytes // 100  # not a copy of the cache: the small ones
    with torch.no_grad(), snap.running():
        for _ in range(3):
            m(torch.randn(2, 64), torch.tensor([0]))
    assert not torch.equal(m.keys, before) and int(m.calls) == 3
    assert snap.saved_bytes < m.keys.nbytes // 100  # three rows of the cache
    snap.restore()
    assert torch.equal(m.keys, before) and int(m.calls) == 0


@pytest.mark.parametrize("shapes", ["one", "sizes"])
@pytest.mark.parametrize("form", ["module", "function"])
def test_tr_graph_of_a_module_with_a_large_cache_buffer_equals_eager(monkeypatch, form, shapes) -> None:
    test_buckets.install_cpu_graphs(monkeypatch.setattr)
    m = _prompted()
    ref = copy.deepcopy(m)
    fn = m if form == "module" else (lambda x, pos: m(x, pos))  # a function: m found as it runs
    kw = {"sizes": [1, 2, 4], "dim": {"x": 0, "pos": None}} if shapes == "sizes" else {}
    g = tr.graph(fn, torch.randn(1 if kw else 3, 64), torch.tensor([0]), **kw)
    assert torch.equal(m.keys, ref.keys) and int(m.calls) == 0
    with torch.no_grad():
        for p, n in zip(range(6, 12), (1, 3, 2, 4, 1, 2) if kw else [3] * 6):
            x, pos = torch.randn(n, 64), torch.tensor([p])
            torch.testing.assert_close(g(x, pos), ref(x, pos))
            assert torch.equal(m.keys, ref.keys) and torch.equal(m.calls, ref.calls)


def test_a_snapshot_leaving_large_buffers_puts_back_the_small_ones_only() -> None:
    """``large="leave"`` (a breakable graph built with ``restore_state=False``): the cache is
    neither copied nor recorded, and stays as the build's calls left it; the counter is put
    back."""
    m = _prompted()
    before = m.keys.clone()
    snap = StateSnapshot(m, CPU, large="leave")
    assert snap.saved_bytes < m.keys.nbytes // 100
    with torch.no_grad(), snap.running():
        m(torch.randn(2, 64), torch.tensor([7]))
    snap.restore()
    assert int(m.calls) == 0 and not torch.equal(m.keys[7], before[7])
    assert torch.equal(m.keys[:7], before[:7])


def test_a_whole_copy_that_does_not_fit_on_the_device_is_refused_naming_the_buffers(monkeypatch) -> None:
    from torchreplay.core import snapshot as snapshot_mod

    mib = 1 << 20
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * mib, 80 * mib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 30 * mib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 20 * mib)
    named = [(f"layers.{i}.attention.k_cache", torch.empty(16 * mib, dtype=torch.uint8)) for i in range(5)]
    cuda = torch.device("cuda", 0)
    with pytest.raises(tr.CaptureError) as err:  # 80 MiB to copy, 40 + 10 MiB free
        snapshot_mod.check_fits(named, cuda)
    text = str(err.value)
    assert "layers.0.attention.k_cache (16 MiB)" in text and "and 1 more" in text
    assert "80 MiB in all" in text and "50 MiB free" in text and "restore_state=False" in text
    snapshot_mod.check_fits(named[:3], cuda)  # 48 MiB: fits
    snapshot_mod.check_fits(named, CPU)  # (not a CUDA device: nothing to check)


def test_a_snapshot_copying_large_buffers_whole_is_refused_when_they_do_not_fit(monkeypatch) -> None:
    """``large="copy"`` (a breakable graph's captures): the refusal names the cache by its
    qualified name, before any copy was made."""
    mib = 1 << 20
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 * mib, 80 * mib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: torch.get_rng_state())
    model = nn.Sequential(_prompted())
    with pytest.raises(tr.CaptureError, match=r"0\.keys \(2 MiB\).*restore_state=False"):
        StateSnapshot(model, torch.device("cuda", 0), large="copy")
    StateSnapshot(model, torch.device("cuda", 0), large="leave")  # (the counter alone: 8 bytes)


def test_copies_that_run_out_of_memory_anyway_are_the_same_error_and_given_back(monkeypatch) -> None:
    """The check let them through (torch's unused cache counted as free holds a graph pool's
    blocks, which no copy can take) and a copy ran out of memory: the same CaptureError, what
    was copied given back to the device first (a capture's pool could not take it from torch's
    cache), and nothing of it kept."""
    from torchreplay.core import snapshot as snapshot_mod

    mib = 1 << 20
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * mib, 80 * mib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 60 * mib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    emptied: list[int] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    made: list[torch.Tensor] = []
    real_clone = torch.Tensor.clone

    def clone(t: torch.Tensor, *a, **k) -> torch.Tensor:
        if made:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 MiB")
        made.append(real_clone(t, *a, **k))
        return made[-1]

    monkeypatch.setattr(torch.Tensor, "clone", clone)
    named = [("self.k_cache", torch.empty(16 * mib, dtype=torch.uint8)),
             ("self.v_cache", torch.empty(16 * mib, dtype=torch.uint8))]
    with pytest.raises(tr.CaptureError) as err:  # 32 MiB against 10 + 60 counted free
        snapshot_mod.copies(named, torch.device("cuda", 0))
    text = str(err.value)
    assert "self.k_cache (16 MiB), self.v_cache (16 MiB)" in text and "held unused by graphs' memory pools" in text
    assert emptied == [1] and err.value.__context__ is None
    monkeypatch.undo()
    assert len(made) == 1 and gc.get_referrers(made[0]) == [made]  # the copy made: not held


class Unseen(BufferCache):
    """Writes its cache where no dispatch mode sees it, as compiled code or a raw kernel does."""

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        with torch.utils._python_dispatch._disable_current_modes():
            self.keys[pos] = x[:1]
        return x * self.keys[:16].sum()


def test_a_write_the_recording_missed_is_named_and_a_compiled_modules_buffers_are_copied(caplog) -> None:
    m = Unseen()
    snap = StateSnapshot(m, CPU)
    with torch.no_grad(), snap.running():
        m(torch.randn(2, 64), torch.tensor([0]))
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        snap.restore()
    assert "Unseen.keys" in caplog.text and "torch.compile the whole module" in caplog.text
    assert m.keys[0].abs().sum() > 0  # left as written: the warning says so
    # A compiled module: no mode sees its writes, so its large buffers are copied whole.
    m = Unseen()
    compiled = torch.compile(m, backend="eager")
    snap = StateSnapshot(compiled, CPU)
    assert snap.saved_bytes >= m.keys.nbytes
    with torch.no_grad(), snap.running():
        compiled(torch.randn(2, 64), torch.tensor([0]))
    assert m.keys[0].abs().sum() > 0
    snap.restore()
    assert int(m.keys.count_nonzero()) == 0


def test_writes_seen_while_capturing_are_saved_just_before_the_segment_replays(monkeypatch) -> None:
    """A breakable graph's capture replays each segment for real before the break after it: a
    write seen while capturing ran nothing yet, so it is saved by ``before_replay()``, just
    before that replay; the rows of an index write whose index the caller gave, the whole
    tensor for one whose index the segment computed. Emulated on the CPU: the captured ops'
    effect is taken back before the "replay" runs them again."""
    from torchreplay.core import rewind as rewind_mod

    capturing = [False]
    monkeypatch.setattr(rewind_mod, "_capturing", lambda: capturing[0])
    monkeypatch.setattr(rewind_mod, "_recorded", lambda t: True)
    k, acc, pos = torch.randn(4, ROWS, 64), torch.randn(300_000), torch.tensor([7])
    orig_k, orig_acc = k.clone(), acc.clone()

    segments = [
        lambda: k.index_copy_(1, pos, torch.randn(4, 1, 64)),  # the caller's position: its rows
        lambda: acc[:10].add_(1),  # an accumulator's view
        lambda: k.__setitem__((slice(None), pos + 1), 2.0),  # an index it computed
    ]
    most = [k.nbytes // 100, 10 * 4, None]  # what before_replay() saves for each
    rewind = Rewind([k, acc])
    for segment, bound in zip(segments, most):
        before_k, before_acc, saved = k.clone(), acc.clone(), rewind.saved_bytes
        capturing[0] = True
        with rewind:
            segment()  # "captured": recorded, nothing saved
        capturing[0] = False
        assert rewind.saved_bytes == saved
        k.copy_(before_k), acc.copy_(before_acc)  # (a capture runs nothing)
        with rewind:
            rewind.before_replay()
        saved = rewind.saved_bytes - saved
        assert (0 < saved <= bound) if bound is not None else saved >= k.nbytes, (saved, bound)
        segment()  # the replay (no op of a graph's replay passes through the mode)
    assert not torch.equal(k, orig_k) and not torch.equal(acc, orig_acc)
    rewind.undo()
    assert torch.equal(k, orig_k) and torch.equal(acc, orig_acc)
    capturing[0] = True
    with rewind:  # captured, never replayed in the build: nothing to save or put back
        segments[0]()
    rewind.undo()
    assert rewind.saved_bytes == 0


def test_a_checksum_changes_with_the_contents_and_is_stable_otherwise() -> None:
    """``checksum``: the same for the same bytes, changed by one element next to a NaN (the
    bits are summed, not the values), by two rows swapped (equal sums, other places), for
    integers and bytes too; None for a tensor that is not contiguous."""
    from torchreplay.core.snapshot import checksum

    same = torch.equal

    t = torch.randn(64, 4096)
    t[3, 5] = float("nan")
    s = checksum(t)
    assert same(s, checksum(t.clone()))
    u = t.clone()
    u[10, 7] += 1e-3
    assert not same(s, checksum(u))
    u = t.clone()
    u[[1, 2]] = u[[2, 1]]
    assert not same(s, checksum(u))
    i = torch.arange(10_000, dtype=torch.int32)
    j = i.clone()
    j[9_999] = 0
    assert not same(checksum(i), checksum(j))
    b = torch.zeros(4099, dtype=torch.bool)  # (not a whole number of words: bytes)
    c = b.clone()
    c[4098] = True
    assert same(checksum(b), checksum(b.clone())) and not same(checksum(b), checksum(c))
    assert checksum(t.t()) is None


class _Weights(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("packed", torch.randn(1 << 19))  # 2 MiB: large, only read
        self.register_buffer("cache", torch.zeros(1 << 19))  # 2 MiB: large, written
        self.register_buffer("count", torch.zeros(()))


def test_a_sample_call_tells_which_large_buffers_it_wrote_and_the_capture_copies_only_those() -> None:
    """With ``sums``, ``written_large`` names the large buffers written since: by an op (the
    version counter) or where no counter shows (through ``.data``, as a kernel launched outside
    an aten op would). With ``copy_large``, a large buffer not among them is not copied
    (``restore`` leaves it) and ``written_large(versions=False)`` names it once it changed."""
    m = _Weights()
    snap = StateSnapshot(m, torch.device("cpu"), sums=True)
    m.count.add_(1)
    assert snap.written_large() == []
    m.cache.data[5] = 1.0  # (no version counter moves)
    assert [n for n, _ in snap.written_large()] == ["_Weights.cache"]
    m.cache.add_(0.0)  # (a version moved, contents the same)
    assert [n for n, _ in snap.written_large()] == ["_Weights.cache"]
    assert [n for n, _ in snap.written_large(versions=False)] == ["_Weights.cache"]

    packed = m.packed.clone()
    capture = StateSnapshot(m, torch.device("cpu"), large="copy", copy_large={id(m.cache)})
    assert capture.saved_bytes == m.cache.nbytes + m.count.nbytes  # the packed weights not copied
    m.cache.add_(1.0)
    m.count.add_(1)
    capture.restore()
    assert m.cache[5].item() == 1.0 and m.count.item() == 1.0  # put back
    assert capture.written_large(versions=False) == []
    m.packed.data[0] += 1.0
    assert [n for n, _ in capture.written_large(versions=False)] == ["_Weights.packed"]
    capture.restore()
    assert not torch.equal(m.packed, packed)  # left as written: nothing to put back from


@pytest.mark.parametrize("layout", ["expanded", "window", "dense"])
def test_saved_state_is_put_back_into_a_tensor_whose_elements_share_memory(layout) -> None:
    """A value put back after a capture may be an expanded mask (saved for a backward) or a
    window view: ``copy_`` refuses to write those; the put-back writes each location once."""
    from torchreplay import _compat
    from torchreplay.pieces.putback import put_back

    def view(of: torch.Tensor) -> torch.Tensor:
        return {"expanded": lambda: of.expand(3, 4, 5, 8), "window": lambda: of.view(-1).unfold(0, 6, 2),
                "dense": lambda: of}[layout]()

    base = torch.randn(3, 1, 1, 8)
    t = view(base)
    want, version = t.clone(), t._version
    with put_back([("mask", t)], torch.device("cpu")):
        base.mul_(2).add_(1)  # what a warm-up writes
        assert not torch.equal(t, want)
    torch.testing.assert_close(t, want, rtol=0, atol=0)
    assert t._version == version  # (a pending backward saved it as it was)
    # and the helper alone, from a value that agrees where the elements share memory (one made
    # through a view of the same layout)
    other = torch.randn(base.shape)
    _compat.copy_back(t, view(other).clone())
    torch.testing.assert_close(base, other, rtol=0, atol=0)
