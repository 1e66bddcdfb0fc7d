"""Python state a graphed call changes at every call (core/effects.py): a replay runs no Python,
so such a change (a cache object grown by replacing its tensors, as HF's ``DynamicCache``; a
counter; a recurrent state on an object) happened at capture only and every replay read the
capture's state, silently. Capture now refuses it with the path, and puts the state back; a
tensor set but not read (``self.last = y``) keeps eager values with one warning; small tensors
advanced in place (HF ``StaticCache``'s position) are put back after the build. Each test
compares with eager over many calls with fresh inputs; real models graph as before."""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
from typing import Any

import pytest
import torch
import torch.nn as nn

import torchreplay as tr
from adapters import Lora
from torchreplay.errors import CaptureError, ReplayInputError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEV = "cuda"
CALLS = 8
LOG = "torchreplay.core.effects"


class Cache:
    """DynamicCache's shape: each call replaces ``keys`` by a longer tensor and reads it."""

    def __init__(self) -> None:
        self.keys = torch.randn(3, 16, device=DEV)

    def update(self, k: torch.Tensor) -> torch.Tensor:
        self.keys = torch.cat([self.keys, k])
        return self.keys


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x)


@pytest.mark.parametrize("front", ["graph", "make_graphed_callables"])
def test_a_cache_object_grown_at_every_call_is_refused_and_left_as_it_was(front) -> None:
    cache = Cache()
    first = cache.keys
    lin = nn.Linear(16, 16, device=DEV)

    def step(k: torch.Tensor) -> torch.Tensor:
        return lin(cache.update(k)).mean(0)

    k = torch.randn(1, 16, device=DEV, requires_grad=front != "graph")
    with pytest.raises(CaptureError, match=r"cache\.keys: tensor\(\d+, 16\)"):
        if front == "graph":
            tr.graph(step, k)
        else:
            tr.make_graphed_callables(step, (k,))
    assert cache.keys is first  # neither the warm-ups nor the capture grew it


def train_step_of(m: nn.Module) -> Any:
    """An AdamW training step over ``m`` (capturable, fused), returning the loss."""
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, capturable=True, fused=True)

    def train_step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = m(x).square().mean()
        loss.backward()
        opt.step()
        return loss

    return train_step


def graph_by(front: str, m: nn.Module, x: torch.Tensor) -> Any:
    """Graph ``m`` at ``x`` through one front: tr.graph, its sizes=, make_graphed_callables, or
    graph_step of a training step over it (:func:`train_step_of`); return what it made."""
    if front == "graph":
        return tr.graph(m, x)
    if front == "sizes":
        return tr.graph(m, x, sizes=[2, 4])
    if front == "make_graphed_callables":
        return tr.make_graphed_callables(m, (x.requires_grad_(),))
    return tr.graph_step(train_step_of(m), x)


@pytest.mark.parametrize("front", ["graph", "sizes", "make_graphed_callables", "graph_step"])
def test_a_counter_is_refused_by_every_front_and_put_back(front) -> None:
    m = Counter().to(DEV)
    with pytest.raises(CaptureError, match=r"(Counter|m)\.calls: \d+ -> \d+"):
        graph_by(front, m, torch.randn(4, 16, device=DEV))
    assert m.calls == 0


class BufferCounter(nn.Module):
    """Counts its calls in a registered buffer off the graph's device: on the CPU (registered
    after ``.to``), or on a second GPU, whose kernels run on that device's own stream."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16, device=DEV)
        self.register_buffer("seen", torch.zeros(1, device=where))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(1)
        return self.lin(x)


@pytest.mark.parametrize("where", ["cpu", "cuda:1"])
@pytest.mark.parametrize("front", ["graph", "sizes", "make_graphed_callables", "graph_step"])
def test_a_buffer_off_the_graphs_device_written_at_every_call_is_refused_and_put_back(front, where) -> None:
    """Eagerly each call counts; a replay runs only the graph's device work and would leave the
    counter where the capture left it, silently (two-GPU probe, session 77: 0 against eager's
    4). Refused, naming the buffer and its device; the count the build made is put back."""
    if where == "cuda:1" and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    m = BufferCounter(where)
    with pytest.raises(CaptureError, match=rf"not on the graph's device.*seen \(a torch.float32 tensor\(1,\) on {where}\)"):
        graph_by(front, m, torch.randn(4, 16, device=DEV))
    assert m.seen.item() == 0


def test_check_names_work_on_a_second_gpu_that_a_graph_would_not_record() -> None:
    """``tr.check`` of a call on cuda:0 that also writes a buffer on cuda:1 (no op mixes the
    two devices, so no capture fails): one "multi-device" finding at that line."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    m = BufferCounter("cuda:1")
    report = tr.check(m, torch.randn(4, 16, device=DEV))
    kinds = [(f.kind, f.op, f.code) for f in report]
    assert kinds == [("multi-device", "aten.add_", "self.seen.add_(1)")], kinds
    assert tr.check(BufferCounter(DEV), torch.randn(4, 16, device=DEV)).findings == []


