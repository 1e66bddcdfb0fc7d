"""core/io.py on CPU tensors: pytree flattening, guards, copy-in, and every input error message."""

from __future__ import annotations

import logging

import pytest
import torch

from torchreplay import _compat
from torchreplay import config as trconfig
from torchreplay.errors import (
    CacheError,
    CaptureError,
    ReplayInputError,
    StaleOutputError,
    TorchReplayError,
    UnsupportedError,
)
from torchreplay.core.args import CallArgs
from torchreplay.core.io import Inputs as _Inputs
from torchreplay.core.outputs import Outputs
from torchreplay.stats import GraphStats


def Inputs(fn, args, kwargs, device):  # noqa: N802 - the old signature, for these tests
    return _Inputs(CallArgs(fn, args, kwargs), device)

CPU = torch.device("cpu")


def fn(x, pair, *, cfg, scale=1.0):
    return x


def sample():
    args = (torch.randn(4, 3), (torch.randn(2), 7))
    kwargs = {"cfg": {"w": torch.randn(3), "mode": "causal"}, "scale": 0.5}
    return args, kwargs


def test_static_buffers_are_copies_in_the_captured_structure() -> None:
    args, kwargs = sample()
    inp = Inputs(fn, args, kwargs, CPU)
    sx, (sa, seven) = inp.static_args
    assert torch.equal(sx, args[0]) and sx.data_ptr() != args[0].data_ptr()
    assert seven == 7
    assert inp.static_kwargs["cfg"]["mode"] == "causal"
    assert len(inp.tensor_slots) == 3
    assert not inp.flat  # nested containers: slow path


def test_copy_in_writes_every_tensor_into_its_static_buffer() -> None:
    args, kwargs = sample()
    inp = Inputs(fn, args, kwargs, CPU)
    new_args, new_kwargs = sample()
    new_kwargs = dict(reversed(list(new_kwargs.items())))  # keyword order must not matter
    inp.copy_in(new_args, new_kwargs)
    sx, (sa, _) = inp.static_args
    assert torch.equal(sx, new_args[0])
    assert torch.equal(sa, new_args[1][0])
    assert torch.equal(inp.static_kwargs["cfg"]["w"], new_kwargs["cfg"]["w"])


def test_flat_fast_path_copies_a_single_tensor() -> None:
    x = torch.randn(5)
    inp = Inputs(lambda x, n=1: x, (x,), {"n": 2}, CPU)
    assert inp.flat
    y = torch.randn(5)
    inp.copy_in((y,), {"n": 2})
    assert torch.equal(inp.static_args[0], y)


def test_strided_input_of_the_right_shape_is_accepted() -> None:
    inp = Inputs(lambda x: x, (torch.randn(3, 4),), {}, CPU)
    base = torch.randn(4, 3)
    inp.copy_in((base.t(),), {})
    assert torch.equal(inp.static_args[0], base.t())


