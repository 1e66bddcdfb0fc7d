"""Breakable graphs (``tr.graph(..., breaks=...)``) on a real GPU, each against eager over many
calls with fresh random inputs: attention that reads host-side lengths changing every call (a
custom op over a CPU tensor), MoE routing with ``nonzero`` inside a break, a break whose output
changes shape, ``sizes=`` with breaks, an input the model writes, and memory of sizes x segments
in one pool."""

from __future__ import annotations

import gc
import logging
import math
import re

import pytest
import torch
import torch.nn as nn

import torchreplay as tr

import blocks
from memory import collector_off, reserved

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEV = "cuda"
H = 64
T = 8
CLOSE = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(autouse=True)
def full_fp32_matmul():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@torch.library.custom_op("trgpubreaks::host_attention", mutates_args=())
def host_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Row ``b`` attends to its first ``lengths[b]`` keys; ``lengths`` is on the host (a CPU
    tensor read with ``tolist``: a graph would freeze it). Rows past ``len(lengths)`` are 0."""
    out = torch.zeros_like(q)
    for b, n in enumerate(lengths.tolist()):
        if n > 0:
            s = (q[b] @ k[b, :n].transpose(0, 1)) / math.sqrt(q.shape[-1])
            out[b] = s.softmax(-1) @ v[b, :n]
    return out


@host_attention.register_fake
def _(q, k, v, lengths):
    return torch.empty_like(q)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(H, 3 * H)
        self.o = nn.Linear(H, H)

    def forward(self, x, lengths):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.o(torch.ops.trgpubreaks.host_attention(q, k, v, lengths))


class Block(blocks.Block):
    def __init__(self) -> None:
        super().__init__(Attention, H)


class Net(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(depth)])
        self.head = nn.Linear(H, 16)

    def forward(self, x, lengths):
        for b in self.blocks:
            x = b(x, lengths)
        return self.head(x)


def net(depth: int = 3) -> Net:
    torch.manual_seed(0)
    return Net(depth).to(DEV).eval()


def lengths_for(n: int) -> torch.Tensor:
    return torch.randint(1, T + 1, (n,))


@pytest.mark.parametrize("breaks", [[Attention], ["trgpubreaks.host_attention"]], ids=["class", "op"])
def test_host_lengths_change_every_call_and_match_eager(breaks) -> None:
    model = net()
    x = torch.randn(4, T, H, device=DEV)
    g = tr.graph(model, x, lengths_for(4), breaks=breaks)
    assert isinstance(g, tr.BreakableGraph)
    assert len(g.breaks) == 3 and g.stats.captures == 4  # 3 breaks, 4 segments
    for _ in range(25):
        x = torch.randn(4, T, H, device=DEV)
        lengths = lengths_for(4)
        with torch.no_grad():
            want = model(x, lengths)
        got = g(x, lengths)
        torch.testing.assert_close(got, want, **CLOSE)
    assert g.stats.replays == 25 and g.stats.fallbacks == 0
    rules = {r.path: r.kind for r in g.breaks[0].rules}
    assert rules["args[1]"] == "rebound" or rules.get("args[3]") == "rebound"
    if breaks != [Attention]:  # a custom op named as the break: its kernel called directly
        steps = [p.fn for p in g.runtime.program.pieces if not p.graphed]
        names = [getattr(getattr(f, "call", f), "__name__", "") for f in steps]
        assert names == ["direct_trgpubreaks_host_attention"] * 3, names


def route(x: torch.Tensor, logits: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Top-1 MoE dispatch: ``nonzero`` gives each expert its rows (data-dependent shapes)."""
    out = torch.zeros_like(x)
    choice = logits.argmax(-1)
    for e in range(w.shape[0]):
        rows = (choice == e).nonzero().squeeze(1)
        if rows.numel():
            out[rows] = torch.relu(x[rows] @ w[e])
    return out


class MoE(nn.Module):
    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(H, H)
        self.router = nn.Linear(H, experts)
        self.w = nn.Parameter(torch.randn(experts, H, H) / math.sqrt(H))
        self.out = nn.Linear(H, H)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = h + route(h, self.router(h), self.w)
        return self.out(h)


def test_moe_routing_with_nonzero_inside_a_break() -> None:
    torch.manual_seed(0)
    model = MoE().to(DEV).eval()
    x = torch.randn(32, H, device=DEV)
    with pytest.raises(tr.CaptureError):
        tr.graph(model, x)  # nonzero syncs: the whole model cannot be one graph
    g = tr.graph(model, x, breaks=[route])
    for _ in range(20):
        x = torch.randn(32, H, device=DEV)
        with torch.no_grad():
            want = model(x)
        torch.testing.assert_close(g(x), want, **CLOSE)
    assert g.stats.fallbacks == 0 and g.stats.captures == 2


