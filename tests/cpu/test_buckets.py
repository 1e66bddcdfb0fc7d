"""Many sizes on the CPU: size selection, default sizes, the dim and fill specs and their errors,
output slicing plans, the fallback and cap policy, and the whole BucketedGraph hot path with the
CUDA parts replaced by an eager stand-in (a "graph" that re-runs the captured call on the same
static buffers, which is what a replay computes)."""

from __future__ import annotations

import contextlib
import logging
from collections import namedtuple
from typing import Any

import pytest
import torch
import torch.nn as nn

import torchreplay as tr
from torchreplay.core.args import CallArgs
from torchreplay.core.capture import Captured, from_the_start
from torchreplay.core.effects import NO_EFFECTS
from torchreplay.core.writes import WriteWatch
from torchreplay.core import graphed
from torchreplay.sizes import bucketed as buckets
from torchreplay.sizes import probe as probing
from torchreplay.sizes.outputs import plan_outputs
from torchreplay.sizes.plan import (
    decide,
    default_sizes,
    format_sizes,
    narrow_leading,
    target_size,
)
from torchreplay.sizes.plan import plan_inputs as _plan_inputs
from torchreplay.config import BucketConfig
from torchreplay.errors import CaptureError, ReplayInputError, UnsupportedError

# -- default sizes and size selection -----------------------------------------------------------


def plan_inputs(fn, args, kwargs, dim=0, fill_value=0):
    """The plan of a sample call given as (fn, args, kwargs)."""
    return _plan_inputs(CallArgs(fn, args, kwargs), dim, fill_value)


def test_default_sizes_are_vllms() -> None:
    sizes = default_sizes(512)
    assert len(sizes) == 67
    assert sizes[:6] == [1, 2, 4, 8, 16, 24]
    assert sizes[-1] == 512 and all(s % 8 == 0 for s in sizes[3:])
    assert tr.default_sizes() == sizes
    assert default_sizes(1) == [1]
    assert default_sizes(3) == [1, 2, 3]
    assert default_sizes(8) == [1, 2, 4, 8]
    assert default_sizes(20) == [1, 2, 4, 8, 16, 20]  # the maximum is always covered


@pytest.mark.parametrize("bad", [0, -8, 2.5, True, "512"])
def test_default_sizes_rejects_bad_maximum(bad: Any) -> None:
    with pytest.raises(ValueError, match="max_size"):
        default_sizes(bad)


def test_target_is_the_smallest_size_that_holds_n() -> None:
    sizes = [1, 2, 4, 8, 16, 24, 32]
    expected = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8, 9: 16, 16: 16, 17: 24, 25: 32, 32: 32}
    for n, s in expected.items():
        assert target_size(sizes, n) == s
    assert target_size(sizes, 33) is None
    assert target_size(sizes, 0) is None
    # every n picks the smallest captured size >= n, checked exhaustively
    for n in range(1, 33):
        assert target_size(sizes, n) == min(s for s in sizes if s >= n)


def test_bucket_config_sorts_dedupes_and_validates() -> None:
    assert BucketConfig([8, 1, 4, 4, 2]).sizes == (1, 2, 4, 8)
    assert BucketConfig(range(1, 4)).sizes == (1, 2, 3)
    for bad, words in [
        ([], "empty"),
        ([0, 1], ">= 1"),
        ([-4], ">= 1"),
        ([1.5], "ints"),
        ([True], "ints"),
        (8, "list of ints"),
        ("8", "list of ints"),
    ]:
        with pytest.raises(ValueError, match=words):
            BucketConfig(bad)
    with pytest.raises(ValueError, match="capture must be"):
        BucketConfig([1], capture="eventually")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fallback must be"):
        BucketConfig([1], fallback="pad")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_graphs must be"):
        BucketConfig([1], capture="lazy", max_graphs=0)
    with pytest.raises(ValueError, match="capture='lazy'"):
        BucketConfig([1, 2, 4], capture="ahead", max_graphs=2)


def test_format_sizes_keeps_both_ends() -> None:
    assert format_sizes([4, 1, 2]) == "1, 2, 4"
    assert format_sizes(default_sizes(512)) == "1, 2, 4, 8, 16, 24, ..., 504, 512 (67 sizes)"


def test_narrow_leading_slices_only_the_named_dims() -> None:
    t = torch.arange(4 * 5 * 4).view(4, 5, 4)
    assert narrow_leading(t, (0,), 3).shape == (3, 5, 4)
    assert narrow_leading(t, (0, 2), 3).shape == (3, 5, 3)
    assert narrow_leading(t, (), 3) is t
    assert torch.equal(narrow_leading(t, (1,), 2), t[:, :2])


# -- the dim and fill specs -------------------------------------------------------------------


def decode(input_ids, positions, cache, *, mode="greedy"):
    return input_ids