@pytest.mark.parametrize(
    "bad, words",
    [
        (torch.randn(5, 3), ["args[0] 'x'", "(5, 3)", "(4, 3)"]),
        (torch.randn(4, 3, dtype=torch.float64), ["float64", ".to(torch.float32)"]),
        (3.0, ["expected a tensor", "float"]),
    ],
)
def test_the_one_tensor_fast_path_checks_like_the_general_one(bad, words, caplog) -> None:
    """One tensor argument takes copy_in's inline check: a subclass of the captured shape is
    copied, a widening cast is copied with a warning, anything else raises the same errors."""
    inp = Inputs(lambda x: x, (torch.randn(4, 3),), {}, CPU)
    assert inp._one is not None
    p = torch.nn.Parameter(torch.randn(4, 3))
    inp.copy_in((p,), {})
    assert torch.equal(inp.static_args[0], p)
    half = torch.randn(4, 3, dtype=torch.bfloat16)
    with caplog.at_level("WARNING", logger="torchreplay"):
        inp.copy_in((half,), {})
    assert "bfloat16" in caplog.text
    assert torch.equal(inp.static_args[0], half.float())
    with pytest.raises(ReplayInputError) as e:
        inp.copy_in((bad,), {})
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize(
    "bad, words",
    [
        (torch.randn(5, 3), ["args[0] 'x'", "(5, 3)", "(4, 3)", "sizes=[...]", "never broadcasts"]),
        (torch.randn(1, 3), ["(1, 3)", "(4, 3)"]),
        (torch.randn(4, 3, dtype=torch.float64), ["float64", ".to(torch.float32)"]),
        (torch.randn(4, 3).to_sparse(), ["dense"]),
        (3.0, ["expected a tensor", "float"]),
        ([1.0, 2.0], ["args[0]: its structure"]),
    ],
)
def test_tensor_mismatch_messages(bad, words) -> None:
    args, kwargs = sample()
    inp = Inputs(fn, args, kwargs, CPU)
    _, new_kwargs = sample()
    with pytest.raises(ReplayInputError) as e:
        inp.copy_in((bad, args[1]), new_kwargs)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_constant_mismatch_names_the_path_and_both_values() -> None:
    args, kwargs = sample()
    inp = Inputs(fn, args, kwargs, CPU)
    kwargs2 = {"cfg": {"w": torch.randn(3), "mode": "full"}, "scale": 0.5}
    with pytest.raises(ReplayInputError) as e:
        inp.copy_in(args, kwargs2)
    msg = str(e.value)
    assert "kwargs['cfg']['mode']" in msg and "'full'" in msg and "'causal'" in msg
    assert "as a tensor" in msg
    with pytest.raises(ReplayInputError, match=r"args\[1\]\[1\] 'pair': 8 .* constant 7"):
        inp.copy_in((args[0], (args[1][0], 8)), kwargs)


def test_bool_is_not_the_int_it_equals() -> None:
    inp = Inputs(lambda x, n: x, (torch.randn(2), 1), {}, CPU)
    with pytest.raises(ReplayInputError, match="True"):
        inp.copy_in((torch.randn(2), True), {})


def test_structure_mismatches() -> None:
    args, kwargs = sample()
    inp = Inputs(fn, args, kwargs, CPU)
    with pytest.raises(ReplayInputError, match="3 positional arguments but .* 2"):
        inp.copy_in((*args, 1), kwargs)
    with pytest.raises(ReplayInputError, match=r"missing \['scale'\]"):
        inp.copy_in(args, {"cfg": kwargs["cfg"]})
    with pytest.raises(ReplayInputError, match=r"unexpected \['extra'\]"):
        inp.copy_in(args, {**kwargs, "extra": 1})
    with pytest.raises(ReplayInputError, match=r"args\[1\]: its structure"):
        inp.copy_in((args[0], [args[1][0], 7]), kwargs)


def test_capture_rejects_tensors_on_another_device_and_sparse() -> None:
    with pytest.raises(CaptureError, match="meta.*move every tensor"):
        Inputs(lambda x: x, (torch.empty(3, device="meta"),), {}, CPU)
    with pytest.raises(CaptureError, match="dense"):
        Inputs(lambda x: x, (torch.randn(3, 3).to_sparse(),), {}, CPU)


def test_outputs_clone_policy_on_cpu_and_structure() -> None:
    t = torch.randn(3)
    ext = torch.randn(2)
    out = {"a": t, "b": [ext, 5]}
    o = Outputs(out, "clone", "f", owned=lambda x: x is t)
    if not _compat.HAS_CHECKED_OUTPUTS:  # no checked outputs without CUDA's storage bindings
        assert Outputs(out, "checked", "f", owned=lambda x: x is t).policy == "clone"
    got = o.emit()
    assert torch.equal(got["a"], t) and got["a"].data_ptr() != t.data_ptr()
    assert got["b"][0] is ext and got["b"][1] == 5
    s = Outputs(t, "static", "f", owned=lambda x: True)
    assert s.emit() is t