class HostCounter(nn.Module):
    """Counts its calls in a CPU tensor kept as a plain attribute: ``.to(DEV)`` leaves it there."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.calls = torch.zeros((), dtype=torch.long)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x)


@pytest.mark.parametrize("front", ["graph", "sizes", "make_graphed_callables", "graph_step"])
def test_a_counter_kept_on_the_cpu_is_refused_and_put_back(front) -> None:
    """A replay runs only the GPU's work: the CPU counter would stop at the capture's count,
    where eagerly each call adds one. Refused, naming it; the counter is as it was; the same
    model with the counter on the GPU (written by the graph at every replay) counts as eager."""
    m = HostCounter().to(DEV)
    x = torch.randn(4, 16, device=DEV)
    with pytest.raises(CaptureError, match=r"not on the graph's device.*calls \(a torch.int64 tensor\(\) on cpu\)"):
        graph_by(front, m, x)
    assert int(m.calls) == 0
    m.calls = m.calls.to(DEV)
    g = tr.graph(m, x.detach())
    for _ in range(CALLS):
        xi = torch.randn(4, 16, device=DEV)
        torch.testing.assert_close(g(xi), m.lin(xi))
    assert int(m.calls) == CALLS


class HostScratch(nn.Module):
    """Fills a CPU scratch tensor, a plain attribute, with the same values at every call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.scratch = torch.zeros(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.mul(torch.arange(3.0), 2, out=self.scratch)
        return self.lin(x)


@pytest.mark.parametrize("front", ["graph", "sizes", "make_graphed_callables", "graph_step"])
def test_a_cpu_scratch_is_graphed_once_it_holds_what_each_call_fills_in(front) -> None:
    """Eagerly the first call fills the scratch and each later one writes the same values
    again. Built before any eager call, a graph is refused, naming it and the fix: a replay
    would leave it empty (the build puts it back as it was). After one eager call, every front
    graphs the model, equal to eager over many calls, and the scratch stays filled."""
    torch.manual_seed(0)
    m = HostScratch().to(DEV)
    x = torch.randn(4, 16, device=DEV)
    with pytest.raises(CaptureError, match=r"scratch \(a torch.float32 tensor\(3,\) on cpu\).*once eagerly"):
        graph_by(front, m, x.detach().clone())
    assert m.scratch.tolist() == [0.0, 0.0, 0.0]  # as it was
    with torch.no_grad():
        m(x)
    ref = copy.deepcopy(m)
    g = graph_by(front, m, x.detach().clone())
    ref_step = train_step_of(ref) if front == "graph_step" else None
    for i in range(CALLS):
        xi = torch.randn(3 if front == "sizes" and i % 2 else 4, 16, device=DEV)
        if front in ("graph", "sizes"):
            with torch.no_grad():
                torch.testing.assert_close(g(xi), ref(xi))
        elif front == "make_graphed_callables":
            a, b = xi.clone().requires_grad_(), xi.clone().requires_grad_()
            out, want = g(a), ref(b)
            torch.testing.assert_close(out, want)
            out.square().sum().backward()
            want.square().sum().backward()
            torch.testing.assert_close(a.grad, b.grad)
        else:
            torch.testing.assert_close(g(xi), ref_step(xi))
            for p, q in zip(m.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q)
        assert m.scratch.tolist() == ref.scratch.tolist() == [0.0, 2.0, 4.0]
    stats = g.forward.stats if isinstance(g, nn.Module) else g.stats  # (a module graphed in place)
    assert stats.replays == CALLS and stats.fallbacks == 0


class HostScale(nn.Module):
    """Scales by a CPU tensor kept as a plain attribute (``.to(DEV)`` leaves it), read on the
    host by ``.item()``: a graph keeps the value it read at capture."""

    def __init__(self, read: str = "item") -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.scale = torch.tensor(2.0)
        self.read = read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (.tolist() reads with no op to dispatch: a torch function mode sees it)
        return self.lin(x) * (self.scale.item() if self.read == "item" else self.scale.tolist())


@pytest.mark.parametrize("front,read", [
    ("graph", "item"), ("sizes", "item"), ("make_graphed_callables", "item"), ("graph", "tolist"),
])
def test_a_cpu_value_read_on_the_host_replays_until_written_then_raises(front, read) -> None:
    """Replays equal eager while the value stays; written in place since (eagerly the next call
    reads the new value, a replay would keep the capture's), the next call raises naming it."""
    torch.manual_seed(0)
    m = HostScale(read).to(DEV)
    again = copy.deepcopy(m)  # (graphed again below: make_graphed_callables graphs m in place)
    g = graph_by(front, m, torch.randn(4, 16, device=DEV))
    for i in range(CALLS):
        xi = torch.randn(3 if front == "sizes" and i % 2 else 4, 16, device=DEV)
        with torch.no_grad() if front != "make_graphed_callables" else contextlib.nullcontext():
            torch.testing.assert_close(g(xi), m.lin(xi) * 2.0)
    m.scale.fill_(3.0)
    written = r"scale \(a torch.float32 tensor\(\) on cpu\) was written in place since.*on the host"
    with pytest.raises(ReplayInputError, match=written):
        g(torch.randn(4, 16, device=DEV))
    again.scale.fill_(3.0)
    g = graph_by(front, again, torch.randn(4, 16, device=DEV))  # graphed again: the new value
    xi = torch.randn(4, 16, device=DEV)
    with torch.no_grad() if front != "make_graphed_callables" else contextlib.nullcontext():
        torch.testing.assert_close(g(xi), again.lin(xi) * 3.0)


def test_a_recurrent_state_object_is_refused_and_the_fix_replays_eager_equal() -> None:
    cell = nn.GRUCell(16, 16, device=DEV)

    class State:
        def __init__(self) -> None:
            self.h = torch.zeros(2, 16, device=DEV)

    state = State()
    h0 = state.h
    with torch.no_grad():
        def step(x: torch.Tensor, s: State) -> torch.Tensor:
            s.h = cell(x, s.h)
            return s.h

        with pytest.raises(CaptureError, match=r"args\[1\]\.h"):
            tr.graph(step, torch.randn(2, 16, device=DEV), state)
        assert state.h is h0

        # the fix the message names: state written in place, which the graph replays
        def step_in_place(x: torch.Tensor, s: State) -> torch.Tensor:
            s.h.copy_(cell(x, s.h))
            return s.h.clone()

        g = tr.graph(step_in_place, torch.randn(2, 16, device=DEV), state)
        ref = State()
        for _ in range(CALLS):
            x = torch.randn(2, 16, device=DEV)
            torch.testing.assert_close(g(x, state), step_in_place(x, ref))
            torch.testing.assert_close(state.h, ref.h)


def test_an_attribute_set_but_not_read_keeps_eager_values_with_one_warning(caplog) -> None:
    class Keeps(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x).relu()
            self.last = y * 2  # read by the caller after each call
            return y

    m = Keeps().to(DEV).eval()
    ref = copy.deepcopy(m)
    with caplog.at_level(logging.WARNING, logger=LOG), torch.no_grad():
        g = tr.graph(m, torch.randn(4, 16, device=DEV))
        for _ in range(CALLS):
            x = torch.randn(4, 16, device=DEV)
            torch.testing.assert_close(g(x), ref(x))
            torch.testing.assert_close(m.last, ref.last)
    warned = [r.getMessage() for r in caplog.records if r.name == LOG]
    assert len(warned) == 1 and "Keeps.last" in warned[0]
    assert g.stats.replays == CALLS and g.stats.fallbacks == 0


def _llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return transformers, cfg, transformers.LlamaForCausalLM(cfg).to(DEV).eval()


def test_hf_llama_with_a_dynamic_cache_is_refused_and_its_cache_left_as_it_was() -> None:
    transformers, cfg, model = _llama()
    with torch.no_grad():
        cache = transformers.DynamicCache(config=cfg)
        model(torch.randint(0, 256, (1, 5), device=DEV), past_key_values=cache, use_cache=True)
        assert cache.get_seq_length() == 5
        ids = torch.randint(0, 256, (1, 1), device=DEV)
        with pytest.raises(CaptureError, match=r"past_key_values'\]\.layers\[0\]\.keys"):
            tr.graph(model, ids, past_key_values=cache, use_cache=True)
        assert cache.get_seq_length() == 5


@pytest.mark.parametrize("breaks", [False, True], ids=["whole", "attention breaks"])
def test_hf_llama_decode_with_a_static_cache_is_eager_equal(breaks: bool) -> None:
    """transformers 5's StaticCache places each step by its own position counter
    (``cumulative_length.add_``): the warm-ups and the capture advanced it by four, so every
    replay wrote and read four positions too far. It is put back after the build now, also
    when the attention runs as a break."""
    transformers, cfg, model = _llama()
    prompt = torch.randint(0, 256, (1, 6), device=DEV)
    caches = [transformers.StaticCache(config=cfg, max_cache_len=64) for _ in range(2)]
    kw = {"breaks": [transformers.models.llama.modeling_llama.LlamaAttention]} if breaks else {}
    with torch.no_grad():
        for c in caches:
            model(prompt, past_key_values=c, cache_position=torch.arange(6, device=DEV))
        graphed_cache, eager_cache = caches

        def decode(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            return model(ids, past_key_values=graphed_cache, cache_position=pos).logits

        g = tr.graph(decode, torch.randint(0, 256, (1, 1), device=DEV), torch.tensor([6], device=DEV), **kw)
        for step in range(CALLS):
            ids = torch.randint(0, 256, (1, 1), device=DEV)
            pos = torch.tensor([6 + step], device=DEV)
            want = model(ids, past_key_values=eager_cache, cache_position=pos).logits
            torch.testing.assert_close(g(ids, pos), want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(graphed_cache.layers[0].keys, eager_cache.layers[0].keys)
    assert g.stats.replays == CALLS and g.stats.fallbacks == 0


def test_real_models_graph_eager_equal_with_no_warning(caplog) -> None:
    """The check walks every module's attributes and the arguments: none of these changes
    anything per call, so each graphs as before."""
    models = []
    transformers = pytest.importorskip("transformers")
    bert = transformers.BertModel(transformers.BertConfig(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256)).to(DEV).eval()
    ids = lambda: torch.randint(0, 1000, (2, 16), device=DEV)  # noqa: E731
    mask = torch.ones(2, 16, dtype=torch.long, device=DEV)
    models.append(("bert", lambda x: bert(x, attention_mask=mask).last_hidden_state, ids))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=128, n_layer=2, n_head=4)).to(DEV).eval()
    models.append(("gpt2", lambda x: gpt2(x, use_cache=False).logits, ids))
    torchvision = pytest.importorskip("torchvision")
    rn = torchvision.models.resnet18().to(DEV).eval()
    models.append(("resnet18", rn, lambda: torch.randn(2, 3, 64, 64, device=DEV)))
    try:
        import timm
        vit = timm.create_model("vit_tiny_patch16_224", pretrained=False).to(DEV).eval()
        models.append(("vit", vit, lambda: torch.randn(2, 3, 224, 224, device=DEV)))
    except ImportError:
        pass
    with caplog.at_level(logging.WARNING, logger=LOG), torch.no_grad():
        for name, fn, make in models:
            g = tr.graph(fn, make())
            for _ in range(3):
                x = make()
                torch.testing.assert_close(g(x), fn(x), rtol=1e-4, atol=1e-4, msg=name)
    assert not [r for r in caplog.records if r.name == LOG]


# -- breakable graphs: a break runs at every replay, the segments do not ------------------------


class Logged(nn.Module):
    """A break that keeps Python state of its own (a call count, the host values it saw)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.calls = 0
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        self.calls += 1
        self.seen.append(n)
        return self.lin(x) * n


class Around(nn.Module):
    def __init__(self, count: bool) -> None:
        super().__init__()
        self.a, self.brk, self.b = nn.Linear(16, 16), Logged(), nn.Linear(16, 16)
        self.count, self.steps = count, 0

    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        if self.count:
            self.steps += 1  # in a segment: a replay would not count
        return self.b(self.brk(self.a(x).relu(), n)).relu()


def test_a_breaks_own_python_state_is_real_at_every_replay_and_a_segments_is_refused() -> None:
    torch.manual_seed(0)
    m = Around(count=False).to(DEV).eval()
    ref = copy.deepcopy(m)
    g = tr.graph(m, torch.randn(4, 16, device=DEV), 3, breaks=[Logged])
    built = m.brk.calls
    ns = [int(n) for n in torch.randint(1, 9, (CALLS,))]
    with torch.no_grad():
        for n in ns:
            x = torch.randn(4, 16, device=DEV)
            torch.testing.assert_close(g(x, n), ref(x, n), rtol=1e-4, atol=1e-4)
    assert m.brk.calls == built + CALLS and m.brk.seen[-CALLS:] == ns  # the break ran each call
    assert g.stats.replays == CALLS and g.stats.fallbacks == 0

    torch.manual_seed(0)
    m = Around(count=True).to(DEV).eval()
    with pytest.raises(CaptureError, match=r"in a graph segment .*Around\.steps: \d+ -> \d+.*breaks="):
        tr.graph(m, torch.randn(4, 16, device=DEV), 3, breaks=[Logged])
    assert m.steps == 0 and m.brk.calls == 0 and m.brk.seen == []  # all put back


class Advances(nn.Module):
    """A break that advances a position kept on the CPU, in place (a plain attribute of its
    owner's, as host-side cache bookkeeping)."""

    def __init__(self, owner: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.owner = [owner]  # (not a submodule)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.owner[0].pos.add_(1)
        return self.lin(x)


class ReadsPos(nn.Module):
    def __init__(self, segment_reads: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.brk = Advances(self)
        self.pos = torch.zeros((), dtype=torch.long)  # (on the CPU: .to(DEV) leaves it)
        self.segment_reads = segment_reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.brk(self.a(x).relu())
        if self.segment_reads:
            h = h * float(self.pos)  # read on the host in the segment after the break
        return self.b(h)


def test_a_cpu_position_a_break_advances_and_a_segment_reads_on_the_host_is_refused() -> None:
    """The break runs at every replay, so its count is real; a segment's Python ran once, so it
    would multiply by the capture's position at every call. Refused at capture, naming it; the
    position is as it was; the same model whose segment does not read it replays eager-equal."""
    torch.manual_seed(0)
    m = ReadsPos(segment_reads=True).to(DEV).eval()
    with pytest.raises(CaptureError, match=r"ReadsPos\.pos.*a graph segment reads it on the host"):
        tr.graph(m, torch.randn(4, 16, device=DEV), breaks=[Advances])
    assert int(m.pos) == 0
    m = ReadsPos(segment_reads=False).to(DEV).eval()
    ref = copy.deepcopy(m)
    g = tr.graph(m, torch.randn(4, 16, device=DEV), breaks=[Advances])
    start = int(m.pos)
    with torch.no_grad():
        for _ in range(CALLS):
            x = torch.randn(4, 16, device=DEV)
            torch.testing.assert_close(g(x), ref(x), rtol=1e-4, atol=1e-4)
    assert int(m.pos) == start + CALLS  # the break's writes are real at every call
    assert g.stats.replays == CALLS


class SetsMask(nn.Module):
    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.in_place = in_place
        self.mask = torch.zeros(4, 16, device=DEV)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_place:
            self.mask.copy_(x > 0)
        else:
            self.mask = (x > 0).float()  # a new tensor each call: the segment after reads it
        return x.clone()


class UsesMask(nn.Module):
    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.lin, self.s, self.out = nn.Linear(16, 16), SetsMask(in_place), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.s(self.lin(x)) * self.s.mask)


def test_a_tensor_a_break_sets_and_a_segment_reads_is_refused_the_in_place_form_replays() -> None:
    torch.manual_seed(0)
    m = UsesMask(in_place=False).to(DEV).eval()
    first = m.s.mask
    with pytest.raises(CaptureError, match=r"UsesMask\.s\.mask: .* \(by break SetsMask"):
        tr.graph(m, torch.randn(4, 16, device=DEV), breaks=[SetsMask])
    assert m.s.mask is first
    torch.manual_seed(0)
    m = UsesMask(in_place=True).to(DEV).eval()
    ref = copy.deepcopy(m)
    g = tr.graph(m, torch.randn(4, 16, device=DEV), breaks=[SetsMask])
    with torch.no_grad():
        for _ in range(CALLS):
            x = torch.randn(4, 16, device=DEV)
            torch.testing.assert_close(g(x), ref(x), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(m.s.mask, ref.s.mask)
    assert g.stats.replays == CALLS


def test_hf_llama_with_a_dynamic_cache_and_breaks_is_refused_either_way() -> None:
    """Updated in a segment (break at the MLP), or in the break (the attention) while the
    model's Python before it derived the positions from the cache's length: both replay the
    capture's positions. The cache is left as it was."""
    transformers, cfg, model = _llama()
    llama = transformers.models.llama.modeling_llama
    with torch.no_grad():
        cache = transformers.DynamicCache(config=cfg)
        model(torch.randint(0, 256, (1, 5), device=DEV), past_key_values=cache, use_cache=True)
        ids = torch.randint(0, 256, (1, 1), device=DEV)
        for brk, what in ((llama.LlamaMLP, "in a graph segment"), (llama.LlamaAttention, "grows")):
            with pytest.raises(CaptureError, match=what):
                tr.graph(model, ids, past_key_values=cache, use_cache=True, breaks=[brk])
            assert cache.get_seq_length() == 5


class Positioned(nn.Module):
    """A position counter advanced in place in a graph segment, a break after it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.brk = nn.Linear(16, 16), nn.Linear(16, 16)
        self.length = [torch.zeros((), dtype=torch.long, device=DEV)]  # not a buffer: Python state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.length[0].add_(1)
        return self.brk(self.lin(x) * self.length[0])


@pytest.mark.parametrize("breaks", [None, "brk"])
def test_a_size_captured_lazily_leaves_its_position_counter_where_eager_does(breaks) -> None:
    """A size captured at its first call runs no warm-ups; a breakable graph's capture runs its
    segments once for real, so the counter's advance by it was kept and every later call read
    one position ahead."""
    torch.manual_seed(0)
    m = Positioned().to(DEV).eval()
    ref = copy.deepcopy(m)
    kw = {"breaks": [m.brk]} if breaks else {}
    g = tr.graph(m, torch.randn(8, 16, device=DEV), sizes=[1, 2, 4, 8], capture="lazy", **kw)
    assert int(m.length[0]) == 0
    with torch.no_grad():
        for n in (3, 1, 3, 8, 2, 1, 5, 4):
            x = torch.randn(n, 16, device=DEV)
            torch.testing.assert_close(g(x), ref(x), rtol=1e-4, atol=1e-4)
            assert int(m.length[0]) == int(ref.length[0])
    assert g.stats.fallbacks == 0


# -- a tensor in Python state replaced by the caller between calls -----------------------------


class KV:
    """A cache object of the caller's own (not a module): the graph reads ``k`` where it is."""

    def __init__(self) -> None:
        self.k = torch.randn(8, 16, device=DEV)


class Rope(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.brk = nn.Linear(16, 16), nn.Linear(16, 16)
        self.freqs = torch.randn(16, device=DEV)  # a plain attribute, not a buffer

    def forward(self, x: torch.Tensor, kv: KV) -> torch.Tensor:
        h = self.brk(self.lin(x) * self.freqs)
        return (h @ kv.k.T).softmax(-1) @ kv.k


@pytest.mark.parametrize("front", ["graph", "sizes", "breaks"])
def test_a_tensor_in_python_state_replaced_between_calls_raises_written_in_place_replays(front) -> None:
    """A replay read the tensor that was there at capture: a cache reset by assigning a new
    tensor (or a plain tensor attribute recomputed) was silently ignored, and the old tensor's
    memory could be freed and reused. Each call now checks those places by identity."""
    torch.manual_seed(0)
    m, kv = Rope().to(DEV).eval(), KV()
    kw = {"sizes": [2, 4, 8]} if front == "sizes" else {"breaks": [m.brk]} if front == "breaks" else {}
    g = tr.graph(m, torch.randn(4, 16, device=DEV), kv, **kw)
    with torch.no_grad():
        for i in range(CALLS):
            if i == CALLS // 2:
                kv.k.copy_(torch.randn(8, 16, device=DEV))  # in place: read by the replays
                m.freqs.mul_(2)
            x = torch.randn(4 if front != "sizes" else 1 + i % 4, 16, device=DEV)
            torch.testing.assert_close(g(x, kv), m(x, kv), rtol=1e-4, atol=1e-4)
        old, kv.k = kv.k, torch.randn(8, 16, device=DEV)
        with pytest.raises(tr.ReplayInputError, match=r"args\[1\]\.k is tensor\(8, 16\)"):
            g(torch.randn(4, 16, device=DEV), kv)
        kv.k = old
        x = torch.randn(4, 16, device=DEV)
        torch.testing.assert_close(g(x, kv), m(x, kv), rtol=1e-4, atol=1e-4)  # as captured again
        m.freqs = m.freqs.clone()
        with pytest.raises(tr.ReplayInputError, match=r"Rope\.freqs is tensor\(16,\)"):
            g(torch.randn(4, 16, device=DEV), kv)


def test_make_graphed_callables_raises_when_a_tensor_its_forward_reads_is_replaced() -> None:
    """The same for training graphs: the forward and backward graphs read the capture's
    ``freqs``; assigned anew, eager would train with the new one, so the call raises. Written
    in place, outputs and gradients stay eager's."""
    torch.manual_seed(0)

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.freqs = torch.rand(16, device=DEV) + 0.5  # a plain attribute, not a buffer

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.freqs

    m = Scaled().to(DEV)
    ref = copy.deepcopy(m)
    tr.make_graphed_callables(m, (torch.randn(4, 16, device=DEV, requires_grad=True),))
    for i in range(CALLS):
        if i == CALLS // 2:
            m.freqs.mul_(2)
            ref.freqs.mul_(2)
        x = torch.randn(4, 16, device=DEV, requires_grad=True)
        xr = x.detach().clone().requires_grad_(True)
        y, yr = m(x), ref(xr)
        torch.testing.assert_close(y, yr, rtol=1e-4, atol=1e-4)
        g = torch.randn_like(y)
        y.backward(g)
        yr.backward(g)
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(m.lin.weight.grad, ref.lin.weight.grad, rtol=1e-4, atol=1e-4)
    assert m.forward.stats.replays == CALLS
    old, m.freqs = m.freqs, m.freqs.clone()
    with pytest.raises(tr.ReplayInputError, match=r"Scaled\.freqs is tensor\(16,\)"):
        m(torch.randn(4, 16, device=DEV, requires_grad=True))
    m.freqs = old
    x = torch.randn(4, 16, device=DEV)
    torch.testing.assert_close(m(x), ref(x), rtol=1e-4, atol=1e-4)


# -- what a build writes into large tensors of Python state ------------------------------------


class PosCache:
    """A cache object of the caller's, 4 MiB, written at the position each call is given."""

    def __init__(self) -> None:
        self.keys = torch.zeros(4, 1024, 256, device=DEV)


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.brk = nn.Linear(256, 256), nn.Linear(256, 256)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache: PosCache) -> torch.Tensor:
        cache.keys.index_copy_(1, pos, self.q(x[:4]).unsqueeze(1))  # x: [B, 256], B >= 4
        att = (self.brk(x) @ cache.keys[0, :32].T).softmax(-1)  # [B, 32]
        return att @ cache.keys[1, :32]


@pytest.mark.parametrize("front", ["graph", "sizes", "breaks"])
def test_a_build_leaves_a_large_cache_in_an_argument_as_the_caller_left_it(front) -> None:
    """Graphed with a sample position of 0 over a cache that held a prompt at rows 0..5: the
    warm-ups wrote their rows over row 0 and kept them (the cache is over the 1 MiB copied
    whole), and every output after differed from eager's."""
    torch.manual_seed(0)
    m, cache = Decoder().to(DEV).eval(), PosCache()
    cache.keys[:, :6] = torch.randn(4, 6, 256, device=DEV)
    ref = copy.deepcopy(cache)
    kw = {"sizes": [4, 8]} if front == "sizes" else {"breaks": [m.brk]} if front == "breaks" else {}
    if front == "sizes":
        kw["dim"] = {"x": 0, "pos": None}
    g = tr.graph(m, torch.randn(4, 256, device=DEV), torch.tensor([0], device=DEV), cache, **kw)
    torch.testing.assert_close(cache.keys, ref.keys, rtol=0, atol=0)
    with torch.no_grad():
        for p in range(6, 6 + CALLS):
            x = torch.randn(4 if front != "sizes" else 4 + p % 5, 256, device=DEV)
            pos = torch.tensor([p], device=DEV)
            torch.testing.assert_close(g(x, pos, cache), m(x, pos, ref), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(cache.keys, ref.keys, rtol=1e-4, atol=1e-4)
    assert g.stats.fallbacks == 0


class Memory(nn.Module):
    """A decode step over Python state of its own (plain attributes, not buffers; 4 MiB each):
    a cache written at the position each call is given, and an accumulator, both written in the
    graph segment before the break."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.brk = nn.Linear(256, 256), nn.Linear(256, 256)
        self.keys = torch.zeros(4, 1024, 256, device=DEV)
        self.total = torch.zeros(4096, 256, device=DEV)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.keys.index_copy_(1, pos, self.q(x[:4]).unsqueeze(1))  # x: [B, 256], B >= 4
        self.total[0].add_(x.sum(0))  # (the padded rows are zeros)
        att = (self.brk(x) @ self.keys[0, :32].T).softmax(-1)  # [B, 32]
        return att @ self.keys[1, :32] + self.total[0]


@pytest.mark.parametrize("capture", ["ahead", "lazy"])
def test_a_breakable_graphs_capture_of_each_size_leaves_large_python_state_as_it_was(capture) -> None:
    """A breakable graph's capture replays each segment for real before the break after it.
    What that replay wrote into a large tensor of Python state stayed, for every size captured
    without warm-ups (each size after the first, every size of ``capture="lazy"``): the cache's
    prompt row under the sample's position was overwritten and the accumulator counted each
    capture once more than eager."""
    torch.manual_seed(0)
    m = Memory().to(DEV).eval()
    m.keys[:, :6] = torch.randn(4, 6, 256, device=DEV)  # a prompt at rows 0..5
    m.total.normal_()
    ref = copy.deepcopy(m)
    g = tr.graph(
        m, torch.randn(16, 256, device=DEV), torch.tensor([0], device=DEV), breaks=[m.brk],
        sizes=[4, 8, 16], dim={"x": 0, "pos": None}, capture=capture,
    )
    torch.testing.assert_close(m.keys, ref.keys, rtol=0, atol=0)
    torch.testing.assert_close(m.total, ref.total, rtol=0, atol=0)
    with torch.no_grad():
        for p, n in zip(range(6, 6 + CALLS), (5, 16, 4, 8, 7, 4, 12, 5)):
            x, pos = torch.randn(n, 256, device=DEV), torch.tensor([p], device=DEV)
            torch.testing.assert_close(g(x, pos), ref(x, pos), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(m.keys, ref.keys, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(m.total, ref.total, rtol=1e-4, atol=1e-4)
    assert g.stats.fallbacks == 0


class BufferDecoder(nn.Module):
    """gpt-fast's layout: a 256 MiB KV cache registered as a buffer, written with ``index_put_``
    at the position each call is given."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.brk = nn.Linear(256, 256), nn.Linear(256, 256)
        self.register_buffer("keys", torch.zeros(4, 65536, 256))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.keys[:, pos] = self.q(x[:4]).unsqueeze(1)  # x: [B, 256], B >= 4
        att = (self.brk(x) @ self.keys[0, :32].T).softmax(-1)  # [B, 32]
        return att @ self.keys[1, :32]


@pytest.mark.parametrize("front", ["graph", "function", "sizes", "breaks", "compiled"])
def test_a_build_puts_a_large_cache_buffer_back_without_copying_it(front) -> None:
    """A module's buffers were copied whole before the warm-ups: a KV cache registered as a
    buffer took twice its memory for the build. Over 1 MiB, only what the build's calls
    overwrite is kept now. Still copied whole: a torch.compile'd module's (no dispatch mode
    sees its writes) and a breakable graph's (its capture replays the segments for real)."""
    torch.manual_seed(0)
    m = BufferDecoder().to(DEV).eval()
    with torch.no_grad():
        m.keys[:, :6] = torch.randn(4, 6, 256, device=DEV)  # a prompt at rows 0..5
    ref = copy.deepcopy(m)
    fn = {"function": lambda x, pos: m(x, pos), "compiled": torch.compile(m)}.get(front, m)
    kw = {"sizes": [4, 8], "dim": {"x": 0, "pos": None}} if front == "sizes" else {}
    if front == "breaks":
        kw["breaks"] = [m.brk]
    x0, pos0 = torch.randn(4, 256, device=DEV), torch.tensor([0], device=DEV)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    g = tr.graph(fn, x0, pos0, **kw)
    peak = torch.cuda.max_memory_allocated() - base
    if front not in ("compiled", "breaks"):  # (copied whole: writes no mode sees)
        assert peak < m.keys.nbytes // 4, (peak, m.keys.nbytes)  # a copy would be 256 MiB
    torch.testing.assert_close(m.keys, ref.keys, rtol=0, atol=0)
    with torch.no_grad():
        for p in range(6, 6 + CALLS):
            x = torch.randn(4 if front != "sizes" else 4 + p % 5, 256, device=DEV)
            pos = torch.tensor([p], device=DEV)
            torch.testing.assert_close(g(x, pos), ref(x, pos), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(m.keys, ref.keys, rtol=1e-4, atol=1e-4)
    assert g.stats.fallbacks == 0


class Attend(nn.Module):
    """A break that reads a plain value itself (at every call: no freeze) for ``breaks=``."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x / self.temperature, dim=-1)


class Adapted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lora = Lora()
        self.attend = Attend()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attend(self.lora(x)) * 2


@pytest.mark.parametrize("front", ["graph", "sizes", "breaks", "make_graphed_callables", "graph_step"])
def test_calls_run_eagerly_while_a_plain_value_the_model_read_differs_from_capture(front, caplog) -> None:
    """Replays equal eager with fresh inputs. Then each plain value the model's code read (a
    flag through a property, a dict's scale, a list of names) changed in turn: calls equal
    eager with the new value (they run eagerly, counted, one warning naming it; a replay would
    have kept the old one), and once set back they replay again, equal to eager. A value only a
    break reads (the temperature) is read at every call: it changes results, as eagerly."""
    torch.manual_seed(0)
    m = Adapted().to(DEV)
    ref = copy.deepcopy(m)
    x = torch.randn(4, 16, device=DEV)
    if front == "breaks":
        g = tr.graph(m, x, breaks=[Attend])
    else:
        g = graph_by(front, m, x)
    stats = g.forward.stats if isinstance(g, nn.Module) else g.stats  # (a module graphed in place)
    train = front in ("make_graphed_callables", "graph_step")
    ref_step = train_step_of(ref)

    def check() -> None:
        for _ in range(3):
            xi = torch.randn(4, 16, device=DEV)
            if front == "graph_step":
                torch.testing.assert_close(g(xi), ref_step(xi))
                for p, q in zip(m.parameters(), ref.parameters()):
                    torch.testing.assert_close(p, q)
                continue
            with contextlib.nullcontext() if train else torch.no_grad():
                torch.testing.assert_close(g(xi), ref(xi))

    check()
    changes = [("_disable_adapters", True), ("scaling", 2.0), ("active", "other")]
    for k, (attr, value) in enumerate(changes):
        for target in (m, ref):
            if attr == "scaling":
                target.lora.scaling["default"] = value
            elif attr == "active":
                target.lora.active.append(value)
                target.lora.scaling[value] = 1.0
            else:
                setattr(target.lora, attr, value)
        replays, fallbacks = stats.replays, stats.fallbacks
        check()  # eagerly, with the new value
        assert stats.replays == replays and stats.fallbacks == fallbacks + 3, (attr, stats)
        assert caplog.text.count("(at capture: ") == k + 1, caplog.text[-2000:]  # (once a change)
        assert "lora._disable_adapters is True (at capture: False)" in caplog.text
        for target in (m, ref):  # set back
            target.lora._disable_adapters = False
            target.lora.scaling.pop("other", None)
            target.lora.scaling["default"] = 0.5
            del target.lora.active[1:]
        check()
        assert stats.replays == replays + 3 and stats.fallbacks == fallbacks + 3, (attr, stats)
    if front == "breaks":
        m.attend.temperature = ref.attend.temperature = 3.0  # read inside the break: each call
        check()
        assert stats.fallbacks == 9


def test_a_peft_model_graphed_runs_eagerly_inside_disable_adapter_and_replays_after() -> None:
    """PEFT's ``with model.disable_adapter():`` (a DPO reference forward) sets a flag on each
    LoRA layer that its forward reads through a property: inside it, calls equal the eager base
    model (they run eagerly; a replay would have added the adapters), and after it they replay,
    equal to eager with the adapters."""
    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    base = LlamaForCausalLM(config)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # (zeros at init: the adapters would change nothing)
                p.normal_(std=0.5)
    model = model.to(DEV).eval()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 256, (2, 8), device=DEV)
    with torch.no_grad():
        g = tr.graph(model, ids)
        for _ in range(3):
            xi = torch.randint(0, 256, (2, 8), device=DEV)
            torch.testing.assert_close(g(xi).logits, ref(xi).logits)
        replays, fallbacks = g.stats.replays, g.stats.fallbacks
        xi = torch.randint(0, 256, (2, 8), device=DEV)
        with model.disable_adapter(), ref.disable_adapter():
            off = g(xi).logits
            torch.testing.assert_close(off, ref(xi).logits)
        assert g.stats.fallbacks == fallbacks + 1 and g.stats.replays == replays
        on = ref(xi).logits
        assert (off - on).abs().max() > 1e-3  # (the adapters matter: the test can fail)
        torch.testing.assert_close(g(xi).logits, on)
        assert g.stats.replays == replays + 1


class Normed(nn.Module):
    """Linear, BatchNorm, ReLU, Dropout, Linear: torch's own layers that read their mode."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(p)
        self.out = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.relu(self.bn(self.inp(x)))))


@pytest.mark.parametrize("front", ["graph", "sizes", "make_graphed_callables", "graph_step"])
def test_a_torch_layer_switched_alone_runs_calls_eagerly_until_set_back(front, caplog) -> None:
    """torch's own layers read their mode in torch's code. Inference: an eval model whose
    ``Dropout`` alone is switched to ``train()`` (MC dropout) samples masks eagerly (seeded
    alike, equal to eager; two seeds differ), where a replay would have skipped the dropout.
    Training: a ``BatchNorm`` frozen alone (``bn.eval()``) normalizes by its running statistics,
    and a ``Dropout``'s rate raised from 0 drops; each equals eager. Set back, calls replay."""
    train = front in ("make_graphed_callables", "graph_step")
    torch.manual_seed(0)
    m = Normed(0.0 if train else 0.3).to(DEV).train(train)
    ref = copy.deepcopy(m)
    g = graph_by(front, m, torch.randn(4, 16, device=DEV))
    stats = g.forward.stats if isinstance(g, nn.Module) else g.stats
    ref_step = train_step_of(ref)

    def call(xi: torch.Tensor, seed: int) -> torch.Tensor | None:
        torch.manual_seed(seed)
        if front == "graph_step":
            got = g(xi)
            torch.manual_seed(seed)
            torch.testing.assert_close(got, ref_step(xi))
            for p, q in itertools.chain(zip(m.parameters(), ref.parameters()), zip(m.buffers(), ref.buffers())):
                torch.testing.assert_close(p, q)
            return None
        with contextlib.nullcontext() if train else torch.no_grad():
            got = g(xi)
            torch.manual_seed(seed)
            want = ref(xi)
            torch.testing.assert_close(got, want)
        if train:
            got.square().mean().backward()
            want.square().mean().backward()
            for p, q in zip(m.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad)
                p.grad = q.grad = None
        return got

    def calls(n: int) -> list:
        return [call(torch.randn(4, 16, device=DEV), 100 + i) for i in range(n)]

    calls(3)
    changes = [("drop", "p", 0.3), ("bn", "training", False)] if train else [("drop", "training", True)]
    for attr, name, value in changes:
        before = getattr(getattr(m, attr), name)
        for target in (m, ref):
            setattr(getattr(target, attr), name, value)
        replays, fallbacks = stats.replays, stats.fallbacks
        outs = calls(3)
        assert stats.replays == replays and stats.fallbacks == fallbacks + 3, (attr, name, stats)
        assert "drop.training is True (at capture: False)" in caplog.text or train
        if not train:  # (the test can fail: the masks differ by seed)
            assert not torch.equal(outs[0], outs[1])
        for target in (m, ref):
            setattr(getattr(target, attr), name, before)
        calls(3)
        assert stats.replays == replays + 3 and stats.fallbacks == fallbacks + 3, (attr, name, stats)
    if train:
        assert "bn.training is False (at capture: True)" in caplog.text and "drop.p is 0.3" in caplog.text