def decode_args(b: int = 3):
    return (torch.zeros(b, 1, dtype=torch.long), torch.zeros(b, dtype=torch.long),
            torch.zeros(8, 16)), {"mode": "greedy"}


def test_int_dim_applies_to_every_tensor_argument() -> None:
    args, kwargs = decode_args()
    args = args[:2] + (torch.zeros(3, 16),)
    plan = plan_inputs(decode, args, kwargs, 0)
    assert plan.dims == (0, 0, 0, None)  # the string kwarg is a constant
    assert plan.size == 3 and plan.lead == 0
    assert plan.paths[0] == "args[0] 'input_ids'"
    assert plan.fills == (0, 0, 0, None)
    assert plan.where() == "args[0] 'input_ids' along dim 0"


def test_negative_dim_is_normalized_per_tensor() -> None:
    plan = plan_inputs(lambda a, b: a, (torch.zeros(2, 5), torch.zeros(7, 3, 5)), {}, -1)
    assert plan.dims == (1, 2)
    assert plan.size == 5


def test_dict_dim_by_name_position_and_keyword() -> None:
    args, kwargs = decode_args()
    plan = plan_inputs(decode, args, kwargs, {"input_ids": 0, "positions": 0, "cache": None})
    assert plan.dims == (0, 0, None, None)
    plan = plan_inputs(decode, args, kwargs, {0: 0, 1: 0})  # positions; unnamed = static
    assert plan.dims == (0, 0, None, None)
    kw = {"input_ids": args[0], "positions": args[1], "cache": args[2]}
    plan = plan_inputs(decode, (), kw, {"input_ids": 0, "positions": 0})
    assert plan.dims == (0, 0, None)
    assert plan.paths[1] == "kwargs['positions']"


def test_nested_spec_matches_the_argument_containers() -> None:
    def fn(batch, state):
        return batch

    batch = {"x": torch.zeros(4, 3), "mask": torch.zeros(4, dtype=torch.bool), "n": 7}
    state = (torch.zeros(10), torch.zeros(4, 2))
    plan = plan_inputs(fn, (batch, state), {}, {"batch": 0, "state": (None, 0)})
    assert plan.dims == (0, 0, None, None, 0)  # the int in the dict never varies
    plan = plan_inputs(fn, (batch, state), {}, {"batch": {"x": 0, "mask": None, "n": None}})
    assert plan.dims == (0, None, None, None, None)
    with pytest.raises(ReplayInputError, match="no entry for \\[1\\]"):
        plan_inputs(fn, (batch, state), {}, {"state": (0,)})
    NT = namedtuple("NT", "a b")
    plan = plan_inputs(lambda p: p, (NT(torch.zeros(2, 2), torch.zeros(3)),), {}, {"p": {"a": 1}})
    assert plan.dims == (1, None)


@pytest.mark.parametrize(
    "dim, words",
    [
        ({"ids": 0}, ["dim names 'ids'", "'input_ids'", "'positions'", "'cache'", "'mode'"]),
        ({5: 0}, ["positional argument 5", "3 positional arguments"]),
        ({"input_ids": 0, 0: 0}, ["twice"]),
        ({"input_ids": 2}, ["dim 2 is out of range", "args[0] 'input_ids'", "(3, 1)", "[-2, 1]"]),
        (3, ["out of range"]),
        ({"input_ids": 0, "mode": 0}, ["kwargs['mode']", "not a tensor"]),
        ({"input_ids": None}, ["makes no tensor argument vary"]),
        (None, ["makes no tensor argument vary"]),
        ("0", ["dim must be an int"]),
        ({"input_ids": 0.0}, ["expected a value"]),
        ({"input_ids": (0, 0)}, ["goes deeper", "input_ids"]),
    ],
)
def test_dim_spec_errors_name_the_argument(dim: Any, words: list[str]) -> None:
    args, kwargs = decode_args()
    with pytest.raises(ReplayInputError) as e:
        plan_inputs(decode, args, kwargs, dim)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_parameter_not_passed_in_the_sample_call_is_named() -> None:
    with pytest.raises(ReplayInputError, match="does not pass it"):
        plan_inputs(lambda x, y=None: x, (torch.zeros(2),), {}, {"x": 0, "y": 0})


def test_zero_dim_tensor_under_an_int_dim_says_how_to_exclude_it() -> None:
    with pytest.raises(ReplayInputError, match="0-dim tensor.*None"):
        plan_inputs(lambda x, t: x, (torch.zeros(2, 3), torch.tensor(0.5)), {}, 0)