@pytest.mark.parametrize("many", [False, True], ids=["one output", "with a gradient-like second"])
def test_clone_policy_keeps_padded_and_expanded_strides(many: bool) -> None:
    """Inductor lays some outputs out with padded rows (stride 16 for 13 columns); a backward's
    code asserts those strides on the saved activations it gets. ``clone`` made them dense."""
    padded = torch.randn(4, 16)[:, :13]
    expanded = torch.randn(4, 1).expand(4, 5)
    leaves = [padded, expanded] + ([torch.randn(3)] if many else [])
    o = Outputs(leaves, "clone", "f", owned=lambda x: True)
    got = o.emit()
    for g, t in zip(got, leaves):
        assert g.stride() == t.stride() and torch.equal(g, t)
        assert g.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def test_a_stale_outputs_message_names_which_output_it_is() -> None:
    """A StaleOutputError raised far from the call (inside a backward) must say which output was
    read: its index, dtype and shape, whether other outputs view its memory, and whether a
    training forward saved it for the backward."""
    base = torch.randn(2, 8)
    leaves = [torch.randn(3), base, base.view(16), torch.zeros(2, dtype=torch.int64)]
    o = Outputs(leaves, "checked", "fwd", owned=lambda x: True, watch=frozenset({3}))
    messages = o._stale_messages
    assert len(messages) == 3  # one per storage
    assert "'fwd' (output 0 of 4, float32 [3])" in messages[0]
    assert "(output 1 of 4, float32 [2, 8], and 1 view(s) of its memory)" in messages[1]
    assert "(output 3 of 4, int64 [2], saved for the backward)" in messages[2]
    assert all(m.startswith("StaleOutputError: this tensor is an output of the torchreplay graph") for m in messages)


def test_error_hierarchy_keeps_builtin_bases() -> None:
    for cls, base in [
        (CaptureError, RuntimeError),
        (ReplayInputError, ValueError),
        (StaleOutputError, RuntimeError),
        (UnsupportedError, RuntimeError),
        (CacheError, RuntimeError),
    ]:
        assert issubclass(cls, TorchReplayError) and issubclass(cls, base)


def test_config_validation_and_presets() -> None:
    with pytest.raises(ValueError, match="outputs must be one of"):
        trconfig.GraphConfig(outputs="fast")
    with pytest.raises(ValueError, match="num_warmup_iters"):
        trconfig.GraphConfig(num_warmup_iters=-1)
    with pytest.raises(ValueError, match="capture_error_mode"):
        trconfig.GraphConfig(capture_error_mode="strict")
    assert trconfig.SAFE.outputs == "checked" and trconfig.FAST.outputs == "static"
    with pytest.raises(Exception):
        trconfig.SAFE.outputs = "clone"  # frozen


def test_stats_counters_and_explain() -> None:
    s = GraphStats(lambda: 3 * 2**20)
    s.captures, s.replays, s.real_rows, s.padded_rows = 2, 10, 30, 10
    s.size_hits[8] = 4
    d = s.as_dict()
    assert d["pool_bytes"] == 3 * 2**20 and d["pad_waste"] == 0.25
    assert "3.0 MiB" in s.explain() and "8:4" in s.explain()


@pytest.mark.parametrize(
    "out",
    [
        [torch.ones(1), 2.0, None],
        (torch.ones(1), torch.zeros(2)),
        {"b": torch.ones(1), "a": torch.zeros(2)},
        ({"a": torch.ones(1)}, [torch.zeros(1)]),  # nested: the general walk
        torch.return_types.max((torch.ones(1), torch.zeros(1))),  # a tuple subclass
        [],
    ],
    ids=["list", "tuple", "dict", "nested", "structseq", "empty"],
)
def test_unflattener_builds_what_tree_unflatten_builds(out) -> None:
    leaves, spec = _compat.tree_flatten(out)
    fresh = [torch.randn(1) if isinstance(x, torch.Tensor) else x for x in leaves]
    got, want = _compat.unflattener(spec)(list(fresh)), _compat.tree_unflatten(list(fresh), spec)
    assert type(got) is type(want) and _compat.tree_flatten(got)[1] == spec
    assert all(a is b for a, b in zip(_compat.tree_flatten(got)[0], fresh))
    if isinstance(want, dict):
        assert list(got) == list(want)  # the keys in the captured order


@pytest.mark.parametrize(
    "args, kwargs",
    [
        ((torch.ones(2), None, 3), {"scale": 0.5, "mask": None}),  # an op's call: leaves and None
        ((), {"x": torch.ones(1)}),
        ((torch.ones(1),), {}),
        (([torch.ones(1), 2], (3, None)), {"d": {"k": torch.ones(1)}}),  # nested: the general walk
        ((None, None), {}),
    ],
    ids=["op call", "kwargs only", "one arg", "nested", "only None"],
)
def test_call_unflattener_builds_what_tree_unflatten_builds(args, kwargs) -> None:
    leaves, spec = _compat.tree_flatten((args, kwargs))
    fresh = [torch.randn(1) if isinstance(x, torch.Tensor) else x for x in leaves]
    got, want = _compat.call_unflattener(spec)(list(fresh)), _compat.tree_unflatten(list(fresh), spec)
    assert type(got[0]) is tuple and type(got[1]) is dict and list(got[1]) == list(want[1])
    assert _compat.tree_flatten(got)[1] == spec
    assert all(a is b for a, b in zip(_compat.tree_flatten(got)[0], fresh))