def test_a_dropped_breakable_graph_is_freed_and_gives_its_memory_back() -> None:
    """30 builds and drops of a breakable graph: each one's runtime is freed, and the device's
    used memory stays flat (the pool's finalizer held every piecewise runtime through a bound
    method: none was ever freed)."""
    import weakref

    torch.manual_seed(0)
    model = MoE().to(DEV).eval()

    def used() -> int:
        gc.collect()
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return total - free

    samples = []
    for i in range(30):
        x = torch.randn(32, H, device=DEV)
        g = tr.graph(model, x, breaks=[route])
        with torch.no_grad():
            torch.testing.assert_close(g(x), model(x), **CLOSE)
        gone = weakref.ref(g.runtime)
        del g
        gc.collect()
        assert gone() is None, f"build {i}: the runtime is still alive"
        if i in (3, 29):
            samples.append(used())
    assert samples[1] - samples[0] < 8 * 2**20, f"grew by {(samples[1] - samples[0]) / 2**20:.1f} MiB"


def test_a_dropped_breakable_graph_goes_at_once_without_a_collection() -> None:
    """``del g`` frees a breakable graph, its runtime and its pool's memory at once: no
    reference cycle leaves them to Python's next full collection, which a serving process may
    not make for a long time (the front and its runtime held each other)."""
    import weakref

    torch.manual_seed(0)
    model = MoE().to(DEV).eval()
    x = torch.randn(32, H, device=DEV)
    g = tr.graph(model, x, breaks=[route])
    with torch.no_grad():
        torch.testing.assert_close(g(x), model(x), **CLOSE)
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    pool = g.stats.pool_bytes
    assert pool > 0
    gone, rt = weakref.ref(g), weakref.ref(g.runtime)
    with collector_off():
        del g
        assert gone() is None and rt() is None
        assert torch.cuda.memory_reserved() <= before - pool, (before, pool, torch.cuda.memory_reserved())


def trim(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    return x[: int(n)] * 2


class Trims(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(H, H)
        self.b = nn.Linear(H, H)

    def forward(self, x, n):
        return self.b(trim(self.a(x), n)).sum(0)


def test_a_break_whose_output_changes_shape_raises_naming_it_and_both_shapes() -> None:
    torch.manual_seed(0)
    model = Trims().to(DEV).eval()
    x = torch.randn(8, H, device=DEV)
    g = tr.graph(model, x, torch.tensor(5), breaks=[trim])
    with torch.no_grad():
        torch.testing.assert_close(g(x, torch.tensor(5)), model(x, torch.tensor(5)), **CLOSE)
    with pytest.raises(tr.ReplayInputError, match=r"break trim#0.*\(3, 64\).*\(5, 64\)"):
        g(x, torch.tensor(3))
    x = torch.randn(8, H, device=DEV)
    with torch.no_grad():  # still usable, and right, after the error
        torch.testing.assert_close(g(x, torch.tensor(5)), model(x, torch.tensor(5)), **CLOSE)


def test_weights_loaded_in_place_reach_the_segments_and_a_reloaded_model_raises() -> None:
    """Breaks: new weights loaded in place reach the graphed segments (equal to eager); a
    reload with new tensors raises ReplayInputError naming the first parameter."""
    torch.manual_seed(0)
    model = Trims().to(DEV).eval()
    g = tr.graph(model, torch.randn(8, H, device=DEV), torch.tensor(5), breaks=[trim])
    with torch.no_grad():
        for _ in range(3):
            model.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()})
            x = torch.randn(8, H, device=DEV)
            torch.testing.assert_close(g(x, torch.tensor(5)), model(x, torch.tensor(5)), **CLOSE)
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    with pytest.raises(tr.ReplayInputError, match="assign=True"):
        g(torch.randn(8, H, device=DEV), torch.tensor(5))