def test_sample_varying_dims_that_disagree_name_both_arguments() -> None:
    args, kwargs = decode_args()
    args = (args[0], torch.zeros(4, dtype=torch.long), args[2])
    with pytest.raises(ReplayInputError) as e:
        plan_inputs(decode, args, kwargs, {"input_ids": 0, "positions": 0})
    msg = str(e.value)
    assert "args[0] 'input_ids' has size 3 along dim 0" in msg
    assert "args[1] 'positions' has size 4" in msg
    assert "share one size" in msg


def test_fill_values_per_argument_and_their_checks() -> None:
    args, kwargs = decode_args()
    dims = {"input_ids": 0, "positions": 0}
    plan = plan_inputs(decode, args, kwargs, dims, {"input_ids": 2})
    assert plan.fills == (2, 0, None, None)  # unnamed varying arguments pad with 0
    plan = plan_inputs(decode, args, kwargs, dims, 5)
    assert plan.fills == (5, 5, None, None)
    f = plan_inputs(lambda x: x, (torch.zeros(2),), {}, 0, -1.5)
    assert f.fills == (-1.5,)
    with pytest.raises(ReplayInputError, match="not a whole number"):
        plan_inputs(decode, args, kwargs, dims, 0.5)
    with pytest.raises(ReplayInputError, match="bool"):
        plan_inputs(lambda m: m, (torch.zeros(2, dtype=torch.bool),), {}, 0, 3)
    with pytest.raises(ReplayInputError, match="fill_value names args\\[2\\].*does not vary"):
        plan_inputs(decode, args, kwargs, dims, {"cache": 1.0})
    with pytest.raises(ReplayInputError, match="fill_value names 'nope'"):
        plan_inputs(decode, args, kwargs, dims, {"nope": 1})
    with pytest.raises(ReplayInputError, match="fill_value must be"):
        plan_inputs(decode, args, kwargs, dims, "zero")


def test_shape_at_and_padding_arithmetic() -> None:
    plan = plan_inputs(lambda x, y: x, (torch.zeros(5, 3), torch.zeros(2, 5)), {}, {"x": 0, "y": 1})
    assert plan.shape_at((16, 3), 0, 5) == (5, 3)
    assert plan.shape_at((2, 16), 1, 9) == (2, 9)
    sizes = [1, 2, 4, 8, 16]
    pads = {n: target_size(sizes, n) - n for n in range(1, 17)}
    assert pads[3] == 1 and pads[5] == 3 and pads[9] == 7 and pads[16] == 0


# -- output plans ---------------------------------------------------------------------------


def _never(t: torch.Tensor) -> bool:
    return False


def test_output_plan_slices_dims_equal_to_the_size() -> None:
    def f(n):
        return {"logits": torch.zeros(n, 10), "t": torch.zeros(3, n), "w": torch.zeros(4), "n": n,
                "tag": "x"}

    plan = plan_outputs(f(16), 16, f(8), 8, _never)
    kinds = {leaf.path: (leaf.kind, leaf.dims) for leaf in plan.leaves}
    assert kinds["output['logits']"] == ("owned", (0,))
    assert kinds["output['t']"] == ("owned", (1,))
    assert kinds["output['w']"] == ("owned", ())
    assert kinds["output['n']"] == ("size", ())
    assert kinds["output['tag']"] == ("constant", ())
    logits = plan.leaves[0]
    assert logits.shape == (16, 10) and logits.shape_at(5) == (5, 10)
    assert plan.mismatch(f(4), 4) is None
    assert "shape" in plan.mismatch({**f(4), "logits": torch.zeros(4, 11)}, 4)


def test_output_plan_pairwise_output_slices_both_dims() -> None:
    plan = plan_outputs(torch.zeros(8, 8), 8, torch.zeros(4, 4), 4, _never)
    assert plan.leaves[0].dims == (0, 1)