def test_direct_apply_is_the_functions_apply_outside_functorch_and_its_own_inside() -> None:
    """The C++ apply gives the same values, node and gradients; inside a functorch transform
    it defers to ``Function.apply``, which raises there for a Function without setup_context
    (as it would without us)."""

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, scale):
            ctx.scale = scale
            return x * 2 * scale

        @staticmethod
        def backward(ctx, g):
            return g * 2 * ctx.scale, None

    apply = _compat.direct_apply(Twice)
    x = torch.randn(3, requires_grad=True)
    y = apply(x, 3.0)
    assert type(y.grad_fn).__name__ == "TwiceBackward"
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 6.0))
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda t: Twice.apply(t, 3.0).sum())(torch.randn(3))
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda t: apply(t, 3.0).sum())(torch.randn(3))


def test_saved_tensor_hooks_names_the_innermost_pack_hook() -> None:
    assert _compat.saved_tensor_hooks() is None
    with torch.autograd.graph.save_on_cpu():
        assert "pack_to_cpu" in (_compat.saved_tensor_hooks() or "")
    assert _compat.saved_tensor_hooks() is None


@pytest.mark.parametrize("n", [1, 2], ids=["one tensor", "several"])
def test_copy_in_of_an_input_that_requires_grad_is_not_recorded_by_autograd(n) -> None:
    """A training call copies the previous layer's output (it requires grad) into a static
    buffer under grad mode. Recorded, the buffer would require grad with a history that keeps
    that layer's autograd graph alive until the next call (``NotImplemented`` for the
    multi-tensor copy); the capture's sample does the same at construction."""
    samples = tuple(torch.randn(3, 4, requires_grad=True) * 2 for _ in range(n))
    inp = Inputs(lambda *xs: xs, samples, {}, CPU)
    for slot in inp.tensor_slots:
        assert not slot.static.requires_grad and slot.static.grad_fn is None
    for _ in range(2):
        xs = tuple(torch.randn(3, 4, requires_grad=True) * 2 for _ in range(n))
        inp.copy_in(xs, {})
        for slot, x in zip(inp.tensor_slots, xs):
            assert not slot.static.requires_grad and slot.static.grad_fn is None
            torch.testing.assert_close(slot.static, x.detach())
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("n", [1, 2], ids=["one tensor", "several"])
@pytest.mark.parametrize("cast", [False, True], ids=["same dtype", "widened"])
def test_an_inference_graph_copies_nothing_for_a_call_autograd_must_record(n, cast) -> None:
    """``tr.graph``'s inputs (``eager_if_tracked``): with autograd on and an argument that
    requires grad, eager records a backward to it, which the graph cannot; copy_in returns None
    before writing anything (the call then runs eagerly, core/modes.py). Under no_grad, or with
    no argument requiring grad, it copies as before; training graphs never return None."""
    samples = tuple(torch.randn(3, 4) for _ in range(n))
    inp = Inputs(lambda *xs: xs, samples, {}, CPU)
    inp.eager_if_tracked = True
    before = [slot.static.clone() for slot in inp.tensor_slots]
    dtype = torch.float16 if cast else torch.float32
    xs = tuple(torch.randn(3, 4, dtype=dtype) for _ in range(n - 1)) + (
        torch.randn(3, 4, dtype=dtype, requires_grad=True),)
    assert inp.copy_in(xs, {}) is None
    for slot, old in zip(inp.tensor_slots, before):
        assert torch.equal(slot.static, old)  # nothing written
    assert inp.tracked_path(xs, {}) == inp.tensor_slots[-1].path
    with torch.no_grad():
        assert inp.copy_in(xs, {}) is not None
    for slot, x in zip(inp.tensor_slots, xs):
        torch.testing.assert_close(slot.static, x.detach().float())
    plain = tuple(x.detach() for x in xs)
    assert inp.copy_in(plain, {}) is not None  # nothing requires grad: copied
    training = Inputs(lambda *xs: xs, samples, {}, CPU)  # eager_if_tracked off
    assert training.copy_in(xs, {}) is not None


