"""The segment plan of breakable graphs (``breaks=``), on the CPU: which calls become breaks, in
what order, and which of their arguments are re-bound from each call or frozen; option errors.
The interception is undone afterwards and the model's result is eager's."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from torchreplay.breaks.plan import plan_breaks, resolve_breaks
from torchreplay.errors import CaptureError


@torch.library.custom_op("trbreaks::host_attention", mutates_args=())
def host_attention(q: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    # reads host-side sequence lengths: what cannot be captured
    out = q.clone()
    for i, n in enumerate(lengths.tolist()):
        out[i, n:] = 0
    return out * scale


@host_attention.register_fake
def _(q, lengths, scale):
    return torch.empty_like(q)


def scaled_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / (x.norm(dim=-1, keepdim=True) + eps)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, h, lengths):
        return torch.ops.trbreaks.host_attention(self.q(h), lengths, 0.5)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.mlp = nn.Linear(8, 8)

    def forward(self, h, lengths):
        return self.mlp(scaled_norm(self.attn(h, lengths), 1e-6)) + h


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x, lengths, eps=1e-6):
        h = x * 2
        for b in self.blocks:
            h = b(h, lengths)
        return h


def _sample():
    torch.manual_seed(0)
    return Model().eval(), torch.randn(3, 5, 8), torch.tensor([5, 2, 4])


@pytest.mark.parametrize("breaks", [[Attention], ["trbreaks.host_attention"], ["trbreaks::host_attention"]])
def test_every_call_of_a_class_or_op_is_a_break_and_host_lengths_are_rebound(breaks) -> None:
    model, x, lengths = _sample()
    with torch.no_grad():
        want = model(x, lengths)
        assert torch.equal(model(x, lengths), want)
        # On the meta device (as on a GPU) a tensor made inside the model is a device tensor.
        model, x = model.to("meta"), x.to("meta")
        calls = plan_breaks(model, (x, lengths), None, breaks)
    assert [c.index for c in calls] == [0, 1]
    for call in calls:
        rules = {r.path: (r.kind, r.source) for r in call.rules}
        # the hidden state: made inside the model, read where the segment before left it
        assert rules["args[0]"] == ("tensor", "")
        # the caller's host-side lengths: taken from each call, never frozen
        assert rules["args[1]"] == ("rebound", "args[1] 'lengths'")
        if breaks != [Attention]:
            assert rules["args[2]"] == ("constant", "")  # the scale, computed inside
        assert "test_breaks_plan.py:" in call.where  # the model's line that called it


def test_the_interception_is_undone_and_the_result_is_eagers() -> None:
    model, x, lengths = _sample()
    with torch.no_grad():
        want = model(x, lengths)
        plan_breaks(model, (x, lengths), None, [Attention, scaled_norm])
        assert torch.equal(model(x, lengths), want)
    assert "forward" not in model.blocks[0].attn.__dict__
    assert globals()["scaled_norm"].__name__ == "scaled_norm"


def test_a_module_instance_breaks_only_there() -> None:
    model, x, lengths = _sample()
    with torch.no_grad():
        calls = plan_breaks(model, (x, lengths), None, [model.blocks[1].attn])
    assert len(calls) == 1 and calls[0].brk.kind == "module"


def test_a_function_is_a_break_where_the_model_calls_it() -> None:
    model, x, lengths = _sample()
    with torch.no_grad():
        want = model(x, lengths)
        calls = plan_breaks(model, (x, lengths), None, [scaled_norm])
        assert torch.equal(model(x, lengths), want)
    assert [c.brk.kind for c in calls] == ["function", "function"]
    rules = {r.path: r.kind for r in calls[0].rules}
    assert rules == {"args[0]": "constant", "args[1]": "constant"}  # a CPU tensor made inside; eps


def test_a_break_inside_a_break_runs_as_part_of_it() -> None:
    model, x, lengths = _sample()
    with torch.no_grad():
        calls = plan_breaks(model, (x, lengths), None, [Attention, "trbreaks.host_attention"])
    assert [c.brk.kind for c in calls] == ["class", "class"]


def test_a_caller_number_is_rebound_by_value_a_computed_one_is_constant() -> None:
    def fn(x, n):
        return torch.ops.trbreaks.host_attention(x, torch.tensor([n, n]), 2.0)

    calls = plan_breaks(fn, (torch.randn(2, 4, 8), 3), None, ["trbreaks.host_attention"])
    rules = {r.path: (r.kind, r.source) for r in calls[0].rules}
    assert rules["args[0]"] == ("rebound", "args[0] 'x'")  # the caller's tensor (a CPU one here)
    assert rules["args[1]"] == ("constant", "")  # a tensor the function made
    assert rules["args[2]"] == ("constant", "")


class _Identity(torch.autograd.Function):
    forward = staticmethod(lambda ctx, x: x.clone())
    backward = staticmethod(lambda ctx, grad: grad)


def test_option_errors_name_the_entry_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"breaks\[1\] = 'nolib.nothing': no such op"):
        resolve_breaks([Attention, "nolib.nothing"])
    with pytest.raises(ValueError, match=r"breaks\[0\] = 3 \(int\)"):
        resolve_breaks([3])
    with pytest.raises(ValueError, match=r"breaks\[0\] = .*Identity is a torch.autograd.Function: name the module"):
        resolve_breaks([_Identity])
    with pytest.raises(ValueError, match="found by a run of the model"):
        resolve_breaks("auto")
    model, x, lengths = _sample()
    with pytest.raises(CaptureError, match="never ran during the sample call"):
        plan_breaks(model, (x, lengths), None, [nn.Conv2d])
    assert resolve_breaks(None) == ()
    assert [b.kind for b in resolve_breaks(Attention)] == ["class"]


# -- breaks="auto" ----------------------------------------------------------------------------

from torchreplay.breaks.auto import find_breaks, suggestion  # noqa: E402


class Gate(nn.Module):
    def forward(self, x):
        if x.sum().item() > 0:  # a host read: cannot be captured
            return x * 2
        return x


class Select(nn.Module):
    def forward(self, x):
        return x[x[:, 0] > 0]  # as many rows as the data says: not a fixed shape


class Route(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.select = Select()

    def forward(self, x):
        y = self.select(x)
        out = torch.zeros_like(x)
        out[: y.shape[0]] = y
        return out


class Auto(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.gate = Gate()
        self.route = Route()
        self.gates = nn.ModuleList([Gate(), Gate()])

    def forward(self, x):
        x = self.gate(self.a(self.route(x)))
        for g in self.gates:
            x = g(x)
        return x


def test_auto_breaks_at_the_innermost_module_that_keeps_its_shapes() -> None:
    torch.manual_seed(0)
    model = Auto()
    x = torch.randn(10, 8)
    x[:, 0] = torch.tensor([1.0, -1, 1, -1, 1, -1, 1, -1, -1, -1])  # Select keeps 4 rows of 10
    found = find_breaks(model, (x,), {})
    assert [b.path for b in found] == ["route", "gate", "gates.0", "gates.1"]
    # Select's output has a data-dependent row count: its parent Route is the break.
    assert found[0].kind == "dynamic-shape"
    assert found[1].kind == "host-sync" and "item" in found[1].op
    assert "test_breaks_plan.py:" in found[1].where  # the user's line of the .item()
    assert suggestion(found) == "breaks=[model.get_submodule('route'), Gate]"
    assert "forward" not in model.gate.__dict__  # the module stack's wrappers are gone


def test_auto_refuses_a_finding_in_the_top_level_code() -> None:
    def fn(x):
        return x * x.sum().item()

    with pytest.raises(CaptureError, match=r"Tensor.item \(host-sync\) at .*test_breaks_plan.py:\d+ .*nothing to break at"):
        find_breaks(fn, (torch.randn(3),), {})
    assert find_breaks(nn.Linear(3, 3), (torch.randn(2, 3),), {}) == []


_CAPTURING = [False]  # what torch.cuda.is_current_stream_capturing() says in the tests below


class GroupedExperts(nn.Module):
    """Fails only under capture, with no op the check knows (a kernel that syncs inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(8, 8)

    def forward(self, x):
        if _CAPTURING[0]:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return self.w(x)


class MaskedMoE(nn.Module):
    """transformers' shape: the model's own code tests its input on the host unless a capture
    is running; two layers of experts."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.experts = nn.ModuleList([GroupedExperts(), GroupedExperts()])
        self.gate = Gate()

    def forward(self, x):
        if not _CAPTURING[0] and bool((x[:, 0] == 12345).all()):
            return x
        x = self.a(x)
        for e in self.experts:
            x = e(x)
        return self.gate(x)


def _trial(model, x):
    """A capture, as far as the model can tell: the error's lines, innermost first."""
    from torchreplay.breaks.auto import Failed
    import traceback

    _CAPTURING[0] = True
    try:
        model(x)
    except RuntimeError as exc:
        frames = reversed(traceback.extract_tb(exc.__traceback__))
        return Failed(tuple(f"{f.filename}:{f.lineno}" for f in frames if "torch/" not in f.filename), str(exc))
    finally:
        _CAPTURING[0] = False
    return None


def test_auto_drops_what_a_trial_capture_passed_and_breaks_where_it_failed() -> None:
    """The top-level test (a sync, eagerly) is skipped under capture: without the trial it is a
    finding outside every submodule. The experts fail only under capture: each instance of
    their class breaks. The Gate's .item() after them stays a break."""
    model, x = MaskedMoE(), torch.randn(4, 8)
    with pytest.raises(CaptureError, match="nothing to break at"):
        find_breaks(model, (x,), {})
    found = find_breaks(model, (x,), {}, trial=lambda constants: _trial(model, x))
    assert [b.path for b in found] == ["experts.0", "experts.1", "gate"]
    assert found[0].kind == "capture failed" and "operation not permitted" in found[0].op
    assert "test_breaks_plan.py:" in found[0].where and found[2].kind == "host-sync"
    assert "forward" not in model.experts[0].__dict__


def test_auto_with_a_trial_that_captured_whole_breaks_at_nothing_it_passed() -> None:
    model = Auto()
    x = torch.randn(10, 8)
    assert find_breaks(model, (x,), {}, trial=lambda constants: None) == []


def test_graph_option_errors_with_breaks_come_before_any_device_work() -> None:
    import torchreplay as tr

    model, x, lengths = _sample()
    with pytest.raises(ValueError, match="capture must be one of"):
        tr.graph(model, x, lengths, breaks=[Attention], sizes=[1, 2], capture="sometimes")
    with pytest.raises(ValueError, match="max_graphs=1 but capture='ahead'"):
        tr.graph(model, x, lengths, breaks=[Attention], sizes=[1, 2], max_graphs=1)
    with pytest.raises(TypeError, match="only apply with sizes"):
        tr.graph(model, x, lengths, breaks=[Attention], fallback="error")
    with pytest.raises(ValueError, match="breaks= names nothing"):
        tr.graph(model, x, lengths, breaks=[])
    with pytest.raises(ValueError, match=r"breaks\[0\] = 'nolib.nothing': no such op"):
        tr.graph(model, x, lengths, breaks=["nolib.nothing"])


def test_a_break_that_returns_nothing_is_called_as_it_is() -> None:
    from torchreplay.breaks.steps import BreakStep

    def fill(out, x):
        out.copy_(x * 2)

    def fn(x):
        out = torch.empty_like(x)
        fill(out, x)
        return out + 1

    x = torch.randn(3)
    calls = plan_breaks(fn, (x,), None, [fill])
    step = BreakStep(calls[0], "fill#0")
    assert step.none and step.flat and not step.kw and step.m == 0  # None is a pytree leaf
    assert step(torch.empty(3), x) == ()
    assert [r.kind for r in calls[0].rules] == ["constant", "rebound"]  # on the CPU: host values


def test_the_diagnosis_of_a_failed_segment_does_not_look_inside_the_breaks() -> None:
    """What a failed capture's error names: the op in a segment, not the break's own ops."""
    from torchreplay.breaks.plan import outside_breaks
    from torchreplay.check import check

    def host_scale(x):
        return x * x.sum().item()  # inside the break: fine, it runs eagerly

    class M(nn.Module):
        def forward(self, x):
            y = host_scale(x)
            return y * float(y.max())  # in a segment: this is what breaks capture  # LINE: seg

    model, x = M(), torch.randn(4)
    everything = check(model, x)
    assert len([f for f in everything if f.kind == "host-sync"]) == 2
    seen = check(outside_breaks(model, resolve_breaks([host_scale])), x)
    host = [f for f in seen if f.kind == "host-sync"]
    assert len(host) == 1 and "LINE: seg" in host[0].code
    assert "forward" not in model.__dict__


class _Box:
    """A cache-like object with no value equality."""

    def __init__(self) -> None:
        self.items: list[torch.Tensor] = []


@dataclasses.dataclass(frozen=True)
class _Frozen:
    scale: float


def _fill(h: torch.Tensor, box: _Box, frozen: _Frozen) -> torch.Tensor:
    box.items.append(h)
    return h * frozen.scale


def test_an_object_the_model_makes_at_each_call_and_hands_a_break_is_refused():
    """HF's DynamicCache made in the forward (use_cache=True) and filled by the attention: a
    replay would hand the break the capture's. An equal frozen value made at each call is fine."""
    from torchreplay.breaks.plan import same_path

    class M(nn.Module):
        def forward(self, h, fresh: bool):
            box = _Box() if fresh else SHARED
            return _fill(h, box, _Frozen(0.5))

    SHARED = _Box()
    model = M()
    h = torch.randn(2, 4)
    for fresh in (False, True):
        plan = plan_breaks(model, (h, fresh), {}, [_fill])
        again = plan_breaks(model, (h, fresh), {}, [_fill])
        spec = torch.utils._pytree.tree_flatten(model(h, fresh))[1]
        if fresh:
            with pytest.raises(CaptureError, match="break _fill .* gets a _Box the model makes anew at each call"):
                same_path("M", plan, again, spec, model(h, fresh), None)
        else:
            same_path("M", plan, again, spec, model(h, fresh), None)


def test_the_trial_makes_host_constants_with_kernels_only_where_the_check_saw_one() -> None:
    """A trial capture under the function mode would trace a compiled region inside again: it
    gets the mode only where the check saw a tensor made from Python data, as a build does."""
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = Gate()

        def forward(self, x):
            return self.gate(x) * torch.tensor([1.0, 2.0])

    asked: list[bool] = []
    x = torch.ones(3, 2)
    find_breaks(Scaled(), (x,), {}, trial=lambda constants: asked.append(constants))
    find_breaks(Auto(), (torch.randn(10, 8),), {}, trial=lambda constants: asked.append(constants))
    assert asked == [True, False]


def test_what_only_the_capture_met_in_a_torch_container_breaks_at_that_one() -> None:
    """Every module of the failing one's class breaks, but not every ``nn.Sequential``: here the
    innermost module around the failure whose outputs keep their shapes is one."""
    class Narrow(nn.Module):  # fails only under capture; its 3 columns are no size of its inputs
        def forward(self, x):
            if _CAPTURING[0]:
                raise RuntimeError("operation not permitted when stream is capturing")
            return x[:, :3]

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Sequential(nn.Linear(8, 8))
            self.b = nn.Sequential(nn.Linear(8, 8), Narrow(), nn.Linear(3, 8))
            self.gate = Gate()

        def forward(self, x):
            return self.gate(self.b(self.a(x)))

    model, x = Wrapped(), torch.randn(4, 8)
    found = find_breaks(model, (x,), {}, trial=lambda constants: _trial(model, x))
    assert [b.path for b in found] == ["b", "gate"]