def test_output_plan_external_state_is_returned_as_is() -> None:
    cache = torch.zeros(16, 4)

    def is_state(t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()

    plan = plan_outputs((cache[:16], cache, torch.ones(16)), 16, (cache[:8], cache, torch.ones(8)),
                        8, is_state)
    assert [(leaf.kind, leaf.dims) for leaf in plan.leaves] == [
        ("external", (0,)), ("external", ()), ("owned", (0,))]
    assert plan.external == [0, 1] and plan.owned == [2]


def test_output_plan_single_size_one_slices_nothing() -> None:
    plan = plan_outputs(torch.zeros(1, 4), 1, None, None, _never)
    assert plan.leaves[0].dims == ()


@pytest.mark.parametrize(
    "big, small, words",
    [
        (torch.zeros(16 * 4), torch.zeros(8 * 4), ["dim 0 changes with the size", "flattened"]),
        ((torch.zeros(16),), [torch.zeros(8)], ["structure differs"]),
        (torch.zeros(16), 3, ["same kind of output"]),
        ((torch.zeros(16), "a"), (torch.zeros(8), "b"), ["'a' at size 16 but 'b'", "constant"]),
    ],
)
def test_output_plan_errors(big: Any, small: Any, words: list[str]) -> None:
    with pytest.raises(UnsupportedError) as e:
        plan_outputs(big, 16, small, 8, _never)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


# -- fallback and cap policy -----------------------------------------------------------------


def test_decide_replays_captured_sizes() -> None:
    opts = BucketConfig([1, 2, 4, 8])
    assert decide(opts, 3, {1, 2, 4, 8}).action == "replay"
    assert decide(opts, 3, {1, 2, 4, 8}).size == 4


def test_decide_above_the_largest_size() -> None:
    eager = decide(BucketConfig([1, 2, 4, 8]), 9, {1, 2, 4, 8}, name="MLP",
                   where="args[0] 'x' along dim 0")
    assert (eager.action, eager.reason) == ("eager", "above")
    assert "size 9 (args[0] 'x' along dim 0)" in eager.message
    assert "1, 2, 4, 8" in eager.message and "Add 9 to sizes" in eager.message
    err = decide(BucketConfig([1, 2, 4, 8], fallback="error"), 17, {1, 2, 4, 8}, name="MLP")
    assert err.action == "error"
    assert "largest captured size is 8" in err.message
    assert "add 17 to sizes or pass fallback='eager'" in err.message


def test_decide_size_zero() -> None:
    assert decide(BucketConfig([1, 2]), 0, {1, 2}).action == "eager"
    err = decide(BucketConfig([1, 2], fallback="error"), 0, {1, 2})
    assert err.action == "error" and "size 0" in err.message and "fallback='eager'" in err.message


def test_decide_lazy_captures_until_the_cap() -> None:
    opts = BucketConfig([1, 2, 4, 8], capture="lazy", max_graphs=2)
    assert decide(opts, 3, {8}) == decide(opts, 4, {8})
    assert decide(opts, 3, {8}).action == "capture" and decide(opts, 3, {8}).size == 4
    capped = decide(opts, 1, {8, 4})
    assert (capped.action, capped.reason, capped.size) == ("eager", "cap", 1)
    assert "max_graphs=2" in capped.message and "4, 8" in capped.message
    assert decide(opts, 3, {8, 4}).action == "replay"  # a held size still replays
    strict = BucketConfig([1, 2, 4, 8], capture="lazy", max_graphs=2, fallback="error")
    err = decide(strict, 2, {8, 4})
    assert err.action == "error" and "raise max_graphs or pass fallback='eager'" in err.message
    assert decide(BucketConfig([1, 2, 4, 8], capture="lazy"), 1, {8, 4, 2}).action == "capture"


# -- BucketedGraph end to end, with an eager stand-in for CUDA ---------------------------------


class _EagerGraph:
    """Stands in for a captured graph: replay re-runs the captured call on the same buffers."""

    def __init__(self, fn, args, kwargs, out=None) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.replays = 0
        # the capture's output tensors, which a real replay writes in place
        self.outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]

    def replay(self) -> None:
        self.replays += 1
        with torch.no_grad():
            new = self.fn(*self.args, **self.kwargs)
            new = [t for t in torch.utils._pytree.tree_leaves(new) if isinstance(t, torch.Tensor)]
            for old, t in zip(self.outs, new):
                if old is not t:
                    old.copy_(t)


@contextlib.contextmanager
def _runs_nothing(args: Any, kwargs: Any) -> Any:
    """Around the emulated capture, which runs the call for real: the modules' buffers and the
    arguments' tensors are put back after it, as a real capture, which records work and runs
    none, leaves them."""
    saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {
        id(t): (t, t.detach().clone())
        for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
    }

    def first(module: torch.nn.Module, args: Any) -> None:
        for b in module.buffers(recurse=False):
            saved.setdefault(id(b), (b, b.detach().clone()))

    handle = torch.nn.modules.module.register_module_forward_pre_hook(first)
    try:
        yield
    finally:
        handle.remove()
        with torch.no_grad():
            for b, copy in saved.values():
                b.copy_(copy)