class CountingAttention(Attention):
    """A break that sets its own buffer anew at every call (as a KV cache module may)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x, lengths):
        self.calls = self.calls + 1
        return super().forward(x, lengths)


def test_a_break_setting_its_own_state_stays_graphed_and_a_replaced_layer_raises() -> None:
    """The breaks run eagerly and may set their own buffers per call: that is neither a change
    to the graphed segments nor a cost (their state is not watched). A layer of the segments
    replaced after capture, or a break module itself, raises ReplayInputError naming it."""
    torch.manual_seed(0)
    model = Net()
    for b in model.blocks:
        b.attn = CountingAttention()
    model = model.to(DEV).eval()
    g = tr.graph(model, torch.randn(4, T, H, device=DEV), lengths_for(4), breaks=[CountingAttention])
    seen = []
    with torch.no_grad():
        for _ in range(10):
            x, lengths = torch.randn(4, T, H, device=DEV), lengths_for(4)
            torch.testing.assert_close(g(x, lengths), model(x, lengths), **CLOSE)
            seen.append(g._placed.seen)
    assert len(set(seen)) == 1 and g.stats.fallbacks == 0  # no change counted, no slow check
    calls = model.blocks[0].attn.calls
    model.blocks[1].mlp = nn.Sequential(nn.Linear(H, H)).to(DEV)
    with pytest.raises(tr.ReplayInputError, match=r"submodule 'blocks\.1\.mlp' was replaced"):
        g(torch.randn(4, T, H, device=DEV), lengths_for(4))
    assert model.blocks[0].attn.calls is calls  # raised before any break ran
    g2 = tr.graph(model, torch.randn(4, T, H, device=DEV), lengths_for(4), breaks=[CountingAttention])
    model.blocks[2].attn = CountingAttention().to(DEV)
    with pytest.raises(tr.ReplayInputError, match=r"submodule 'blocks\.2\.attn' was replaced"):
        g2(torch.randn(4, T, H, device=DEV), lengths_for(4))


def test_sizes_with_breaks_pad_and_slice_back_every_size() -> None:
    model = net()
    sizes = [1, 2, 4, 8, 16, 32]
    x = torch.randn(5, T, H, device=DEV)
    g = tr.graph(model, x, lengths_for(5), breaks=[Attention], sizes=sizes)
    # Sizes below the sample's 5 rows would see its 5 host lengths: captured at first use.
    assert g.stats.captures == 4 * 3
    gen = torch.Generator().manual_seed(1)
    for n in [1, 3, 32, 7, 16, 2, 9, 31, 4, 17, 1, 5]:
        x = torch.randn(n, T, H, device=DEV)
        lengths = torch.randint(1, T + 1, (n,), generator=gen)
        with torch.no_grad():
            want = model(x, lengths)
        got = g(x, lengths)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert g.stats.fallbacks == 0 and g.stats.captures == 4 * len(sizes)
    with torch.no_grad():  # above the largest size: eager, counted
        x = torch.randn(40, T, H, device=DEV)
        lengths = lengths_for(40)
        torch.testing.assert_close(g(x, lengths), model(x, lengths), **CLOSE)
    assert g.stats.fallbacks == 1


def test_sizes_options_with_breaks_capture_lazy_fallback_error_max_graphs() -> None:
    model = net(2)
    gen = torch.Generator().manual_seed(3)

    def call(g, n):
        x = torch.randn(n, T, H, device=DEV)
        lengths = torch.randint(1, T + 1, (n,), generator=gen)
        with torch.no_grad():
            want = model(x, lengths)
        torch.testing.assert_close(g(x, lengths), want, rtol=1e-4, atol=1e-5)

    # capture="lazy": only the largest size now, each other size at its first call;
    # max_graphs=3: a size that would need a fourth graph runs eagerly, counted.
    x = torch.randn(8, T, H, device=DEV)
    g = tr.graph(model, x, lengths_for(8), breaks=[Attention], sizes=[1, 2, 4, 8],
                 capture="lazy", max_graphs=3)
    assert g.runtime.captured_sizes() == [8]
    for n in (3, 4, 8, 2):
        call(g, n)
    assert sorted(g.runtime.captured_sizes()) == [2, 4, 8] and g.stats.fallbacks == 0
    call(g, 1)  # size 1 would be a fourth graph: eager
    assert sorted(g.runtime.captured_sizes()) == [2, 4, 8] and g.stats.fallbacks == 1
    assert any("max_graphs=3" in r for r in g.runtime.fallback_reasons), g.runtime.fallback_reasons
    # fallback="error": above the largest size raises, naming the size; within, graphs as usual.
    h = tr.graph(model, x, lengths_for(8), breaks=[Attention], sizes=[4, 8], fallback="error")
    call(h, 6)
    with pytest.raises(tr.ReplayInputError, match="got size 9"):
        call(h, 9)
    assert h.stats.fallbacks == 0



def test_segments_times_sizes_share_one_pool() -> None:
    """The pool of 9 sizes x 5 segments is the pool of the largest size alone (what the breaks
    read is held without owning it, so each size reuses the memory of the one before)."""
    model = net(4)
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64]
    x = torch.randn(1, 256, H, device=DEV)  # one row: every size is captured ahead
    lengths = torch.randint(1, 257, (1,))
    pools = []
    for s in ([64], sizes):
        reserved()
        g = tr.graph(model, x, lengths, breaks=[Attention], sizes=s)
        assert g.stats.captures == 5 * len(s)
        pools.append(g.runtime.pool.reserved_bytes())
        del g
    one, many = pools
    print(f"pool: largest size alone {one / 2**20:.1f} MiB, {len(sizes)} sizes {many / 2**20:.1f} MiB")
    assert many <= 1.2 * one, (one, many)


class Cached(nn.Module):
    """Writes its cache argument in place (inside and outside the break) and returns it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x, cache, lengths):
        h = self.lin(x)
        cache.mul_(0.5).add_(h)
        return torch.ops.trgpubreaks.host_attention(h, cache, cache, lengths) + cache