def test_eager_calls_name_the_reason_and_warn_once_each(caplog) -> None:
    """core/modes.py: the mode and autocast reasons, the autograd reason from the leaves, one
    warning per reason, each call counted and run as the plain callable."""
    from torchreplay.core.modes import AUTOCAST, GRAD, TRAIN_MODE, EagerCalls, tracked_leaf

    module = torch.nn.Linear(4, 4).eval()
    calls = EagerCalls("m", training=False)
    assert calls.autocast is None and calls.reason(module) is None
    x = torch.randn(2, 4, requires_grad=True)
    assert calls.reason(module, [3, x]) == GRAD and tracked_leaf([3, x]) == 1
    with torch.no_grad():
        assert calls.reason(module, [3, x]) is None
    module.train()
    assert calls.reason(module, [x]) == TRAIN_MODE
    module.eval()
    from torch.utils.flop_counter import FlopCounterMode

    from torchreplay.core.modes import DISPATCH_MODE

    with FlopCounterMode(display=False):  # a TorchDispatchMode sees every op eagerly
        assert calls.reason(module) == DISPATCH_MODE
    calls.autocast = torch.bfloat16  # as if captured under autocast(bfloat16): now there is none
    assert calls.reason(module) == AUTOCAST
    stats = GraphStats(lambda: 0)
    with caplog.at_level("WARNING", logger="torchreplay"):
        for _ in range(3):
            for why in (AUTOCAST, GRAD):
                y = calls.run(module, (x,), {}, why, stats, "args[0] 'x'")
    assert stats.fallbacks == 6 and y.grad_fn is not None
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2
    assert "autocast(bfloat16)" in said[0] and "no autocast" in said[0]
    assert "args[0] 'x'" in said[1] and "torch.no_grad()" in said[1] and "make_graphed_callables" in said[1]


def test_a_large_argument_passed_again_as_the_same_tensor_is_named_once(caplog) -> None:
    """A KV cache passed as an argument at every step is copied into the graph's buffer and back
    out at every call, where eager copies nothing: one warning says so and how to pass the
    graph's buffer instead. New tensors each call (a batch) and the buffer itself are no reason."""
    def step(x, kv):
        return x

    cache = torch.zeros(64, 1024, 256)  # 64 MiB
    inputs = Inputs(step, (torch.randn(4), cache), {}, CPU)
    inputs.set_written([1])
    assert inputs.large == [1]
    read_only = Inputs(step, (torch.randn(4), cache), {}, CPU)
    read_only.set_written([])
    assert read_only.large == []  # read, not written: copied in only, and no reason to warn
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        for kv in (torch.zeros_like(cache), torch.zeros_like(cache), inputs.static_args[1],
                   inputs.static_args[1]):
            inputs.note_same_large([torch.randn(4), kv], "step")
        assert not caplog.records
        for _ in range(3):
            inputs.note_same_large([torch.randn(4), cache], "step")
    (record,) = caplog.records
    assert "args[1]" in record.getMessage() and "128 MiB of copies a call" in record.getMessage()
    assert "mark_static_address" in record.getMessage() and "g.static_args" in record.getMessage()
    assert inputs.large == []