def install_cpu_graphs(setattr_: Any) -> list[int]:
    """Make tr.graph(sizes=...) and tr.graph of one shape run on the CPU through ``setattr_``
    (monkeypatch's, or plain ``setattr`` in a spawned rank); returns the sizes captured, in
    order. (On a CPU build, checked outputs fall back to clones.)"""
    order: list[int] = []

    def fake_capture(fn, args, kwargs, *, device, stream, pool, config, grad=False, warmup=True,
                     snapshot=None, watch=(), collectives=True, effects=None, reset=None, owner=None, copy_in=()):
        watcher = WriteWatch(watch)
        python = effects if effects is not None else NO_EFFECTS  # as capture() runs it
        running = snapshot.running() if snapshot is not None else contextlib.nullcontext()
        with torch.no_grad(), running:
            n = config.num_warmup_iters if warmup else 0
            if warmup:
                python.start()
            for i in range(n):
                if reset is not None:
                    reset()
                if i:
                    from_the_start(snapshot, python)
                with python.warmup(last=i == n - 1):
                    fn(*args, **kwargs)
            if n:
                from_the_start(snapshot, python)
            if reset is not None:
                reset()
            python.before_capture()
            with _runs_nothing(args, kwargs), watcher, python.captured():  # (its put-back unwatched)
                out = fn(*args, **kwargs)
            err = python.verdict()
            if err is not None:
                python.undo()
                raise err
            python.put_back_tensors()
        leaves = [t for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)]
        order.append(max((t.shape[0] for t in leaves if t.dim()), default=0))
        return Captured(_EagerGraph(fn, args, kwargs, out), out, 0.0, tuple(watcher.written))

    for module in (buckets, graphed):  # (tr.graph of one shape too)
        setattr_(module, "capture", fake_capture)
        setattr_(module, "infer_device", lambda fn, call, device=None: torch.device("cpu"))
        setattr_(module, "side_stream", lambda device: None)
    setattr_(probing, "on_side_stream", lambda s, d: contextlib.nullcontext())
    as_cpu_build(setattr_)
    return order


def as_cpu_build(setattr_: Any) -> None:
    """Run the emulated graphs as on a CPU build of torch even under a CUDA wheel (this machine
    under another Python, or the GPU machine): no stream to read for the CPU pool, and checked
    outputs handed out as clones."""
    from torchreplay import _compat
    from torchreplay.core import threads

    for module in (threads, graphed):
        setattr_(module, "_current_stream", lambda index: (0, index, 0))
    setattr_(_compat, "HAS_CHECKED_OUTPUTS", False)