def test_an_input_the_model_writes_reaches_the_callers_tensor() -> None:
    torch.manual_seed(0)
    model = Cached().to(DEV).eval()
    cache = torch.randn(2, T, H, device=DEV)
    g = tr.graph(model, torch.randn(2, T, H, device=DEV), cache.clone(), lengths_for(2),
                 breaks=["trgpubreaks.host_attention"])
    for _ in range(10):
        x = torch.randn(2, T, H, device=DEV)
        lengths = lengths_for(2)
        mine, theirs = cache.clone(), cache.clone()
        with torch.no_grad():
            want = model(x, theirs, lengths)
        got = g(x, mine, lengths)
        torch.testing.assert_close(got, want, **CLOSE)
        torch.testing.assert_close(mine, theirs, **CLOSE)
        cache = theirs


def first_break(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    return x * lengths.to(x.device, non_blocking=False).view(-1, 1).float()


class Leading(nn.Module):
    """Begins with a break (segment 0 records nothing) and calls two breaks in a row."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x, lengths):
        h = first_break(x, lengths)
        h = first_break(h, lengths)
        return self.lin(h)


def test_empty_segments_and_breaks_in_a_row() -> None:
    torch.manual_seed(0)
    model = Leading().to(DEV).eval()
    g = tr.graph(model, torch.randn(4, H, device=DEV), torch.arange(4), breaks=[first_break])
    assert g.stats.captures == 1  # only the last segment recorded work
    assert g.stats.graph_copies == 0  # (a break first: the call's tensor is copied by a launch)
    for _ in range(10):
        x, lengths = torch.randn(4, H, device=DEV), torch.randint(0, 9, (4,))
        with torch.no_grad():
            torch.testing.assert_close(g(x, lengths), model(x, lengths), **CLOSE)


def test_checked_outputs_and_errors() -> None:
    model = net(1)
    x = torch.randn(2, T, H, device=DEV)
    g = tr.graph(model, x, lengths_for(2), breaks=[Attention])
    kept = g(x, lengths_for(2)).clone()
    first = g(x, torch.full((2,), T))
    first_value = first.clone()
    g(torch.randn(2, T, H, device=DEV), lengths_for(2))
    with pytest.raises(RuntimeError, match="StaleOutputError"):
        first.sum().item()
    assert kept.shape == first_value.shape
    with pytest.raises(tr.CaptureError, match="never ran during the sample call"):
        tr.graph(model, x, lengths_for(2), breaks=[nn.Conv2d])
    with pytest.raises(tr.UnsupportedError, match=r"args\[2\] 'unused' is a CPU tensor that no break"):
        tr.graph(two, torch.randn(4, H, device=DEV), torch.arange(4), torch.ones(2), breaks=[first_break])


def two(x, lengths, unused):
    return first_break(x, lengths) * 2


def _llama_with_random_caches(n_layers: int, max_seq_len: int, max_batch: int):
    """The built-in Llama (fp32, small), its KV caches filled with noise, and a maker of
    decode-step arguments of ``n`` rows (ids, positions, host lengths ``positions + 1``)."""
    from torchreplay.models.llama import LlamaConfig, build_llama

    cfg = LlamaConfig(n_layers=n_layers, dim=128, n_heads=8, n_kv_heads=2, vocab_size=500,
                      intermediate_size=256, max_seq_len=max_seq_len, max_batch=max_batch)
    model = build_llama(cfg, DEV, torch.float32, seed=0)
    caches = [c for layer in model.layers for c in (layer.attention.k_cache, layer.attention.v_cache)]
    with torch.no_grad():
        for c in caches:
            c.normal_()
    gen = torch.Generator().manual_seed(0)

    def step(n: int):
        positions = torch.randint(0, cfg.max_seq_len, (n,), generator=gen)
        ids = torch.randint(0, cfg.vocab_size, (n, 1), generator=gen)
        return ids.to(DEV), positions.to(DEV), positions + 1

    return model, caches, step


def test_builtin_llama_with_host_lengths_decodes_like_eager_at_every_size() -> None:
    from torchreplay.models.llama import host_attention

    model, caches, step = _llama_with_random_caches(3, max_seq_len=64, max_batch=8)
    g = tr.graph(model, *step(1), breaks=[host_attention], sizes=[1, 2, 4, 8])
    assert len(g.breaks) == 3 and g.stats.captures == 4 * 4
    for n in [1, 5, 8, 3, 2, 7, 4, 6, 1, 8]:
        args = step(n)
        before = [c.clone() for c in caches]
        with torch.no_grad():
            want = model(*args)
        after = [c.clone() for c in caches]
        with torch.no_grad():
            for c, b in zip(caches, before):
                c.copy_(b)
        got = g(*args)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for c, a in zip(caches, after):  # the real rows' cache writes are eager's
            torch.testing.assert_close(c[:n], a[:n])
    assert g.stats.fallbacks == 0


class Clip(nn.Module):
    """Reads a value on the host: the graph of a whole model with it cannot be captured."""

    def forward(self, x):
        limit = float(x.abs().max().item())
        return x.clamp(-limit / 2, limit / 2)


class WithItem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(H, H)
        self.clip = Clip()
        self.b = nn.Linear(H, H)

    def forward(self, x):
        return self.b(self.clip(torch.relu(self.a(x))))


def _clips_like_eager(model: nn.Module, g, calls: int) -> None:
    """``g`` (``model`` broken at its ``clip``) equals eager over fresh inputs of other scales,
    two segments captured, no call eager."""
    for _ in range(calls):
        x = torch.randn(16, H, device=DEV) * torch.rand(1, device=DEV) * 4
        with torch.no_grad():
            want = model(x)
        torch.testing.assert_close(g(x), want, **CLOSE)
    assert g.stats.fallbacks == 0 and g.stats.captures == 2


def test_auto_breaks_at_the_item_and_explain_lists_it() -> None:
    torch.manual_seed(0)
    model = WithItem().to(DEV).eval()
    x = torch.randn(16, H, device=DEV)
    with pytest.raises(tr.CaptureError, match=r"breaks=\[model.get_submodule\('clip'\)\]\) or breaks=\"auto\""):
        tr.graph(model, x)  # the capture error says which breaks= would work
    g = tr.graph(model, x, breaks="auto")
    assert [b.path for b in g.auto] == ["clip"] and "item" in g.auto[0].op
    _clips_like_eager(model, g, calls=20)
    text = tr.explain(g)
    assert "break 0: clip" in text and "auto: Tensor.item (host-sync) at" in text
    assert "test_breaks.py:" in text


def test_a_model_whose_every_op_runs_inside_its_breaks_is_refused_saying_so() -> None:
    """Every op inside a break leaves nothing to graph: the capture's error said "it ran on the
    CPU or on another device; move the module ... to cuda", advice that does not apply. It
    says what happened now, and what to do."""
    model = nn.Sequential(Clip()).to(DEV).eval()
    with pytest.raises(tr.CaptureError, match="recorded no CUDA work outside its breaks.*every op ran inside a break") as e:
        tr.graph(model, torch.randn(16, H, device=DEV), breaks=[Clip])
    assert "move the module" not in str(e.value)


class SkipsUnderCapture(WithItem):
    """transformers' mask functions test their input on the host unless a capture is running
    (``is_tracing``); eagerly that test is a sync in the model's own code, outside every
    submodule. Only ``clip`` fails a capture."""

    def forward(self, x):
        if not torch.cuda.is_current_stream_capturing() and bool((x[:, 0] == 12345).all()):
            return x  # (never, as a packed mask that is all zeros)
        return super().forward(x)


def test_what_code_skips_under_capture_is_neither_the_error_nor_a_break() -> None:
    """The check runs eagerly and sees the top-level test first: the capture error named it
    (and a break there is the whole model, graphed nothing). The error now names the line where
    the capture failed, and ``breaks="auto"`` breaks at ``clip``: a trial capture passed the
    test."""
    torch.manual_seed(0)
    model = SkipsUnderCapture().to(DEV).eval()
    x = torch.randn(16, H, device=DEV)
    with pytest.raises(tr.CaptureError) as info:
        tr.graph(model, x)
    text = str(info.value)
    assert "Tensor.item" in text and "limit = float(x.abs().max().item())" in text, text
    assert "breaks=[model.get_submodule('clip')]" in text, text
    g = tr.graph(model, x, breaks="auto")
    assert [b.path for b in g.auto] == ["clip"]
    _clips_like_eager(model, g, calls=10)


def test_hf_mixtral_auto_breaks_at_its_experts_and_graphs_the_rest() -> None:
    """HF Mixtral in float32: the mask function's host test (skipped under capture) and the
    experts' ``grouped_mm``, which copies to the host inside its kernel (no op the check knows).
    Before, the capture error named the mask's line and ``breaks="auto"`` broke at the whole
    model."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, num_local_experts=4, num_experts_per_tok=2)
    model = transformers.MixtralForCausalLM(cfg).to(DEV).eval()
    ids = torch.randint(0, 512, (2, 16), device=DEV)
    with pytest.raises(tr.CaptureError, match=r"failed at \S*moe\.py:\d+ .*grouped_mm") as info:
        tr.graph(model, ids, use_cache=False)
    assert "masking_utils" not in str(info.value)
    assert "would break at model.layers.0.mlp.experts" in str(info.value)  # (the suggestion)
    g = tr.graph(model, ids, use_cache=False, breaks="auto")
    assert [b.path for b in g.auto] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for _ in range(10):
        ids = torch.randint(0, 512, (2, 16), device=DEV)
        with torch.no_grad():
            want = model(ids, use_cache=False).logits
        torch.testing.assert_close(g(ids, use_cache=False).logits, want, **CLOSE)
    assert g.stats.fallbacks == 0


def centre(x: torch.Tensor) -> torch.Tensor:
    return x - x.mean(0)  # every row reads the others: the padding rows too


class Centred(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(H, H), nn.Linear(H, H)

    def forward(self, x):
        return self.b(centre(self.a(x)))


def test_padding_a_break_reads_is_reported_and_breaks_that_read_their_rows_are_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The first capture runs the sample padded to the largest size for real: its real rows
    against the sample call's (sizes/probe.py, breaks/sized.py)."""
    caplog.set_level(logging.WARNING, logger="torchreplay")

    def reports() -> list[str]:
        return [r.getMessage() for r in caplog.records if "padding changes" in r.getMessage()]

    model = net()
    x = torch.randn(5, T, H, device=DEV)
    g = tr.graph(model, x, lengths_for(5), breaks=[Attention], sizes=[4, 8, 16], capture="lazy")
    assert reports() == []  # each row attends to its own keys, over its own length
    assert g.stats.padding_check.startswith("rows independent: 5 rows padded to 16"), tr.explain(g)
    assert "padding check: rows independent" in tr.explain(g)

    torch.manual_seed(0)
    m = Centred().to(DEV).eval()
    g = tr.graph(m, torch.randn(3, H, device=DEV), breaks=[centre], sizes=[4, 8])
    (report,) = reports()
    assert "of a call of 3 rows" in report and "padded to 8" in report
    assert "a break gets the padded rows" in report
    assert g.stats.padding_check.startswith("CHANGES the result: output of 3 rows padded to 8")
    with torch.no_grad():  # exact sizes are not padded: eager-equal
        x = torch.randn(8, H, device=DEV)
        torch.testing.assert_close(g(x), m(x), **CLOSE)


def doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0  # (row by row: a break that reads only its rows)


class RowCounted(nn.Module):
    """A segment after the break counts the rows (padded: the padding rows too) and keeps each
    call's rows in a per-row buffer (padded: rows past the call's too)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(H, H)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long, device=DEV))
        self.register_buffer("rows", torch.full((8, H), -1.0, device=DEV))

    def forward(self, x):
        y = doubled(self.a(x))
        self.seen.add_(y.shape[0])
        self.rows[: y.shape[0]].copy_(y)
        return y + 1.0


def test_padding_that_changes_state_is_reported_at_the_first_capture(caplog: pytest.LogCaptureFixture) -> None:
    """What the sample call (unpadded) and the first capture's run (padded, its segments
    replayed for real) leave in module buffers: the count that follows the padded size is a
    warning, the padding rows' own buffer rows a note. Outputs equal eager at every size."""
    caplog.set_level(logging.WARNING, logger="torchreplay")
    torch.manual_seed(0)
    m, ref = RowCounted().to(DEV).eval(), RowCounted().to(DEV).eval()
    ref.load_state_dict(m.state_dict())
    g = tr.graph(m, torch.randn(3, H, device=DEV), breaks=[doubled], sizes=[4, 8])
    summary = g.stats.padding_check
    assert summary.startswith("CHANGES state: RowCounted.seen: 1 of the 1 elements both write differ"), summary
    assert "the padding rows also write RowCounted.rows (" in summary, summary
    (report,) = [r.getMessage() for r in caplog.records if "padding changes the state" in r.getMessage()]
    assert "RowCounted.seen" in report and "RowCounted.rows" not in report, report
    assert [r for r in caplog.records if "padding changes what" in r.getMessage()] == []
    assert m.seen.item() == 0 and torch.equal(m.rows, ref.rows)  # the build put them back
    with torch.no_grad():
        for n in (4, 8, 3, 8, 4):
            x = torch.randn(n, H, device=DEV)
            torch.testing.assert_close(g(x), ref(x), **CLOSE)
        torch.testing.assert_close(m.rows[:4], ref.rows[:4], **CLOSE)  # the last call's rows


class RowsOut(nn.Module):
    """Returns the leading rows of a fixed 8-row buffer, ``rows[: n]``: 8 rows at size 16."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(H, H)
        self.register_buffer("rows", torch.randn(8, H, device=DEV))

    def forward(self, x):
        y = doubled(self.a(x))
        return y, self.rows[: y.shape[0]] * 2.0


def test_an_output_of_a_buffers_leading_rows_has_eagers_shape(caplog: pytest.LogCaptureFixture) -> None:
    """sizes 4, 8, 16 with an 8-row buffer: a call of 3 rows gets 3 of its rows (it got the
    padded 4 before), a call of 10 gets 8, as eager. No padding warning."""
    caplog.set_level(logging.WARNING, logger="torchreplay")
    torch.manual_seed(0)
    m = RowsOut().to(DEV).eval()
    g = tr.graph(m, torch.randn(3, H, device=DEV), breaks=[doubled], sizes=[4, 8, 16])
    assert g.stats.padding_check.startswith("rows independent"), g.stats.padding_check
    with torch.no_grad():
        for n in (3, 10, 16, 1, 5, 8, 13):
            x = torch.randn(n, H, device=DEV)
            (y, r), (y_ref, r_ref) = g(x), m(x)
            assert r.shape == r_ref.shape, (n, r.shape, r_ref.shape)
            torch.testing.assert_close(y, y_ref, **CLOSE)
            torch.testing.assert_close(r, r_ref, **CLOSE)
    assert [r for r in caplog.records if "padding changes" in r.getMessage()] == []


def test_a_cache_too_large_to_copy_is_refused_and_restore_state_false_builds_in_what_is_left() -> None:
    """A breakable build copies the module's buffers to put them back after its captures (they
    replay their segments for real). With the device nearly full, as a serving engine leaves it
    after sizing its KV cache, that copy does not fit: a CaptureError naming the cache and
    ``restore_state=False``, the caches as they were. With ``restore_state=False`` the build
    copies no cache and fits in what is left (512 MiB), and the graph decodes like eager."""
    from torchreplay.models.llama import host_attention

    model, caches, step = _llama_with_random_caches(4, max_seq_len=16384, max_batch=64)
    cache_bytes = sum(c.nbytes for c in caches)
    assert cache_bytes == 2**30
    # the default fits here: built and put back, bit for bit
    before = [c.clone() for c in caches]
    g = tr.graph(model, *step(1), breaks=[host_attention], sizes=[1, 2, 4, 8])
    assert all(torch.equal(c, b) for c, b in zip(caches, before))
    del g, before
    with torch.no_grad():
        model(*step(8))  # (the library handles of the sizes, made before the device fills)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    filler = torch.empty(free - 512 * 2**20, dtype=torch.uint8, device=DEV)  # 512 MiB left
    try:
        before = [c.clone() for c in caches[:1]]  # (a clone of one: 128 MiB of what is left)
        with pytest.raises(tr.CaptureError, match="restore_state=False") as err:
            tr.graph(model, *step(1), breaks=[host_attention], sizes=[1, 2, 4, 8])
        assert re.search(r"layers\.\d\.attention\.[kv]_cache \(128 MiB\)", str(err.value)), err.value
        assert torch.equal(caches[0], before[0])
        del before, err
        config = tr.config.GraphConfig(restore_state=False)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        g = tr.graph(model, *step(1), breaks=[host_attention], sizes=[1, 2, 4, 8], config=config)
        peak = torch.cuda.max_memory_allocated() - base
        assert peak < cache_bytes // 2, (peak, cache_bytes)  # no copy of the caches
        for n in [1, 5, 8, 3, 2, 7, 4, 6]:
            args = step(n)
            with torch.no_grad():
                want = model(*args)  # (writes the same rows the graph then writes again)
            got = g(*args)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert g.stats.fallbacks == 0 and g.stats.replays == 8
    finally:
        del filler
        torch.cuda.empty_cache()


def _write_rows(cache: torch.Tensor, pos: torch.Tensor, h: torch.Tensor) -> None:
    """A break that writes a cache where no version counter shows it (through ``.data``), as a
    kernel launched outside an aten op (flash-attention's KV-cache write) would."""
    cache.data.index_copy_(0, pos, h)


class _ReadTableWriteCache(nn.Module):
    """A 1 GiB buffer only read (a quantized model's packed weights, a lookup table) and a
    cache the break writes at the call's positions."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(256, 256)
        self.register_buffer("table", torch.randn(1 << 20, 256))
        self.register_buffer("cache", torch.randn(1 << 14, 256))  # 16 MiB

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) + self.table[pos]
        _write_rows(self.cache, pos, h)
        return h * 2 + self.cache[:64].sum(0)


def test_a_large_buffer_only_read_is_not_copied_and_one_a_break_writes_is_put_back(caplog) -> None:
    """A breakable build copies whole the large buffers its sample call wrote, to put them back
    after its captures: the cache, though its break writes it where no version counter shows
    (the checksum of its contents sees it). The 1 GiB table the model only reads is not
    copied: the default build fits in 512 MiB left free, where a copy of the table would not.
    The first calls write other rows than the sample's: the caches equal eager's after every
    call (the build's writes at the sample's rows were put back), and so do the outputs."""
    import copy

    caplog.set_level(logging.WARNING, logger="torchreplay")
    torch.manual_seed(0)
    model = _ReadTableWriteCache().to(DEV)
    ref = copy.deepcopy(model)
    assert model.table.nbytes == 2**30
    perm = torch.randperm(1 << 14, device=DEV)
    sample = (torch.randn(4, 256, device=DEV), perm[:4])
    with torch.no_grad():
        copy.deepcopy(model)(*sample)  # (the library handles, made before the device fills)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    filler = torch.empty(torch.cuda.mem_get_info()[0] - 512 * 2**20, dtype=torch.uint8, device=DEV)
    try:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        g = tr.graph(model, *sample, breaks=[_write_rows])
        assert torch.cuda.max_memory_allocated() - base < 2**28  # no copy of the table
        assert torch.equal(model.cache, ref.cache)  # the sample's and captures' writes put back
        for k in range(8):
            pos = perm[4 * (k + 1):4 * (k + 2)]  # (rows the sample did not write)
            x = torch.randn(4, 256, device=DEV)
            with torch.no_grad():
                want = ref(x, pos)
            torch.testing.assert_close(g(x, pos), want, **CLOSE)
            torch.testing.assert_close(model.cache, ref.cache, **CLOSE)
        assert g.stats.replays == 8 and g.stats.fallbacks == 0
        assert torch.equal(model.table, ref.table)
        assert not [r for r in caplog.records if "the captures wrote" in r.getMessage()]
    finally:
        del filler
        torch.cuda.empty_cache()


def _write_first_row(cache: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    cache[0, : h.shape[-1]].copy_(h[0])
    return h * 2


class _CacheArg(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x, cache):
        return self.lin(_write_first_row(cache, self.lin(x)))


def test_a_cache_argument_too_large_to_copy_is_refused_naming_it_and_the_process_goes_on() -> None:
    """The sample call runs on copies of the caller's tensors; a 1 GiB cache argument with
    512 MiB left is a CaptureError naming it, not CUDA's out-of-memory error."""
    model = _CacheArg().to(DEV)
    cache = torch.randn(2**18, 1024, device=DEV)  # 1 GiB
    x = torch.randn(4, H, device=DEV)
    before = cache[:2].clone()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    filler = torch.empty(torch.cuda.mem_get_info()[0] - 512 * 2**20, dtype=torch.uint8, device=DEV)
    try:
        with pytest.raises(tr.CaptureError, match=r"the sample's tensor arguments.*args\[1\] 'cache' \(1\.00 GiB\)"):
            tr.graph(model, x, cache, breaks=[_write_first_row])
    finally:
        del filler
        torch.cuda.empty_cache()
    assert torch.equal(cache[:2], before)
    small = torch.randn(8, 1024, device=DEV)
    g = tr.graph(model, x, small, breaks=[_write_first_row])
    want_cache = small.clone()
    with torch.no_grad():
        want = model(x, want_cache)
    torch.testing.assert_close(g(x, small), want)
    torch.testing.assert_close(small, want_cache)