@pytest.mark.parametrize("shapes", ["one", "sizes"])
def test_a_cache_argument_passed_at_every_call_is_named_and_its_buffer_serves_instead(monkeypatch, caplog, shapes) -> None:
    """tests/gpu/test_writes.py's test, through the emulated capture (test_buckets); the
    warning's second way followed: the graph's buffer used as the cache gives eager's results
    with nothing copied (the caller's tensor is the buffer)."""
    import test_buckets
    import torchreplay as tr

    test_buckets.install_cpu_graphs(monkeypatch.setattr)

    def step(x, kv, pos):
        kv.index_copy_(0, pos, x[:1].expand(1, 64, 1024))
        return x * kv[:8].sum()

    cache = torch.zeros(256, 64, 1024)  # 64 MiB
    ref = cache.clone()
    kw = {"sizes": [2, 4], "dim": {"x": 0, "kv": None, "pos": None}} if shapes == "sizes" else {}
    g = tr.graph(step, torch.randn(4, 1), cache, torch.tensor([0]), **kw)
    assert torch.equal(cache, ref)
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        for p in range(3):
            x, pos = torch.randn(3 if kw else 4, 1), torch.tensor([p])
            torch.testing.assert_close(g(x, cache, pos), step(x, ref, pos))
            assert torch.equal(cache, ref)
    assert len([r for r in caplog.records if "args[1]" in r.getMessage() and "every call" in r.getMessage()]) == 1
    buf = g.static_args[1]
    buf.copy_(cache)
    for p in range(3, 6):
        x, pos = torch.randn(2 if kw else 4, 1), torch.tensor([p])
        torch.testing.assert_close(g(x, buf, pos), step(x, ref, pos))
    assert torch.equal(buf, ref)


def test_an_argument_too_large_to_copy_names_itself_and_where_a_cache_belongs(monkeypatch) -> None:
    """A KV cache sized to fill the device, passed as a tensor argument: its static copy runs
    out of memory. The error names the argument and the layouts read in place."""
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 GiB")

    def step(kv):
        return kv

    monkeypatch.setattr(torch, "empty_like", oom)  # (the test's torch, not the library's)
    with pytest.raises(CaptureError, match=r"args\[0\].*\(0 MiB, shape \(4, 4\).*registered buffer.*cache object"):
        Inputs(step, (torch.randn(4, 4),), {}, CPU)


@pytest.mark.parametrize("shapes", ["one", "sizes"])
def test_a_cache_marked_with_mark_static_address_is_read_and_written_where_it_is(monkeypatch, shapes, caplog) -> None:
    """torch._dynamo.mark_static_address(cache), as for torch.compile's graphs: the graph
    adopts the caller's tensor as its buffer (no copy at capture or at calls; what the build
    wrote into it is put back), and a call with another tensor raises instead of copying into
    the caller's first one."""
    import test_buckets
    import torch._dynamo
    import torchreplay as tr

    test_buckets.install_cpu_graphs(monkeypatch.setattr)

    def step(x, kv, pos):
        kv.index_copy_(0, pos, x[:1].expand(1, 64, 1024))
        return x * kv[:8].sum()

    cache = torch.zeros(256, 64, 1024)
    cache[:6] = torch.randn(6, 64, 1024)  # a prompt at rows 0..5
    torch._dynamo.mark_static_address(cache)
    ref = cache.clone()
    kw = {"sizes": [2, 4], "dim": {"x": 0, "kv": None, "pos": None}} if shapes == "sizes" else {}
    g = tr.graph(step, torch.randn(4, 1), cache, torch.tensor([0]), **kw)
    assert g.static_args[1] is cache and torch.equal(cache, ref)  # adopted; the build put back
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        for p in range(6, 10):
            x, pos = torch.randn(3 if kw else 4, 1), torch.tensor([p])
            torch.testing.assert_close(g(x, cache, pos), step(x, ref, pos))
            assert torch.equal(cache, ref)
    assert not caplog.records  # nothing copied: nothing to warn about
    with pytest.raises(ReplayInputError, match=r"args\[1\].*mark_static_address.*every call must pass it"):
        g(torch.randn(4, 1), ref.clone(), torch.tensor([10]))
    assert torch.equal(cache, ref)


@pytest.mark.parametrize("shapes", ["one", "sizes"])
def test_every_warm_up_starts_from_the_callers_adopted_tensors(monkeypatch, shapes) -> None:
    """An adopted position advanced in place by each call: every warm-up (and the capture)
    starts where the caller left it, as a copied argument's static buffer does. The warm-ups
    ran on from each other's writes, and the third wrote past the cache's end."""
    import test_buckets
    import torch._dynamo
    import torchreplay as tr

    test_buckets.install_cpu_graphs(monkeypatch.setattr)

    def step(x, kv, pos):
        kv.index_copy_(0, pos, x[:1])
        pos.add_(1)
        return x * kv.sum()

    kv, pos = torch.zeros(5, 8), torch.tensor([3])
    for t in (kv, pos):
        torch._dynamo.mark_static_address(t)
    kw = {"sizes": [2, 4], "dim": {"x": 0, "kv": None, "pos": None}} if shapes == "sizes" else {}
    g = tr.graph(step, torch.randn(4, 8), kv, pos, **kw)
    assert g.static_args[1] is kv and g.static_args[2] is pos
    assert int(pos) == 3 and not kv.any()  # the build's writes put back
    ref_kv, ref_pos = kv.clone(), pos.clone()
    for _ in range(2):
        x = torch.randn(3 if kw else 4, 8)
        torch.testing.assert_close(g(x, kv, pos), step(x, ref_kv, ref_pos))
        assert torch.equal(kv, ref_kv) and torch.equal(pos, ref_pos)