@pytest.fixture
def cpu_graphs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make tr.graph (sizes= or one shape) run on the CPU; returns the sizes captured, in order."""
    return install_cpu_graphs(monkeypatch.setattr)


SIZES = [1, 2, 4, 8, 16]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 5)).eval()


def test_every_size_matches_eager_on_the_real_rows(cpu_graphs: list[int]) -> None:
    model = _mlp()
    g = tr.graph(model, torch.randn(3, 6), sizes=SIZES)
    assert isinstance(g, tr.BucketedGraph)
    assert cpu_graphs == [16, 8, 4, 2, 1]  # largest first
    assert g.captured_sizes == SIZES
    for n in range(1, 17):
        x = torch.randn(n, 6)
        y = g(x)
        with torch.no_grad():
            ref = model(x)
        assert y.shape == (n, 5)
        assert torch.allclose(y, ref, atol=1e-6)
    assert g.stats.replays == 16 and g.stats.fallbacks == 0
    assert g.stats.size_hits == {1: 1, 2: 1, 4: 2, 8: 4, 16: 8}
    assert g.stats.real_rows == sum(range(1, 17))
    assert g.stats.padded_rows == sum(target_size(SIZES, n) - n for n in range(1, 17))
    assert 0 < g.stats.pad_waste < 1
    assert "size hits" in repr(g)


def _recorder(width: int = 3, max_rows: int = 16) -> nn.Module:
    class Recorder(nn.Module):
        """Row-independent; records the rows it saw (padding included) in a buffer."""

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("seen", torch.full((max_rows, width), -99.0))

        def forward(self, x):
            self.seen[: x.shape[0]].copy_(x)
            return x * 2 + 1

    return Recorder().eval()


def test_padding_rows_hold_the_fill_value_and_never_leak(cpu_graphs: list[int]) -> None:
    m = _recorder()
    g = tr.graph(m, torch.randn(2, 3), sizes=[4, 8, 16], fill_value=-7.0)
    for n in [13, 5, 3, 16, 1, 6]:
        x = torch.randn(n, 3)
        y = g(x)
        s = target_size([4, 8, 16], n)
        assert torch.equal(y, x * 2 + 1) and y.shape == (n, 3)
        assert torch.equal(m.seen[:n], x)
        assert torch.all(m.seen[n:s] == -7.0), (n, m.seen[n:s])  # never the previous call's rows


def test_a_callable_that_writes_its_input_gets_clean_padding(cpu_graphs: list[int]) -> None:
    m = _recorder()

    def fn(x):
        out = m(x)
        x.add_(100.0)  # dirties every row, padding included
        return out

    g = tr.graph(fn, torch.randn(4, 3), sizes=[8, 16])
    assert g._writes_inputs
    for n in [6, 6, 3, 12, 9]:
        x = torch.randn(n, 3)
        want, x_after = x * 2 + 1, x + 100.0
        assert torch.equal(g(x), want)
        assert torch.all(m.seen[n:target_size([8, 16], n)] == 0.0)
        assert torch.equal(x, x_after)  # eager semantics: the write reached the caller's rows


def test_fill_is_skipped_when_the_padding_is_already_clean(cpu_graphs: list[int],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    g = tr.graph(lambda x: x * 3, torch.randn(4, 3), sizes=[8, 16])
    pads: list[int] = []
    real_pad = g._pad
    monkeypatch.setattr(g, "_pad", lambda n: (pads.append(n), real_pad(n)))
    for n in [5, 5, 5, 7, 3, 3, 12, 12]:
        g(torch.randn(n, 3))
    assert pads == [5, 3]  # first call (buffers dirty after warm-up), then only when n shrinks


def test_dict_dims_with_a_static_argument_and_constants(cpu_graphs: list[int]) -> None:
    def fn(ids, pos, table, *, scale):
        return table[ids[:, 0]] * scale + pos[:, None].float()

    table = torch.randn(10, 4)
    g = tr.graph(fn, torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, dtype=torch.long), table,
                 sizes=[2, 4, 8], dim={"ids": 0, "pos": 0, "table": None}, scale=0.5)
    for n in range(1, 9):
        ids = torch.randint(0, 10, (n, 1))
        pos = torch.randint(0, 100, (n,))
        assert torch.allclose(g(ids, pos, table, scale=0.5), fn(ids, pos, table, scale=0.5))
    with pytest.raises(ReplayInputError, match="kwargs\\['scale'\\].*0.25"):
        g(ids, pos, table, scale=0.25)
    with pytest.raises(ReplayInputError) as e:
        g(torch.zeros(3, 1, dtype=torch.long), torch.zeros(5, dtype=torch.long), table, scale=0.5)
    assert "args[0] 'ids' has size 3 along dim 0 but args[1] 'pos' has size 5" in str(e.value)
    with pytest.raises(ReplayInputError, match="static.*dim=") as e:
        g(ids, pos, torch.randn(11, 4), scale=0.5)
    with pytest.raises(ReplayInputError, match="only dim 0 varies"):
        g(torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, dtype=torch.long), table, scale=0.5)
    with pytest.raises(ReplayInputError, match=r"\.to\(torch.int64\)"):  # not lossless
        g(torch.zeros(3, 1, dtype=torch.float32), torch.zeros(3, dtype=torch.long), table, scale=0.5)
    ids32 = torch.randint(0, 10, (3, 1), dtype=torch.int32)  # int32 -> int64 is lossless: copied in
    assert torch.allclose(g(ids32, pos[:3], table, scale=0.5), fn(ids32.long(), pos[:3], table, scale=0.5))
    with pytest.raises(ReplayInputError, match="expected a tensor"):
        g([1, 2], pos, table, scale=0.5)


def test_fallback_above_the_largest_size_warns_once_per_size(cpu_graphs: list[int],
                                                              caplog: pytest.LogCaptureFixture) -> None:
    model = _mlp()
    g = tr.graph(model, torch.randn(2, 6), sizes=[1, 2, 4])
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        for n in [5, 5, 6, 5, 6, 7]:
            x = torch.randn(n, 6)
            with torch.no_grad():
                assert torch.allclose(g(x), model(x))
    warnings = [r for r in caplog.records if "above the largest captured size" in r.getMessage()]
    assert len(warnings) == 3
    assert "size 5" in warnings[0].getMessage() and "1, 2, 4" in warnings[0].getMessage()
    assert g.stats.fallbacks == 6 and g.stats.replays == 0


def test_fallback_error_raises_naming_the_size_and_the_fix(cpu_graphs: list[int]) -> None:
    g = tr.graph(_mlp(), torch.randn(2, 6), sizes=[1, 2, 4], fallback="error")
    with pytest.raises(ReplayInputError, match="size 9.*add 9 to sizes or pass fallback='eager'"):
        g(torch.randn(9, 6))
    with pytest.raises(ReplayInputError, match="size 0"):
        g(torch.randn(0, 6))
    assert g(torch.randn(3, 6)).shape == (3, 5)


def test_lazy_captures_on_first_use_up_to_the_cap(cpu_graphs: list[int],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    model = _mlp()
    g = tr.graph(model, torch.randn(2, 6), sizes=SIZES, capture="lazy", max_graphs=3)
    assert cpu_graphs == [16] and g.captured_sizes == [16]
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        for n in [3, 4, 9, 1, 2, 1, 16, 3]:
            x = torch.randn(n, 6)
            with torch.no_grad():
                assert torch.allclose(g(x), model(x), atol=1e-6)
    # 3 captures 4; 9 replays 16; 1 captures the third graph; 2 then hits the cap: eager
    assert cpu_graphs == [16, 4, 1] and g.captured_sizes == [1, 4, 16]
    assert g.stats.fallbacks == 1 and g.stats.replays == 7
    capped = [r.getMessage() for r in caplog.records if "max_graphs=3" in r.getMessage()]
    assert len(capped) == 1 and "size 2" in capped[0]


def test_lazy_and_ahead_agree(cpu_graphs: list[int]) -> None:
    model = _mlp()
    ahead = tr.graph(model, torch.randn(2, 6), sizes=SIZES)
    lazy = tr.graph(model, torch.randn(2, 6), sizes=SIZES, capture="lazy")
    for n in [7, 1, 16, 3, 12]:
        x = torch.randn(n, 6)
        assert torch.equal(ahead(x), lazy(x))


def test_outputs_of_module_state_are_returned_as_is(cpu_graphs: list[int]) -> None:
    class Cache(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("k", torch.zeros(8, 3))

        def forward(self, x):
            self.k[: x.shape[0]] += x
            return self.k[: x.shape[0]], self.k, x.sum(-1), x.shape[0]

    m = Cache().eval()
    g = tr.graph(m, torch.zeros(8, 3), sizes=[2, 4, 8])
    m.k.zero_()  # the stand-in capture ran the call once more than a real capture would
    x = torch.randn(3, 3)
    rows, whole, sums, n = g(x)
    assert whole is m.k and rows.shape == (3, 3) and n == 3
    assert rows.untyped_storage().data_ptr() == m.k.untyped_storage().data_ptr()
    assert torch.allclose(rows, x) and torch.allclose(sums, x.sum(-1))


def test_batch_norm_in_training_mode_is_refused(cpu_graphs: list[int]) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train()
    with pytest.raises(tr.UnsupportedError, match="BatchNorm1d '1' in training mode.*eval"):
        tr.graph(model, torch.randn(2, 4), sizes=[2, 4])
    tr.graph(model.eval(), torch.randn(2, 4), sizes=[2, 4])  # eval mode is row-independent
    tr.graph(nn.Sequential(nn.Linear(4, 4), nn.Dropout()).train(), torch.randn(2, 4), sizes=[2])


def test_train_eval_switch_falls_back_to_eager(cpu_graphs: list[int]) -> None:
    model = _mlp()
    g = tr.graph(model, torch.randn(2, 6), sizes=[2, 4])
    model.train()
    g(torch.randn(3, 6))
    assert g.stats.fallbacks == 1 and g.stats.replays == 0
    model.eval()
    g(torch.randn(3, 6))
    assert g.stats.replays == 1


def test_a_probe_that_fails_names_the_size_and_line(cpu_graphs: list[int]) -> None:
    def fn(x):
        return x.view(4, 2)  # fails-below-4

    with pytest.raises(CaptureError, match="at size 2") as e:
        tr.graph(fn, torch.randn(4, 2), sizes=[2, 4])
    assert "fails-below-4" in str(e.value) and "every size in sizes" in str(e.value)


def test_an_output_that_is_not_sliceable_is_refused(cpu_graphs: list[int]) -> None:
    with pytest.raises(UnsupportedError, match="flattened"):
        tr.graph(lambda x: x.reshape(-1), torch.randn(4, 2), sizes=[2, 4])


def test_graph_options_need_sizes() -> None:
    x = torch.randn(2)
    with pytest.raises(TypeError, match="dim=.*only apply with sizes=.*sample_kwargs"):
        tr.graph(lambda x, dim=0: x, x, dim=1)
    with pytest.raises(TypeError, match="spelled dim="):
        tr.graph(lambda x: x, x, sizes=[1, 2], dims={"x": 0})


def test_llama_sizes_bench_row_pads_13_to_16() -> None:
    from torchreplay.bench import inference as bench

    assert list(bench.LLAMA_SIZES) == default_sizes(32)
    padded = {b: target_size(bench.LLAMA_SIZES, b) for b in bench.LLAMA_SIZES_BATCHES}
    assert padded == {1: 1, 8: 8, 32: 32, 13: 16}
    assert {bench.TR_SIZES, bench.TR_SIZES_STATIC} <= set(bench.METHODS)


# ---------------------------------------------------------------------------------------------
# The piecewise runtime's padding of the buffers every size shares (pieces/entries.py)


@pytest.mark.parametrize("writes", [False, True])
@pytest.mark.parametrize("fill", [0, -1.0])
def test_shared_padding_rows_hold_the_fill_at_every_call_and_are_reset_only_when_dirty(
    writes: bool, fill: float
) -> None:
    """A stand-in for the runtime's calls: each call of ``n`` rows at its size copies its rows
    in, pads, "replays" (reads rows [0, size); a program writing its input dirties them all),
    and the padding rows read must hold the fill value. Resets happen only after a call left
    rows of its own beyond the next call's."""
    from torchreplay.pieces.entries import Entry, Route, pad_shared

    sizes = [1, 2, 4, 8]
    base = torch.full((8, 3), 7.0)  # as staging leaves it: nothing is known
    clean: dict[int, int] = {}
    resets = 0
    for call, n in enumerate([8, 3, 3, 5, 2, 7, 1, 8, 4, 3, 3, 6, 6]):
        size = next(s for s in sizes if s >= n)
        route = Route(n, Entry(size), ())
        route.bases.append((base, fill))
        before = base.clone()
        pad_shared(route, clean, writes)
        resets += int(not torch.equal(before, base))
        base[:n] = torch.randn(n, 3)  # the copy-in
        assert base[n:size].eq(fill).all(), (call, n, size, base)  # what the graph reads
        if writes:
            base[:size] += 1  # the program writes its input in place, padding rows too
    # Without writes only the two 3-row calls after an 8-row one reset; a 5 or 6 after a 3, a
    # 3 after a 3 and every call at its size's full rows do not. With writes, each call padded
    # within rows the last replay wrote resets (six), but not the 5 after the 4-row size's 3.
    assert resets == (6 if writes else 2), resets