def test_an_adopted_argument_that_requires_grad_makes_the_call_eager() -> None:
    """An adopted tensor is never copied, so the copy-in's test for a tensor autograd must
    record (the call then runs eagerly) looks at it too."""
    import torch._dynamo

    def step(x, w):
        return x * w

    w = torch.randn(4, requires_grad=True)
    torch._dynamo.mark_static_address(w)
    inputs = _Inputs(CallArgs(step, (torch.randn(4), w), {}), CPU, adopt=True)
    inputs.eager_if_tracked = True
    assert inputs.adopted and inputs.copy_in((torch.randn(4), w), {}) is None
    with torch.no_grad():
        assert inputs.copy_in((torch.randn(4), w), {}) is not None


def test_an_empty_capture_says_whether_the_work_ran_elsewhere_or_there_was_none() -> None:
    """A callable that only returns (views of) its arguments launches nothing, eagerly too: the
    empty graph's error says so instead of telling the user to move the model to the GPU."""
    from torchreplay.core.failures import empty_message

    x = torch.randn(3, 4)
    none = empty_message(lambda x: x, (x,), {}, (x.view(-1), x[1:]), CPU)
    assert "returns its arguments or views of them" in none and "move" not in none
    # A tensor it did not compute (a parameter's view: a learned positional embedding's
    # ``self.weight[:n]``): launches nothing too. Off the graph's device: the work ran elsewhere.
    weight = torch.randn(8, 4)
    param = empty_message(lambda x: weight[:3], (x,), {}, weight[:3], CPU)
    assert "tensors it did not compute" in param and "move" not in param
    elsewhere = empty_message(lambda x: x, (x,), {}, torch.ones(3), torch.device("cuda"))
    assert "ran on the CPU or on another device" in elsewhere
    assert "ran on the CPU" in empty_message(lambda: 0, (), {}, None, CPU)
    # A breakable graph whose every op ran inside its breaks: not "move the model to the GPU".
    inside = empty_message(lambda x: x, (x,), {}, torch.ones(3), CPU, breaks=True)
    assert "outside its breaks" in inside and "every op ran inside a break" in inside
    assert "move the module" not in inside and "breaks=\"auto\"" in inside
    assert "returns its arguments" in empty_message(lambda x: x, (x,), {}, x.view(-1), CPU, breaks=True)


def test_an_output_object_holding_graph_tensors_is_refused_with_the_fix() -> None:
    """A decoder called with use_cache=True and no cache makes a DynamicCache at each call and
    returns it: a graph would hand out the capture's object every time, its tensors overwritten
    by the next replay, unchecked. Tensors, pytrees and objects holding other tensors pass."""
    from torchreplay.core.graphed import refuse_objects_holding_graph_tensors as refuse

    class Cache:
        def __init__(self, keys):
            self.layers = [{"keys": keys}]

    made, state = torch.ones(2), torch.zeros(2)
    owned = lambda t: t is made  # noqa: E731
    refuse((made, [made], {"a": made}, None, 3, "s", torch.float32), owned, "step")
    refuse((made, Cache(state)), owned, "step")
    with pytest.raises(CaptureError, match=r"'step' returns a Cache \(output 1\) that holds a tensor the graph made \(output 1\.layers\[0\]\['keys'\]\).*use_cache=False"):
        refuse((made, Cache(made)), owned, "step")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=50)
    out = transformers.LlamaForCausalLM(cfg).eval()(torch.randint(0, 50, (1, 4)))
    with pytest.raises(CaptureError, match=r"returns a DynamicCache .*layers\[0\]\.(keys|values)"):
        refuse(out, lambda t: True, "LlamaForCausalLM")