def test_run_padded_runs_at_the_agreed_rows_and_gives_back_the_calls_own() -> None:
    """What ranks that all run a call eagerly do (core/padding.py): the call's rows padded to
    the agreed size with the fill value, an int size argument set to it, its in-place writes
    reaching the caller's rows, its outputs cut back (an int output that is the size too)."""
    from torchreplay.core.padding import run_padded

    seen = []

    def call(leaves):
        x, n, scale = leaves
        seen.append((x.clone(), n))
        x.add_(1)  # an in-place write
        return [x * scale, n, torch.ones(3), x]

    x = torch.arange(6.0).reshape(3, 2)
    out = run_padded(call, [x, 3, 2.0], 3, 5, dims=[0, None, None], fills=[-1, None, None],
                     out_dims=[(0,), "size", (0,), (0,)], sizes=[False, True, False])
    padded, n = seen[0]
    assert n == 5 and padded.shape == (5, 2) and (padded[3:] == -1).all()
    torch.testing.assert_close(x, torch.arange(6.0).reshape(3, 2) + 1)  # the write came back
    torch.testing.assert_close(out[0], x * 2)
    assert out[1] == 3
    assert out[2].shape == (3,)  # 3 is not the padded size: left as it is
    assert out[3] is x  # the argument returned: the caller's tensor, not the padded copy's rows


def test_an_output_that_is_an_argument_is_the_callers_tensor(cpu_graphs) -> None:
    """``return y, mask, x`` with sizes=: eagerly the caller's own tensors. A mask of fixed shape
    came back as the graph's static buffer, which the next call's copy-in overwrote with no
    error; a varying argument as a copy in the output buffers. A view of either is a view of
    the caller's (``mask[:2]``, ``x[:, -1:]``; the varying one's was a copy too)."""
    def f(x: torch.Tensor, mask: torch.Tensor) -> Any:
        return x * mask.sum(), mask, x, mask[:2], x[:, -1:]

    g = tr.graph(f, torch.randn(4, 3), torch.randn(3), sizes=[2, 4], dim={"x": 0, "mask": None})
    kept = []
    for n in (2, 3, 1, 4, 2):
        x, mask = torch.randn(n, 3), torch.randn(3)
        y, m, xo, head, last = g(x, mask)
        assert m is mask and xo is x and head._base is mask
        assert last._base is x and torch.equal(last, x[:, -1:])  # a view of the varying one too
        torch.testing.assert_close(y, x * mask.sum())
        x.mul_(2)  # the caller's write after the call: its view sees it, as eagerly
        assert torch.equal(last, x[:, -1:])
        kept.append((mask.clone(), m, head, x[:, -1:].clone(), last))
    for want, m, head, want_last, last in kept:  # every call's, after all later calls
        assert torch.equal(m, want) and torch.equal(head, want[:2]) and torch.equal(last, want_last)


def test_an_output_that_views_an_arguments_last_rows_is_refused(cpu_graphs) -> None:
    """``x[-1:]`` with sizes=: the view starts at a row that moves with the size, so a call
    padded to a larger size returned the padding row, silently. The build refuses it, naming the
    output, the argument and both places; a view that stays put (``x[:, -1:]``) is fine."""
    with pytest.raises(UnsupportedError, match=r"output\[1\] is a view of args\[0\] 'x' that starts at element 9 at size 4 but 3 at size 2"):
        tr.graph(lambda x: (x * 2, x[-1:]), torch.randn(4, 3), sizes=[2, 4])
    g = tr.graph(lambda x: (x * 2, x[:, -1:]), torch.randn(4, 3), sizes=[2, 4])
    x = torch.randn(3, 3)
    assert torch.equal(g(x)[1], x[:, -1:])
