"""Training on CPU: argument handling and error messages of make_graphed_callables and graph_step,
optimizer checks, verify's comparison, state save/restore, live windows, and the whole
make_graphed_callables / graph_step machinery around the graphs, run through an eager emulation
of capture and replay (same static buffers, same replay order) so that it runs without a GPU."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import pickle
import weakref

import pytest
import torch
import torch.nn as nn

import torchreplay as tr

import higher_order
from blocks import TwoOutputs
from memory import collector_off
from twin_steps import history_step
from torchreplay import _compat
from torchreplay.core.failures import returns_arguments
from torchreplay.core.modes import GradFlags
from torchreplay.training import callables as training
from torchreplay.training.pair import Pair, output_reach, unreached
from torchreplay.training import optimizers as optim_mod
from torchreplay.training import step as step_mod
from torchreplay.training import step_parts as step_parts_mod
from torchreplay.errors import (
    ReplayInputError,
    TorchReplayError,
    UnsupportedError,
    VerifyError,
)
from torchreplay.core.pool import Pool
from torchreplay.training.state import StateKeeper, find_instances, reset_fresh_state
from torchreplay.training.verify import Tolerance, check_close, check_tree, resolve_tolerance

CPU = torch.device("cpu")


# -- argument handling (runs before any device is needed) ---------------------------------------


def test_sample_args_must_be_a_tuple_for_one_callable() -> None:
    with pytest.raises(TypeError, match=r"sample_args must be a tuple .* e\.g\. \(x,\), got Tensor"):
        tr.make_graphed_callables(nn.Linear(2, 2), torch.randn(2, 2))


def test_sample_args_must_have_one_tuple_per_callable() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"with 2 callables, sample_args must be a tuple of 2 tuples .* got 1 entries"):
        tr.make_graphed_callables((a, b), ((torch.randn(1, 2),),))
    with pytest.raises(TypeError, match=r"sample_args\[1\] must be a tuple of callables\[1\]'s"):
        tr.make_graphed_callables((a, b), ((torch.randn(1, 2),), torch.randn(1, 2)))


def test_sample_kwargs_shape_is_checked() -> None:
    with pytest.raises(TypeError, match="sample_kwargs must be a dict"):
        tr.make_graphed_callables(nn.Linear(2, 2), (torch.randn(1, 2),), sample_kwargs=[1])
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"sample_kwargs must be a tuple of 2 dicts"):
        tr.make_graphed_callables((a, b), ((torch.randn(1, 2),), (torch.randn(1, 2),)), sample_kwargs={})


def test_callables_must_be_callable_and_distinct() -> None:
    with pytest.raises(TypeError, match=r"callables\[1\] is a int, which is not callable"):
        tr.make_graphed_callables((nn.Linear(2, 2), 3), ((torch.randn(1, 2),), (torch.randn(1, 2),)))
    m = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"callables\[0\] and callables\[1\] are the same module"):
        tr.make_graphed_callables((m, m), ((torch.randn(1, 2),), (torch.randn(1, 2),)))
    with pytest.raises(ValueError, match="callables is empty"):
        tr.make_graphed_callables((), ())


@pytest.mark.parametrize("verify", [-1, True, 1.5, "2"])
def test_verify_must_be_a_count(verify) -> None:
    with pytest.raises(ValueError, match="verify must be an int >= 0"):
        tr.make_graphed_callables(nn.Linear(2, 2), (torch.randn(1, 2),), verify=verify)
    with pytest.raises(ValueError, match="verify must be an int >= 0"):
        tr.graph_step(lambda x: x, torch.randn(2), verify=verify)


def test_verify_tol_is_validated() -> None:
    assert resolve_tolerance((1e-3, 1e-4)) == Tolerance(1e-3, 1e-4)
    assert resolve_tolerance(None) is None
    with pytest.raises(ValueError, match="verify_tol must be None"):
        resolve_tolerance(0.1)
    with pytest.raises(ValueError, match="rtol must be a number >= 0"):
        Tolerance(-1.0, 0.0)


def test_without_cuda_the_error_says_so_after_arguments_are_checked() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(UnsupportedError, match="CUDA is not available"):
        tr.make_graphed_callables(nn.Linear(2, 2), (torch.randn(1, 2),))
    with pytest.raises(UnsupportedError, match="CUDA is not available"):
        tr.graph_step(lambda x: x.sum(), torch.randn(2))


def test_graph_step_arguments() -> None:
    with pytest.raises(TypeError, match="step_fn must be callable"):
        tr.graph_step(3)
    with pytest.raises(TypeError, match=r"optimizers\[0\] is a int, not a torch.optim.Optimizer"):
        tr.graph_step(lambda x: x, torch.randn(2), optimizers=[3])
    with pytest.raises(TypeError, match="scaler must be a torch.amp.GradScaler"):
        tr.graph_step(lambda x: x, torch.randn(2), scaler=object())
    with pytest.raises(ValueError, match="graph_step needs num_warmup_iters >= 1"):
        tr.graph_step(lambda x: x, torch.randn(2), num_warmup_iters=0)
    with pytest.raises(TypeError, match=r"keyword arguments given twice: \['a'\]"):
        tr.graph_step(lambda x, a: x, torch.randn(2), a=1, sample_kwargs={"a": 2})


# -- optimizers -------------------------------------------------------------------------------


def _params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(3, 2)), nn.Parameter(torch.randn(2))]


def test_non_capturable_adam_is_refused_naming_the_flag() -> None:
    opt = torch.optim.AdamW(_params(), lr=1e-3)
    with pytest.raises(UnsupportedError, match=r"AdamW has capturable=False in every param group.*AdamW\(\.\.\., capturable=True\)"):
        optim_mod.check_optimizer(opt)
    # graph_step checks given optimizers before anything runs (before even looking for CUDA)
    with pytest.raises(UnsupportedError, match="capturable=True"):
        tr.graph_step(lambda x: x.sum(), torch.randn(2), optimizers=opt)


def test_capturable_in_only_some_groups_names_them() -> None:
    a, b = _params()
    opt = torch.optim.Adam([{"params": [a], "capturable": True}, {"params": [b]}])
    with pytest.raises(UnsupportedError, match=r"capturable=False in param_groups \[1\]"):
        optim_mod.check_optimizer(opt)


def test_capturable_and_sgd_pass() -> None:
    optim_mod.check_optimizer(torch.optim.Adam(_params(), capturable=True))
    optim_mod.check_optimizer(torch.optim.RMSprop(_params(), capturable=True))
    optim_mod.check_optimizer(torch.optim.SGD(_params(), lr=0.1, momentum=0.9))


def test_optimizer_without_capturable_flag_is_refused() -> None:
    with pytest.raises(UnsupportedError, match=r"Adagrad has no capturable=True option.*make_graphed_callables"):
        optim_mod.check_optimizer(torch.optim.Adagrad(_params()))


def test_sgd_with_dampening_needs_existing_momentum_buffers() -> None:
    params = _params()
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, dampening=0.1)
    with pytest.raises(UnsupportedError, match=r"dampening=0.1 and no momentum buffers yet.*Take one eager step"):
        optim_mod.check_optimizer(opt)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    optim_mod.check_optimizer(opt)  # buffers exist now: the graph's formula is torch's


def test_grad_scaler_needs_a_fused_optimizer() -> None:
    opt = torch.optim.SGD(_params(), lr=0.1)
    with pytest.raises(UnsupportedError, match=r"GradScaler.step\(SGD\) checks the gradients.*fused=True"):
        optim_mod.check_scaler_support(opt)
    optim_mod.check_scaler_support(torch.optim.SGD(_params(), lr=0.1, fused=True))


_GLOBAL_SCALER = torch.amp.GradScaler("cpu")


def test_a_grad_scaler_is_found_by_name() -> None:
    local = torch.amp.GradScaler("cpu")

    def step_closure(x):
        return local.scale(x)

    def step_global(x):
        return _GLOBAL_SCALER.scale(x)

    class Trainer:
        def __init__(self) -> None:
            self.scaler = local

        def step(self, x):
            return self.scaler.scale(x)

    assert find_instances(step_closure, torch.amp.GradScaler) == [local]
    assert find_instances(step_global, torch.amp.GradScaler) == [_GLOBAL_SCALER]
    assert find_instances(Trainer().step, torch.amp.GradScaler) == [local]
    # ... and then refused with an unfused optimizer, before anything runs
    opt = torch.optim.SGD(_params(), lr=0.1)
    with pytest.raises(UnsupportedError, match="GradScaler.step"):
        tr.graph_step(step_closure, torch.randn(2), optimizers=opt)


_OPTIMIZERS = [
    ("Adam", {"lr": 0.01}),
    ("AdamW", {"lr": 0.01, "amsgrad": True}),
    ("Adamax", {"lr": 0.01}),
    ("NAdam", {"lr": 0.01}),
    ("RAdam", {"lr": 0.01}),
    ("ASGD", {"lr": 0.01}),
    ("Rprop", {"lr": 0.01}),
    ("Adadelta", {"lr": 0.5}),
    ("RMSprop", {"lr": 0.01, "momentum": 0.9, "centered": True}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
]


@pytest.mark.parametrize("name,kw", _OPTIMIZERS, ids=[n for n, _ in _OPTIMIZERS])
def test_reset_state_equals_a_fresh_optimizer(name: str, kw: dict) -> None:
    """State created by a warm-up step, reset in place, steps exactly like a fresh optimizer
    (what a graph captured after warm-up needs: the same tensors, fresh values)."""
    cls = getattr(torch.optim, name)
    torch.manual_seed(0)
    p_fresh = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(3))]
    p_reset = [nn.Parameter(p.detach().clone()) for p in p_fresh]
    fresh, reset = cls(p_fresh, **kw), cls(p_reset, **kw)
    for p in p_reset:  # a warm-up step that creates the state
        p.grad = torch.randn_like(p)
    reset.step()
    tensors_before = {k: id(v) for k, v in reset.state[p_reset[0]].items()}
    with torch.no_grad():
        for a, b in zip(p_reset, p_fresh):
            a.copy_(b)
    for group in reset.param_groups:
        for p in group["params"]:
            reset_fresh_state(reset, group, reset.state[p])
    assert {k: id(v) for k, v in reset.state[p_reset[0]].items()} == tensors_before  # in place
    for _ in range(3):
        g = [torch.randn_like(p) for p in p_fresh]
        for p, gi in zip(p_fresh, g):
            p.grad = gi.clone()
        for p, gi in zip(p_reset, g):
            p.grad = gi.clone()
        fresh.step()
        reset.step()
        for a, b in zip(p_reset, p_fresh):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# -- verify's comparison ------------------------------------------------------------------------


def test_check_close_passes_within_tolerance_and_on_matching_nans() -> None:
    a = torch.tensor([1.0, float("nan"), float("inf"), 0.0])
    check_close("output", a, a.clone(), call=1, name="f")
    check_close("output", a + 1e-7 * a.nan_to_num(), a, call=1, name="f")
    check_close("x", 3, 3, call=1, name="f")
    check_close("x", None, None, call=1, name="f")


def test_check_close_names_the_tensor_the_max_error_and_the_call() -> None:
    want = torch.zeros(2, 3)
    got = want.clone()
    got[1, 2] = 0.5
    got[0, 0] = 0.25
    with pytest.raises(VerifyError) as info:
        check_close("grad of parameter '0.weight'", got, want, call=3, name="MLP")
    e = info.value
    assert isinstance(e, TorchReplayError) and isinstance(e, RuntimeError)
    assert e.call == 3 and e.max_error == 0.5 and e.what == "grad of parameter '0.weight'"
    msg = str(e)
    assert msg.startswith("verify: call 3 of graphed 'MLP': grad of parameter '0.weight' differs")
    assert "by up to 0.5 at index (1, 2) (graph 0.5, eager 0)" in msg
    assert "1e-05 + 0.0001 * |eager| for float32" in msg
    assert "verify_tol=(rtol, atol)" in msg


def test_check_close_nan_on_one_side_is_an_infinite_error() -> None:
    with pytest.raises(VerifyError, match="differs from eager by up to inf") as info:
        check_close("output[0]", torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0]), call=1, name="f")
    assert math.isinf(info.value.max_error)


def test_check_close_tolerance_by_dtype_and_override() -> None:
    want = torch.ones(4, dtype=torch.bfloat16)
    check_close("y", want * 1.0078125, want, call=1, name="f")  # one bf16 ulp at 1.0
    with pytest.raises(VerifyError):
        check_close("y", torch.ones(4) * (1 + 1e-3), torch.ones(4), call=1, name="f")
    check_close("y", torch.ones(4) * (1 + 1e-3), torch.ones(4), call=1, name="f", tol=Tolerance(1e-2, 0))
    with pytest.raises(VerifyError, match="differs from eager by up to 1"):
        check_close("idx", torch.tensor([1, 2]), torch.tensor([1, 3]), call=1, name="f")


def test_check_close_shape_dtype_and_value_mismatches() -> None:
    with pytest.raises(VerifyError, match=r"is shape \(2,\) float32 in the graph but shape \(3,\) float32 eagerly"):
        check_close("output", torch.zeros(2), torch.zeros(3), call=1, name="f")
    with pytest.raises(VerifyError, match=r"is 'a' in the graph but 'b' eagerly"):
        check_close("output[1]", "a", "b", call=2, name="f")


def test_check_tree_names_leaves_by_path() -> None:
    got = {"logits": torch.zeros(2), "aux": [torch.ones(1), 3]}
    want = {"logits": torch.zeros(2), "aux": [torch.full((1,), 2.0), 3]}
    with pytest.raises(VerifyError, match=r"output\['aux'\]\[0\] differs"):
        check_tree("output", got, want, call=1, name="f")
    with pytest.raises(VerifyError, match="has structure"):
        check_tree("output", got, [1], call=1, name="f")


# -- state saved before warm-up and restored after ----------------------------------------------


class Net(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> dict:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if opt is not None:
        state["opt"] = copy.deepcopy(opt.state_dict())
    return state


def test_state_keeper_restores_what_a_discovered_training_step_changed() -> None:
    torch.manual_seed(0)
    model = Net(dropout=0.5)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(5, 6), torch.randn(5, 3)

    def train_step():
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        return loss

    before = _snapshot(model)
    rng = torch.get_rng_state()
    keeper = StateKeeper(CPU)
    with keeper.discovering():
        train_step()
    train_step()
    assert keeper.optimizers == [opt]
    assert model.bn in keeper.modules and model.fc1 in keeper.modules
    keeper.restore()
    after = _snapshot(model)
    for k in before:
        assert torch.equal(before[k], after[k]), k
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    st = opt.state[model.fc1.weight]
    assert float(st["step"]) == 0 and not st["exp_avg"].any() and not st["exp_avg_sq"].any()

    # From the restored state, two steps equal two steps of a copy that never warmed up.
    torch.manual_seed(1)
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    for p in ref_model.parameters():
        assert p.grad is None
    losses = [train_step() for _ in range(2)]
    torch.manual_seed(1)
    for _ in range(2):
        ref_opt.zero_grad()
        ref_loss = ((ref_model(x) - y) ** 2).mean()
        ref_loss.backward()
        ref_opt.step()
    for (n, a), b in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(a, b), n
    assert torch.equal(losses[1], ref_loss)


def test_state_keeper_refusal_runs_before_the_optimizer_steps() -> None:
    model = nn.Linear(3, 3)
    opt = torch.optim.Adam(model.parameters())
    before = _snapshot(model)

    def refuse(o):
        raise UnsupportedError("no")

    keeper = StateKeeper(CPU, on_optimizer=refuse)
    with pytest.raises(UnsupportedError):
        with keeper.discovering():
            model(torch.randn(2, 3)).sum().backward()
            opt.step()
    keeper.restore()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not opt.state


# -- the learning rate and frozen hyperparameters ---------------------------------------------


def test_lr_slot_follows_floats_and_tensors_changed_in_place_or_replaced() -> None:
    group = {"lr": 0.1, "params": []}
    slot = optim_mod.LrSlot(group, CPU)
    assert slot.tensor.item() == pytest.approx(0.1)
    slot.install()
    assert group["lr"] is slot.tensor
    slot.uninstall()
    assert group["lr"] == 0.1
    group["lr"] = 0.05  # a scheduler assigning a float
    slot.sync()
    assert slot.tensor.item() == pytest.approx(0.05)
    cpu_lr = torch.tensor(0.02)
    group["lr"] = cpu_lr  # replaced by a tensor
    slot.sync()
    assert slot.tensor.item() == pytest.approx(0.02)
    cpu_lr.fill_(0.01)  # updated in place, as torch's schedulers do for a tensor lr
    slot.sync()
    assert slot.tensor.item() == pytest.approx(0.01)


def test_group_guard_names_a_frozen_hyperparameter_that_changed() -> None:
    opt = torch.optim.Adam(_params(), lr=0.1, betas=(0.9, 0.99), capturable=True)
    group = opt.param_groups[0]
    guard = optim_mod.GroupGuard(opt, 0, group, lr_live=True)
    assert guard.changed() == []
    group["lr"] = 0.05  # live: not guarded
    assert guard.changed() == []
    group["betas"] = (0.85, 0.99)
    assert guard.changed() == ["betas"]
    msg = guard.error(["betas"])
    assert "Adam.param_groups[0] changed 'betas' from (0.9, 0.99) to (0.85, 0.99)" in msg
    sgd = torch.optim.SGD(_params(), lr=0.1)
    g2 = optim_mod.GroupGuard(sgd, 0, sgd.param_groups[0], lr_live=False)
    sgd.param_groups[0]["lr"] = 0.01
    assert g2.changed() == ["lr"]
    assert "SGD(fused=True), which read it from the device" in g2.error(["lr"])


# -- live windows in a shared pool --------------------------------------------------------------


class _M:
    def __init__(self, name: str) -> None:
        self.name = name
        self.invalidated = 0

    def invalidate_outputs(self) -> None:
        self.invalidated += 1


def test_live_windows_are_clobbered_by_replays_outside_them() -> None:
    pool = Pool(CPU)
    names = ["f1 (forward)", "f2 (forward)", "f2 (backward)", "f1 (backward)"]
    members = [_M(n) for n in names]
    for m in members:
        pool.register(m)
    w1 = pool.open_window(0, 3, "f1")
    pool.before_replay(1)  # f2 forward: inside (0, 3)
    w2 = pool.open_window(1, 2, "f2")
    assert w1.clobbered_by is None and w2.clobbered_by is None
    assert members[2].invalidated == 1 and members[0].invalidated == 0
    pool.before_replay(2, w2)  # f2 backward reads w2, inside w1
    pool.close_window(w2)
    pool.before_replay(3, w1)
    assert w1.clobbered_by is None and w2.clobbered_by is None
    pool.close_window(w1)

    # f1 forward again while f2's backward is pending: f2's activations may be overwritten
    w1 = pool.open_window(0, 3, "f1")
    pool.before_replay(1)
    w2 = pool.open_window(1, 2, "f2")
    pool.before_replay(0)
    assert w2.clobbered_by == "f1 (forward)"
    assert w1.clobbered_by == "f1 (forward)"  # its own forward replayed again

    # backward out of order: f1's backward while f2's is pending
    w1 = pool.open_window(0, 3, "f1")
    pool.before_replay(1)
    w2 = pool.open_window(1, 2, "f2")
    pool.before_replay(3, w1)
    assert w2.clobbered_by == "f1 (backward)" and w1.clobbered_by is None


def test_a_dropped_window_is_forgotten() -> None:
    pool = Pool(CPU)
    for n in ("a", "b"):
        pool.register(_M(n))
    pool.open_window(0, 1, "a")  # nobody keeps it
    pool.before_replay(0)
    assert not pool._windows


def test_a_member_that_reports_its_outputs_is_invalidated_only_while_it_has_some() -> None:
    """core/pool.py: a replay marks stale the outputs of the members after it. One registered
    with reports=True is looked at only after it said it handed outputs out (on_live), once,
    until it hands out again; one that does not report is looked at every time."""
    pool = Pool(CPU)
    walked, a, b = _M("walked"), _M("a"), _M("b")
    pool.register(_M("first"))
    pool.register(walked)
    live_a = pool.on_live(pool.register(a, reports=True))
    live_b = pool.on_live(pool.register(b, reports=True))
    pool.before_replay(0)
    assert (walked.invalidated, a.invalidated, b.invalidated) == (1, 0, 0)
    live_a()
    live_b()
    pool.before_replay(2)  # a's own replay: only b, after it
    assert (walked.invalidated, a.invalidated, b.invalidated) == (1, 0, 1)
    pool.before_replay(2)  # b has nothing out any more
    assert b.invalidated == 1
    pool.before_replay(0)
    assert (walked.invalidated, a.invalidated, b.invalidated) == (2, 1, 1)
    pool.before_replay(0)
    assert (walked.invalidated, a.invalidated, b.invalidated) == (3, 1, 1)
    live_b()
    pool.before_replay(3)  # b's own replay: nothing after it
    assert b.invalidated == 1


# -- make_graphed_callables end to end, with capture and replay emulated on the CPU -------------


def _emulated_capture_pairs(runners, *, device, pool, config):
    """What _capture_pairs does, with each "graph" run eagerly on the same static buffers:
    the forward writes into fixed output buffers, the backward reads the latest forward's
    autograd graph (as a real backward graph reads the latest activations) and writes into
    fixed gradient buffers."""
    pairs = []
    for r in runners:
        sa, sk = r._inputs.static_args, r._inputs.static_kwargs
        python = training.forward_effects(r)  # the Python state protocol, as capture() runs it
        python.start()
        n = config.num_warmup_iters
        for i in range(n):
            with python.warmup(last=i == n - 1):
                out = r._warm_fn(*sa, **sk)
        if n and returns_arguments(sa, sk, out, CPU):  # (capture's allow_launchless: no graph)
            pairs.append(None)
            continue
        external = {id(t) for t in r._surface}
        if r._module is not None:
            external |= {id(b) for b in r._module.buffers()}

        def run_on_static(runner=weakref.ref(r)):  # (weakly, as a CUDA graph holds nothing of it)
            r = runner()
            leaves = [s.static if s.static is not None else s.value for s in r._inputs.slots]
            grad_in = []
            for k, i in enumerate(r._tensor_idx):
                if r._sample_req[k]:
                    leaves[i] = leaves[i].detach().requires_grad_(True)
                    grad_in.append(leaves[i])
            a, kw = _compat.tree_unflatten(leaves, r._inputs.spec)
            with torch.enable_grad():
                out = r._run_fn(*a, **kw)
            return out, grad_in + [t for t in r._surface if t.requires_grad]

        python.before_capture()
        with python.captured():
            out0, _ = run_on_static()
        err = python.verdict()
        if err is not None:
            python.undo()
            raise err
        python.put_back_tensors()
        leaves0, spec = _compat.tree_flatten(out0)
        owned_pos = [isinstance(o, torch.Tensor) and id(o) not in external for o in leaves0]
        kept = [o.detach().clone() if own else o for o, own in zip(leaves0, owned_pos)]
        kept_ids = {id(t) for t, own in zip(kept, owned_pos) if own}
        diff_idx = [j for j, o in enumerate(leaves0) if owned_pos[j] and o.requires_grad]
        gouts = [torch.zeros_like(leaves0[j]) for j in diff_idx]
        gins, reach = [], ()
        if diff_idx and r._grad_inputs:  # the "backward capture": None where unused, like torch
            outs0, ins0 = run_on_static()
            ls0 = _compat.tree_flatten(outs0)[0]
            g0 = torch.autograd.grad([ls0[j] for j in diff_idx], ins0, grad_outputs=gouts, allow_unused=True)
            gins = [None if g is None else torch.zeros_like(g) for g in g0]
            reach = output_reach([ls0[j] for j in diff_idx], ins0)  # (as _capture_pairs reads it)
        latest = {}

        def fwd_replay(run=run_on_static, kept=kept, owned_pos=owned_pos, diff_idx=diff_idx, latest=latest):
            out, ins = run()
            ls = _compat.tree_flatten(out)[0]
            with torch.no_grad():
                for j, own in enumerate(owned_pos):
                    if own:
                        kept[j].copy_(ls[j])
            latest["g"] = ([ls[j] for j in diff_idx], ins)

        def bwd_replay(latest=latest, gouts=gouts, gins=gins):
            outs, ins = latest.pop("g")
            gs = torch.autograd.grad(outs, ins, grad_outputs=gouts, allow_unused=True)
            with torch.no_grad():
                for dst, g in zip(gins, gs):
                    if dst is not None:
                        dst.copy_(g)

        pairs.append(
            Pair(
                fwd_replay=fwd_replay,
                bwd_replay=bwd_replay if diff_idx and r._grad_inputs else None,
                leaves=kept,
                spec=spec,
                diff_idx=diff_idx,
                owned=lambda t, ids=kept_ids: id(t) in ids,
                static_grad_outputs=gouts,
                static_grad_inputs=gins,
                reads=python.reads(),
                reach=reach,
            )
        )
    return pairs


@pytest.fixture
def emulated(monkeypatch):
    import test_buckets

    monkeypatch.setattr(training, "_capture_pairs", _emulated_capture_pairs)
    monkeypatch.setattr(training, "infer_device", lambda fn, call, device=None: CPU)
    test_buckets.as_cpu_build(monkeypatch.setattr)
    yield


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))


def test_emulated_gradient_accumulation_is_g1_plus_g2(emulated) -> None:
    model, ref = _mlp(), _mlp()
    g = tr.make_graphed_callables(model, (torch.randn(3, 6),))
    assert g is model and isinstance(model.forward, tr.GraphedCallable)
    x1, x2 = torch.randn(3, 6), torch.randn(3, 6)
    model(x1).pow(2).sum().backward()
    model(x2).pow(2).sum().backward()
    ref(x1).pow(2).sum().backward()
    ref(x2).pow(2).sum().backward()
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=n)
    static = {t.data_ptr() for t in model.forward._static_grad_inputs}
    assert not any(p.grad.data_ptr() in static for p in model.parameters())
    assert model.forward.stats.replays == 2 and model.forward.stats.backward_replays == 2


def test_emulated_a_layer_that_launches_nothing_runs_eagerly_between_graphed_ones(emulated) -> None:
    """``nn.Flatten`` in a tuple of layers returns a view of its argument (no kernel): it comes
    back as a :class:`~torchreplay.training.callables.Launchless`, which calls it as it is, so
    its output is a view of the caller's tensor with eager's autograd; the layers around it
    replay and train as eager. Its deep copy and pickle are the eager module's."""
    torch.manual_seed(0)
    first, flat, head = nn.Linear(4, 4), nn.Flatten(), nn.Linear(12, 2)
    ref = copy.deepcopy((first, flat, head))
    h = torch.randn(2, 3, 4, requires_grad=True)
    g_first, g_flat, g_head = tr.make_graphed_callables(
        (first, flat, head), ((h,), (h.detach().requires_grad_(True),), (torch.randn(2, 12, requires_grad=True),)))
    assert isinstance(flat.forward, training.Launchless) and "launches no kernel" in repr(flat.forward)
    assert flat.forward.stats.captures == 0 and isinstance(first.forward, tr.GraphedCallable)
    for step in range(3):
        x = torch.randn(2, 3, 4, requires_grad=True)
        xr = x.detach().clone().requires_grad_(True)
        mid = g_flat(g_first(x))
        assert mid._base is not None  # a view of the first layer's output, as eagerly
        y, yr = g_head(mid), ref[2](ref[1](ref[0](xr)))
        torch.testing.assert_close(y, yr)
        y.sum().backward()
        yr.sum().backward()
        torch.testing.assert_close(x.grad, xr.grad)
        for a, b in zip([*first.parameters(), *head.parameters()], [*ref[0].parameters(), *ref[2].parameters()]):
            torch.testing.assert_close(a.grad, b.grad)
    assert first.forward.stats.replays == 3 and head.forward.stats.backward_replays == 3
    assert type(copy.deepcopy(flat).forward) is not training.Launchless
    assert "launches no kernel" in tr.explain(flat)
    stack = nn.Sequential(first, flat, head)
    report = tr.explain(stack)
    assert "3 submodule(s)" in report and "1 (Flatten): launches no kernel, so every call runs it eagerly" in report, report
    assert isinstance(pickle.loads(pickle.dumps(flat)), nn.Flatten)


class OpCount(torch.utils._python_dispatch.TorchDispatchMode):
    """A dispatch mode that adds no hooks (FlopCounterMode adds global module hooks)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_emulated_call_under_a_dispatch_mode_runs_eagerly_and_then_replays(emulated, caplog) -> None:
    """Under a TorchDispatchMode a graphed forward and backward run eagerly (the mode sees each
    op of both), counted, logged, never warned about, FlopCounterMode's own hooks included;
    outside it the call replays again. (The emulated replay runs eagerly too, so the counters,
    not the ops seen, tell the two apart here; tests/gpu/test_modes.py counts on real graphs.)"""
    from torch.utils.flop_counter import FlopCounterMode

    model, ref = _mlp(), _mlp()
    tr.make_graphed_callables(model, (torch.randn(3, 6),))
    x = torch.randn(3, 6)
    with OpCount() as count:
        model(x).pow(2).sum().backward()
    assert count.ops > 0 and model.forward.stats.fallbacks == 1 and model.forward.stats.replays == 0
    with caplog.at_level(logging.WARNING, logger="torchreplay"), FlopCounterMode(display=False) as flops:
        model(x).pow(2).sum().backward()
    assert flops.get_total_flops() > 0 and model.forward.stats.fallbacks == 2
    assert "torchreplay" not in caplog.text  # what the caller asked for: no warning
    ref(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=n)
    model(x).pow(2).sum().backward()
    assert model.forward.stats.replays == 1 and model.forward.stats.backward_replays == 1


class _WithPlainTensor(nn.Module):
    """A model whose forward reads a tensor held in a plain attribute (a RoPE table, say),
    which the graph reads in place and checks by identity at every call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.scale = torch.linspace(0.5, 1.5, 4)  # not a buffer: Python state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


@pytest.mark.parametrize("make", [_mlp, _WithPlainTensor], ids=["parameters only", "a plain tensor attribute"])
def test_emulated_a_dropped_model_and_its_graphs_are_freed(emulated, make) -> None:
    """Once the model graphed by make_graphed_callables is gone, so are its graphed callable
    and its graphs (at the collection that frees the model: the model and its ``forward`` hold
    each other, as with torch's tool). The pool's finalizer held the pair, whose record of the
    Python state the forward reads held the model's ``__dict__``: a model with a plain tensor
    attribute was never freed."""
    import gc

    model = make()
    tr.make_graphed_callables(model, (torch.randn(3, 6),))
    model(torch.randn(3, 6)).pow(2).sum().backward()
    assert model.forward.stats.replays == 1
    gone, callable_gone = weakref.ref(model), weakref.ref(model.forward)
    del model
    gc.collect()
    assert gone() is None and callable_gone() is None


def test_emulated_steps_equal_eager_with_an_optimizer(emulated) -> None:
    model, ref = _mlp(), _mlp()
    tr.make_graphed_callables(model, (torch.randn(3, 6),))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(5):
        x = torch.randn(3, 6)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            loss = m(x).pow(2).mean()
            loss.backward()
            o.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)


def test_emulated_warmup_leaves_batchnorm_and_rng_as_it_found_them(emulated) -> None:
    torch.manual_seed(0)
    model = Net(dropout=0.5)
    x = torch.randn(5, 6)
    before = _snapshot(model)
    rng = torch.get_rng_state()
    tr.make_graphed_callables(model, (x,), num_warmup_iters=3)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(torch.get_rng_state(), rng)


def test_output_reach_reads_which_outputs_reach_each_leaf() -> None:
    m = TwoOutputs(6)
    x = torch.randn(3, 6, requires_grad=True)
    h, y = m(x)
    leaves = [x, m.a.weight, m.b.weight, m.b.bias]
    assert output_reach([h, y], leaves) == (0b11, 0b11, 0b10, 0b10)
    assert output_reach([y, h], leaves) == (0b11, 0b11, 0b01, 0b01)
    assert output_reach([h], leaves) == ()  # (one output: a backward reaches all it computes)
    z = h * 2  # two outputs of one node path: both bits on everything below
    assert output_reach([y, z], [m.a.weight, m.b.weight]) == (0b11, 0b01)
    seen: dict[int, frozenset[int]] = {}
    assert unreached((0b11, 0b11, 0b10, 0b10), (torch.ones(1), None), seen) == {2, 3}
    assert unreached((0b11, 0b11, 0b10, 0b10), (torch.ones(1), torch.ones(1)), seen) == frozenset()
    assert unreached((0b11, 0b11, 0b10, 0b10), (None, torch.ones(1)), seen) == frozenset()
    assert seen == {0b01: {2, 3}, 0b11: frozenset(), 0b10: frozenset()}
    assert unreached((), (None,), seen) == frozenset()


def test_emulated_an_output_the_loss_leaves_unused_gives_no_gradient_as_eagerly(emulated) -> None:
    """A loss over one output only: what only the other output reaches keeps ``.grad`` None,
    as eagerly (an optimizer then skips it); the backward graph's zeros are not handed out."""
    torch.manual_seed(0)
    model = TwoOutputs(6)
    ref = copy.deepcopy(model)
    tr.make_graphed_callables(model, (torch.randn(3, 6, requires_grad=True),))
    for step in range(6):
        x = torch.randn(3, 6, requires_grad=True)
        xr = x.detach().clone().requires_grad_(True)
        t = torch.randn(3, 6)
        for m, inp in ((model, x), (ref, xr)):
            h, y = m(inp)
            ((h * t).sum(), y.sum(), (h * t).sum() + (y * t).sum())[step % 3].backward()
        torch.testing.assert_close(x.grad, xr.grad)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), (name, step)
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{name} at step {step}: {m}")
        if step % 3 == 0:
            assert model.b.weight.grad is None
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    assert model.forward.stats.backward_replays == 6


class _TwoPaths(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x1), self.b(x2)


def test_emulated_grad_of_an_input_only_an_unused_output_reaches_is_as_eager(emulated) -> None:
    """``torch.autograd.grad(h.sum(), [x1, x2])`` where only the unused output reaches ``x2``:
    autograd's "not been used" error, as eagerly, and None with ``allow_unused=True``."""
    torch.manual_seed(0)
    model = _TwoPaths()
    ref = copy.deepcopy(model)
    tr.make_graphed_callables(model, (torch.randn(3, 6, requires_grad=True), torch.randn(3, 6, requires_grad=True)))
    for m in (ref, model):
        x1, x2 = torch.randn(3, 6, requires_grad=True), torch.randn(3, 6, requires_grad=True)
        with pytest.raises(RuntimeError, match="not have been used"):
            torch.autograd.grad(m(x1, x2)[0].sum(), [x1, x2])
        g1, g2 = torch.autograd.grad(m(x1, x2)[0].sum(), [x1, x2], allow_unused=True)
        assert g2 is None
        torch.testing.assert_close(g1, torch.autograd.grad(ref(x1, x2)[0].sum(), x1)[0])
    assert model.forward.stats.backward_replays == 2 and model.forward.stats.recomputed == 0


class _HostScale(nn.Module):
    """A break: scales by a number read on the host."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * (1.0 + h.detach().abs().max().item() * 0)


class _AcrossABreak(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.aux, self.b = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.brk = _HostScale()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x).tanh()
        return self.b(self.brk(h)), self.aux(h)


def test_emulated_an_unused_output_gives_no_gradient_across_breaks(emulated, monkeypatch) -> None:
    """With ``breaks=``: an output made before the break (``aux``) or after it, left unused by
    the loss, gives no gradient to what only it reaches, as eagerly."""
    from torchreplay.breaks import training as breaks_training

    monkeypatch.setattr(breaks_training, "infer_device", lambda fn, call, device=None: CPU)
    torch.manual_seed(0)
    model = _AcrossABreak()
    ref = copy.deepcopy(model)
    tr.make_graphed_callables(model, (torch.randn(3, 6),), breaks=[_HostScale])
    for step in range(6):
        x, t = torch.randn(3, 6), torch.randn(3, 6)
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            y, a = m(x)
            ((y * t).sum(), (a * t).sum(), (y * t).sum() + a.sum())[step % 3].backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), (name, step)
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{name} at step {step}: {m}")
    assert len(model.forward.segments) == 2 and model.b.weight.grad is not None


def test_emulated_kwargs_non_tensor_flag_and_pytree_outputs(emulated) -> None:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))

    def fn(x, *, scale, mode="sum"):
        h = x @ w * scale
        return {"h": h, "argmax": h.argmax(-1), "mode": mode}

    g = tr.make_graphed_callables(fn, (torch.randn(2, 4),), sample_kwargs={"scale": torch.tensor(2.0), "mode": "sum"})
    x = torch.randn(2, 4)
    out = g(x, scale=torch.tensor(3.0), mode="sum")
    assert out["mode"] == "sum" and out["argmax"].dtype == torch.long
    assert out["h"].requires_grad and not out["argmax"].requires_grad
    torch.testing.assert_close(out["h"], x @ w * 3.0)
    out["h"].sum().backward()  # w is reached through the closure: it gets a gradient
    torch.testing.assert_close(w.grad, (x * 3.0).sum(0, keepdim=True).T.expand(4, 4))
    with pytest.raises(ReplayInputError, match=r"kwargs\['mode'\]: 'max' but the graph was captured with the constant 'sum'"):
        g(x, scale=torch.tensor(3.0), mode="max")
    with pytest.raises(ReplayInputError, match=r"args\[0\] 'x': shape \(3, 4\)"):
        g(torch.randn(3, 4), scale=torch.tensor(3.0), mode="sum")


def test_emulated_input_gradients_and_requires_grad_mismatch(emulated, caplog: pytest.LogCaptureFixture) -> None:
    model = _mlp()
    x = torch.randn(3, 6, requires_grad=True)
    assert tr.make_graphed_callables(model, (x,)) is model
    x2 = torch.randn(3, 6, requires_grad=True)
    model(x2).sum().backward()
    ref = _mlp()
    x3 = x2.detach().clone().requires_grad_(True)
    ref(x3).sum().backward()
    torch.testing.assert_close(x2.grad, x3.grad)

    # A sample that does not require grad: like torch's, a call with one that does runs (drop-in)
    # and computes no gradient for it; unlike torch's, one warning names the missing gradient.
    g2 = tr.make_graphed_callables(_mlp(), (torch.randn(3, 6),))
    x4 = torch.randn(3, 6, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        g2(x4).sum().backward()
        g2(x4).sum().backward()
    said = [r.getMessage() for r in caplog.records if "requires grad, but its sample" in r.getMessage()]
    assert len(said) == 1 and "args[0] 'input'" in said[0] and ".grad stays None" in said[0]
    assert x4.grad is None
    g2(torch.randn(3, 6, requires_grad=True).detach())


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_emulated_higher_order_and_second_backwards_equal_eager(emulated, caplog: pytest.LogCaptureFixture) -> None:
    """What the backward graph cannot compute, eager does (training/recompute.py): a gradient
    penalty (create_graph=True over the parameters), a physics-informed loss (the derivative
    of the output with respect to the input, differentiated again), two losses of one output
    (retain_graph=True). Torch's tool refuses the first and reads overwritten memory in the
    second. Each equals eager, once said per reason, counted."""
    model = _mlp()
    ref = copy.deepcopy(model)
    tr.make_graphed_callables(model, (torch.randn(3, 6, requires_grad=True),))

    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        for step in higher_order.STEPS * 2:
            x = torch.randn(3, 6)
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            step(model, x)
            step(ref, x)
            for got, want in zip(_grads(model), _grads(ref)):
                torch.testing.assert_close(got, want)
    said = [r.getMessage() for r in caplog.records if "runs the forward again eagerly" in r.getMessage()]
    assert len(said) == 2 and "create_graph=True" in said[0] and "retain_graph=True" in said[1]
    stats = model.forward.stats
    # penalty and pinn recompute the create_graph backward; the loss's own backward replays
    # after it. two_losses replays the first and recomputes the second.
    assert stats.recomputed == 6 and stats.replays == 6 and stats.backward_replays == 6
    assert "recomputed=6" in repr(stats)
    assert model.forward._recompute.guard is False  # it writes no state: no guard after the first

    # As eager: an argument changed in place after the call, then a backward that needs it
    x = torch.randn(3, 6)
    y = model(x).pow(2).sum()
    x.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(y, list(model.parameters()), create_graph=True)
    del y  # its backward never ran: while it is alive, the next forward would run eagerly
    # ... and a second backward without retain_graph
    y = model(torch.randn(3, 6)).sum()
    y.backward()
    with pytest.raises(RuntimeError, match="a second time"):
        y.backward()
    # ordinary steps replay again afterwards
    before = stats.backward_replays
    model(torch.randn(3, 6)).sum().backward()
    assert stats.backward_replays == before + 1 and stats.fallbacks == 0


class _HostAttention(nn.Module):
    """Row b attends to its first lengths[b] positions (host lengths: a break)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        rows = [(q[b] @ k[b, :n].T).softmax(-1) @ v[b, :n] for b, n in enumerate(lengths.tolist())]
        return torch.stack(rows)


class _AroundABreak(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.attn, self.out = nn.Linear(8, 8), _HostAttention(), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(h * self.attn(h, lengths))


def test_emulated_higher_order_backwards_through_segments_around_a_break(emulated, monkeypatch) -> None:
    """With breaks=: the segment after the break reads ``h`` and the break's output ``a =
    attn(h)``. Its recompute differentiates with respect to aliases of its inputs: with respect
    to ``h`` itself autograd would also take the path through ``a``, which the break's own
    backward takes too (counted twice: the first version of the recompute did). A gradient
    penalty and a second-order term through the input, equal to eager."""
    from torchreplay.breaks import training as breaks_training

    monkeypatch.setattr(breaks_training, "infer_device", lambda fn, call, device=None: CPU)
    torch.manual_seed(0)
    model = _AroundABreak()
    ref = copy.deepcopy(model)
    lengths = torch.tensor([4, 2, 3])
    tr.make_graphed_callables(model, (torch.randn(3, 4, 8), lengths), breaks=[_HostAttention])
    for step in range(4):
        x = torch.randn(3, 4, 8)
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(step % 2 == 1)
            loss = m(xi, lengths).square().mean()
            wrt = list(m.parameters()) + ([xi] if step % 2 else [])
            gs = torch.autograd.grad(loss, wrt, create_graph=True)
            (loss + sum(g.square().sum() for g in gs)).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda s: f"step {step} {name}: {s}")
    assert all(seg.stats.recomputed == 4 for seg in model.forward.segments)


def test_emulated_recompute_of_a_widened_argument(emulated, caplog: pytest.LogCaptureFixture) -> None:
    """A bfloat16 argument copied into the float32 capture (a lossless widening): the recompute
    runs on it widened, as the replay did, and its gradient comes back in its own dtype."""
    model = _mlp()
    ref = copy.deepcopy(model)
    tr.make_graphed_callables(model, (torch.randn(3, 6, requires_grad=True),))
    x = torch.randn(3, 6).bfloat16().requires_grad_(True)
    xr = x.detach().clone().requires_grad_(True)
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        for m, xi in ((model, x), (ref, xr)):
            u = m(xi) if m is model else m(xi.float())
            (gx,) = torch.autograd.grad(u.sum(), xi, create_graph=True)
            (gx.float().pow(2).sum() + u.pow(2).sum()).backward()
    assert x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad, xr.grad)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert model.forward.stats.recomputed == 1


def test_emulated_recompute_keeps_running_statistics_and_refuses_a_written_argument(emulated) -> None:
    """The recompute runs on clones of the buffers: BatchNorm's running statistics are updated
    once per forward, as in eager. A forward that writes its argument cannot be run again from
    the caller's tensor: a clear error."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    tr.make_graphed_callables(model, (torch.randn(5, 6),))
    for _ in range(3):
        x = torch.randn(5, 6)
        for m in (model, ref):
            loss = m(x).pow(2).sum()
            gs = torch.autograd.grad(loss, list(m.parameters()), create_graph=True)
            sum(g.pow(2).sum() for g in gs).backward()
    for got, want in zip(_grads(model), _grads(ref)):  # (the first bias's is 0 but for rounding)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(model[1].running_mean, ref[1].running_mean)
    torch.testing.assert_close(model[1].running_var, ref[1].running_var)
    assert int(model[1].num_batches_tracked) == int(ref[1].num_batches_tracked) == 3
    assert model.forward._recompute.guard is True  # it writes its statistics: guarded each time

    # A function with no module (as a segment of breaks=, whose ops hold the tensors): the
    # tensors it writes that it did not make keep their values through a recompute
    def running(stat: torch.Tensor, w: torch.Tensor, reads: bool = False):
        def f(x: torch.Tensor) -> torch.Tensor:
            stat.mul_(0.9).add_(x.detach().mean(0), alpha=0.1)
            return torch.tanh(x * w + (stat if reads else 0.0)).sum(0)
        return f

    torch.manual_seed(1)
    w, stat = torch.randn(4, requires_grad=True), torch.zeros(4)
    w_ref, stat_ref = w.detach().clone().requires_grad_(True), stat.clone()
    f, f_ref = running(stat, w), running(stat_ref, w_ref)
    gf = tr.make_graphed_callables(f, (torch.randn(3, 4),))
    stat.zero_()  # (the emulated warm-up and capture ran it)
    assert gf._module is None and not gf._called
    for _ in range(3):
        x = torch.randn(3, 4)
        for fn, ww in ((gf, w), (f_ref, w_ref)):
            (gw,) = torch.autograd.grad(fn(x).pow(2).sum(), [ww], create_graph=True)
            gw.pow(2).sum().backward()
    torch.testing.assert_close(w.grad, w_ref.grad)
    torch.testing.assert_close(stat, stat_ref)
    assert gf.stats.recomputed == 3
    # ... but one that reads what it wrote would be recomputed from the call's result: refused
    stat = torch.zeros(4)
    gr = tr.make_graphed_callables(running(stat, w, reads=True), (torch.randn(3, 4),))
    y = gr(torch.randn(3, 4)).pow(2).sum()
    before = stat.clone()
    with pytest.raises(UnsupportedError, match=r"reads a tensor it wrote itself \(\(4,\) torch.float32, read by aten.add"):
        torch.autograd.grad(y, [w], create_graph=True)
    torch.testing.assert_close(stat, before)  # put back

    # A forward with collectives: run again on this rank alone, it would hang the others
    from torchreplay.distributed.collectives import Collective

    net = _mlp()
    tr.make_graphed_callables(net, (torch.randn(3, 6),))
    net.forward.collectives = (Collective("allreduce_", "0", (0, 1), "torch.float32", 8),)
    y = net(torch.randn(3, 6)).sum()
    with pytest.raises(UnsupportedError, match=r"holds collectives \(allreduce_\(8 x torch.float32, group 0 = ranks \[0, 1\]\)\).*a hang"):
        torch.autograd.grad(y, list(net.parameters()), create_graph=True)

    def bump(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x.add_(1.0)
        return (x * w).sum(0)

    w = torch.randn(4, requires_grad=True)
    g = tr.make_graphed_callables(bump, (torch.randn(3, 4), w))
    # (the emulated capture finds no writes: what _adopt sets from a real capture's; the GPU test
    # tests/gpu/test_training.py has the capture find it)
    g._inputs.set_written((0,))
    g._writes, g.stats.written_inputs = True, g._inputs.written_paths()
    y = g(torch.randn(3, 4), w)
    with pytest.raises(UnsupportedError, match=r"create_graph=True.*writes its argument\(s\) args\[0\]"):
        torch.autograd.grad(y.sum(), [w], create_graph=True)


def test_emulated_two_callables_share_a_pool_and_out_of_order_backward_equals_eager(emulated) -> None:
    torch.manual_seed(0)
    f1, f2 = nn.Linear(4, 4), nn.Linear(4, 4)
    r1, r2 = nn.Linear(4, 4), nn.Linear(4, 4)
    r1.load_state_dict(f1.state_dict())
    r2.load_state_dict(f2.state_dict())
    h = torch.randn(2, 4, requires_grad=True)
    tr.make_graphed_callables((f1, f2), ((torch.randn(2, 4),), (h,)))
    assert f1.forward.pool is f2.forward.pool
    assert [f1.forward._fwd_pos, f2.forward._fwd_pos, f2.forward._bwd_pos, f1.forward._bwd_pos] == [0, 1, 2, 3]

    # chained, in order: equal to eager
    for _ in range(3):
        x = torch.randn(2, 4)
        f2(f1(x)).pow(2).sum().backward()
        r2(r1(x)).pow(2).sum().backward()
    for a, b in zip([*f1.parameters(), *f2.parameters()], [*r1.parameters(), *r2.parameters()]):
        torch.testing.assert_close(a.grad, b.grad)

    # forward of callable 1 again while callable 2's backward is pending (callable 1's own
    # forward has none pending: with one, the call would run eagerly instead): the pending
    # backward's activations are overwritten, so it runs the forward again (as eager computes)
    with torch.no_grad():
        x = torch.randn(2, 4)
        h, hr = f1(x), r1(x)
    y2 = f2(h.requires_grad_())
    with torch.no_grad():
        f1(torch.randn(2, 4))
    y2.sum().backward()
    r2(hr.requires_grad_()).sum().backward()
    torch.testing.assert_close(h.grad, hr.grad)

    # backward out of order: callable 1's backward first, callable 2's afterwards
    x, x2 = torch.randn(2, 4), torch.randn(2, 4)
    y1 = f1(x)
    y2 = f2(x2.clone().requires_grad_())
    y1.sum().backward()
    y2.sum().backward()
    r1(x).sum().backward()
    r2(x2.clone().requires_grad_()).sum().backward()
    for a, b in zip([*f1.parameters(), *f2.parameters()], [*r1.parameters(), *r2.parameters()]):
        torch.testing.assert_close(a.grad, b.grad)
    assert f2.forward.stats.recomputed == 2 and f1.forward.stats.recomputed == 0

    # the capture order replays both backwards again afterwards
    before = f2.forward.stats.backward_replays
    x = torch.randn(2, 4)
    f2(f1(x)).sum().backward()
    assert f2.forward.stats.backward_replays == before + 1


def test_emulated_forward_twice_before_backward_runs_the_second_eagerly(emulated) -> None:
    """Two micro-batches before one backward: the second forward would replay over what the
    first saved, so it runs eagerly (counted); the gradients equal eager's. A forward whose
    output is dropped without a backward leaves nothing pending: the next call replays."""
    model = _mlp()
    ref = copy.deepcopy(model)
    tr.make_graphed_callables(model, (torch.randn(3, 6),))
    a, b = torch.randn(3, 6), torch.randn(3, 6)
    (model(a).sum() + model(b).pow(2).sum()).backward()
    (ref(a).sum() + ref(b).pow(2).sum()).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert model.forward.stats.fallbacks == 1
    replays = model.forward.stats.replays
    model(torch.randn(3, 6))
    model(torch.randn(3, 6)).sum().backward()
    assert model.forward.stats.replays == replays + 2 and model.forward.stats.fallbacks == 1


def test_emulated_train_eval_switch_falls_back_and_counts(emulated) -> None:
    model = Net()
    tr.make_graphed_callables(model, (torch.randn(5, 6),))
    model.eval()
    with torch.no_grad():
        model(torch.randn(5, 6))
    assert model.forward.stats.fallbacks == 1
    model.train()
    model(torch.randn(5, 6))
    assert model.forward.stats.replays == 1


def test_emulated_module_hooks_run_eagerly_around_each_call(emulated) -> None:
    model = _mlp()
    calls = []
    model.register_forward_hook(lambda m, a, out: calls.append(1) or out * 2)
    tr.make_graphed_callables(model, (torch.randn(3, 6),))
    assert calls == []  # warm-up and capture ran the forward itself
    ref = _mlp()
    x = torch.randn(3, 6)
    torch.testing.assert_close(model(x), ref(x) * 2)
    model(x)
    assert calls == [1, 1]


def test_emulated_a_closure_over_an_activation_is_refused(emulated) -> None:
    w = nn.Parameter(torch.randn(4, 4))
    h = torch.randn(2, 4, requires_grad=True) * 2  # computed outside, requires grad

    with pytest.raises(Exception, match="was computed before the call"):
        tr.make_graphed_callables(lambda x: x @ w + h, (torch.randn(2, 4),))


def test_emulated_a_tensor_in_python_state_replaced_after_capture_raises(emulated) -> None:
    """A plain tensor attribute (not a buffer) the forward reads: written in place, every call
    reads it as eager does; replaced, the graph would read the old one, so the call raises."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 4)
            self.scale = torch.rand(4) + 0.5  # Python state, not a buffer
            self.spare = torch.rand(4)  # never read by the forward

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.scale

    torch.manual_seed(0)
    model = Scaled()
    ref = copy.deepcopy(model)
    tr.make_graphed_callables(model, (torch.randn(3, 6),))
    for i in range(4):
        if i == 2:
            with torch.no_grad():
                model.scale.mul_(2.0)
                ref.scale.mul_(2.0)
        x = torch.randn(3, 6)
        torch.testing.assert_close(model(x), ref(x))
    model.spare = torch.rand(4)  # not read: no error
    model(torch.randn(3, 6))
    old, model.scale = model.scale, torch.rand(4)
    with pytest.raises(ReplayInputError, match=r"Scaled\.scale is tensor\(4,\).*graph again"):
        model(torch.randn(3, 6))
    assert model.forward.stats.replays == 5
    model.scale = old  # put back: replays again
    x = torch.randn(3, 6)
    torch.testing.assert_close(model(x), ref(x))
    assert model.forward.stats.replays == 6


def test_emulated_unused_parameter_needs_allow_unused_input(emulated) -> None:
    class Half(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x):
            return self.used(x)

    with pytest.raises(Exception, match="allow_unused_input=True"):
        tr.make_graphed_callables(Half(), (torch.randn(2, 3),))
    m = Half()
    tr.make_graphed_callables(m, (torch.randn(2, 3),), allow_unused_input=True)
    m(torch.randn(2, 3)).sum().backward()
    assert m.unused.weight.grad is None and m.used.weight.grad is not None


def test_emulated_verify_catches_outputs_that_differ_from_eager(emulated) -> None:
    w = nn.Parameter(torch.randn(3, 3))

    def scaled(x):
        return {"y": x @ w}

    g = tr.make_graphed_callables(scaled, (torch.randn(2, 3),), verify=2)
    g(torch.randn(2, 3))["y"].sum().backward()  # call 1 agrees
    assert g.stats.verified == 1
    real = g._fwd_replay

    def planted():  # what a frozen Python value would do: the graph computes something else
        real()
        g._pair.leaves[0].mul_(2.0)

    g._fwd_replay = planted
    with pytest.raises(VerifyError) as info:
        g(torch.randn(2, 3))
    assert info.value.call == 2 and info.value.what == "output['y']"
    assert "scaled': output['y'] differs from eager by up to" in str(info.value)
    g(torch.randn(2, 3))  # verify=2 is used up: no more comparisons
    assert g.stats.verified == 1


def test_emulated_verify_compares_gradients(emulated) -> None:
    model = _mlp()
    tr.make_graphed_callables(model, (torch.randn(3, 6),), verify=1)
    # Corrupt the backward "graph": verify names the first parameter gradient that differs.
    runner = model.forward
    real = runner._bwd_replay

    def corrupted():
        real()
        runner._static_grad_inputs[0].add_(1.0)

    runner._bwd_replay = corrupted
    with pytest.raises(VerifyError, match=r"call 1 of graphed 'Sequential': grad of parameter '0.weight' differs"):
        model(torch.randn(3, 6)).sum().backward()


# -- graph_step end to end, with capture and replay emulated on the CPU -------------------------


class _FakeGraph:
    def __init__(self, replay):
        self.replay = replay


def _emulated_step_capture(fn, args, kwargs, *, device, stream, pool, config, grad, warmup, snapshot,
                           watch=(), effects=None, free_warmup=False):
    """capture() for graph_step, emulated: warm-up runs for real; the "graph" re-runs the step
    eagerly on the static inputs with the learning-rate tensors installed (what the captured
    step reads) and writes its outputs into the captured output tensors. The Python state the
    step changes is compared as capture() does."""
    step = fn.owner
    owner = weakref.ref(step)  # (as a CUDA graph: the graph does not hold the step)
    n = config.num_warmup_iters if warmup else 0
    try:
        effects.start()
        for i in range(n):
            with effects.warmup(last=i == n - 1):
                fn(*args, **kwargs)
        effects.before_capture()
        step_mod.capturing = lambda: True
        try:
            with effects.captured():
                out = fn(*args, **kwargs)  # the capture call: records parameters and .grad
        finally:
            step_mod.capturing = _capturing
    except Exception as exc:
        snapshot.restore()
        effects.undo()
        raise tr.CaptureError(f"warm-up failed: {exc}") from exc
    err = effects.verdict()
    if err is not None:
        snapshot.restore()
        effects.undo()
        raise err
    effects.put_back_tensors()
    leaves = _compat.tree_flatten(out)[0]

    def replay():
        step = owner()
        for slot in step._lr_slots:
            slot.install()
        try:
            with torch.enable_grad():
                new = step.fn(*args, **kwargs)
        finally:
            step._uninstall()
        with torch.no_grad():
            for a, b in zip(leaves, _compat.tree_flatten(new)[0]):
                if isinstance(a, torch.Tensor):
                    a.copy_(b)

    @dataclasses.dataclass
    class Captured:
        graph: object
        out: object
        seconds: float
        written: tuple = ()
        collectives: tuple = ()
        collective_log: object = None

    return Captured(_FakeGraph(replay), out, 0.0)


_capturing = step_mod.capturing


@pytest.fixture
def emulated_step(monkeypatch):
    import test_buckets

    monkeypatch.setattr(step_mod, "capture", _emulated_step_capture)
    monkeypatch.setattr(step_parts_mod, "infer_device", lambda fn, call, device=None: CPU)
    monkeypatch.setattr(step_mod, "side_stream", lambda device: None)
    test_buckets.as_cpu_build(monkeypatch.setattr)
    yield


def _make_training(seed=0, dropout=0.0):
    # On the CPU, SGD(fused=True) is the optimizer whose step reads a tensor learning rate
    # (AdamW(capturable=True) needs CUDA); tests/gpu covers AdamW.
    torch.manual_seed(seed)
    model = Net(dropout=dropout)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, weight_decay=0.01, fused=True)
    return model, opt


def _sgd_step(model: nn.Module, opt: torch.optim.Optimizer):
    """The training step people write: zero the gradients, a loss, backward, step."""

    def train_step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        return loss

    return train_step


def test_emulated_graph_step_n_steps_equal_n_eager_steps(emulated_step) -> None:
    model, opt = _make_training(dropout=0.3)
    ref_model, ref_opt = _make_training(dropout=0.3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    train_step = _sgd_step(model, opt)
    x, y = torch.randn(5, 6), torch.randn(5, 3)
    for p in model.parameters():  # gradients left over from before: graphing keeps them
        p.grad = torch.full_like(p, 0.5)
    torch.manual_seed(123)
    step = tr.graph_step(train_step, x, y)
    assert step.optimizers == [opt] and step.stats.captures == 1
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in model.parameters())
    assert len(step._params) == len(list(model.parameters()))
    assert not any(opt.state[p]["momentum_buffer"].any() for p in model.parameters())
    assert isinstance(opt.param_groups[0]["lr"], float)  # the user's lr is left as it was
    losses, ref_losses = [], []
    gen = torch.Generator().manual_seed(7)
    batches = [(torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)) for _ in range(6)]
    torch.manual_seed(123)
    for bx, by in batches:
        losses.append(step(bx, by).clone())
        sched.step()
    torch.manual_seed(123)
    for bx, by in batches:
        ref_opt.zero_grad(set_to_none=True)
        loss = ((ref_model(bx) - by) ** 2).mean()
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.detach())
        ref_sched.step()
    for a, b in zip(losses, ref_losses):
        torch.testing.assert_close(a, b)
    for (n, a), b in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, msg=n)
    for a, b in zip(model.buffers(), ref_model.buffers()):
        torch.testing.assert_close(a, b)
    assert step.stats.replays == 6


def test_emulated_graph_step_is_freed_at_once_when_dropped(emulated_step) -> None:
    """``del step`` frees a graph_step, its graph and (on a GPU) its pool's memory at once: no
    reference cycle through it (its pool's finalizer, its state keeper, its optimizer hooks)
    leaves it to Python's next full collection, or keeps it for good."""
    model, opt = _make_training()
    x, y = torch.randn(5, 6), torch.randn(5, 3)
    step = tr.graph_step(_sgd_step(model, opt), x, y)
    step(x, y)
    assert step.stats.replays == 1
    gone = weakref.ref(step)
    with collector_off():
        del step
        assert gone() is None
    opt.step()  # the optimizer it adopted still steps on its own


def test_emulated_graph_step_puts_back_what_warm_up_wrote_into_a_large_history(emulated_step) -> None:
    """A loss history kept as a plain tensor over 1 MiB, written at a position counter: the
    build's calls wrote their losses into it and advanced the counter; both are put back
    (core/rewind.py, core/effects.py), and the steps after equal eager's."""
    model, opt = _make_training()
    ref_model, ref_opt = _make_training()

    hist, pos = torch.zeros(400_000), torch.zeros(1, dtype=torch.long)
    ref_hist, ref_pos = hist.clone(), pos.clone()
    step = tr.graph_step(history_step(model, opt, hist, pos), torch.randn(5, 6), torch.randn(5, 3), optimizers=opt)
    assert int(hist.count_nonzero()) == 0 and int(pos) == 0
    ref_step = history_step(ref_model, ref_opt, ref_hist, ref_pos)
    for _ in range(4):
        x, y = torch.randn(5, 6), torch.randn(5, 3)
        torch.testing.assert_close(step(x, y), ref_step(x, y))
    torch.testing.assert_close(hist, ref_hist)
    assert int(pos) == int(ref_pos) == 4


def test_emulated_graph_step_frozen_hyperparameter_raises(emulated_step) -> None:
    model, opt = _make_training()

    def train_step(x):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    step = tr.graph_step(train_step, torch.randn(5, 6))
    step(torch.randn(5, 6))
    opt.param_groups[0]["weight_decay"] = 0.5
    with pytest.raises(ReplayInputError, match=r"SGD.param_groups\[0\] changed 'weight_decay' from 0.01 to 0.5"):
        step(torch.randn(5, 6))
    opt.param_groups[0]["weight_decay"] = 0.01
    opt.load_state_dict(opt.state_dict())
    with pytest.raises(ReplayInputError, match="load_state_dict"):
        step(torch.randn(5, 6))


def test_emulated_graph_step_scheduler_inside_the_step_is_refused(emulated_step) -> None:
    model, opt = _make_training()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def train_step(x):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        return loss

    before = _snapshot(model)
    with pytest.raises(UnsupportedError, match=r"scheduler.step\(\) outside the graphed step"):
        tr.graph_step(train_step, torch.randn(5, 6))
    assert isinstance(opt.param_groups[0]["lr"], float)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_emulated_graph_step_discovers_a_non_capturable_optimizer(emulated_step) -> None:
    model = nn.Linear(3, 3)
    opt = torch.optim.Adagrad(model.parameters())
    before = _snapshot(model)

    def train_step(x):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    with pytest.raises(UnsupportedError, match="Adagrad has no capturable=True option"):
        tr.graph_step(train_step, torch.randn(2, 3))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_emulated_graph_step_grad_accumulation_across_calls_follows_eager(emulated_step) -> None:
    """A step without zero_grad accumulates into .grad across calls, as eagerly."""
    model, opt = _make_training()
    ref, _ = _make_training()
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)

    def accumulate(x):
        loss = model(x).pow(2).mean()
        loss.backward()
        sgd.step()
        return loss

    step = tr.graph_step(accumulate, torch.randn(5, 6))
    xs = [torch.randn(5, 6) for _ in range(3)]
    for x in xs:
        step(x)
        ref(x).pow(2).mean().backward()
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=n)


def test_emulated_graph_step_verify_names_the_parameter(emulated_step) -> None:
    model, opt = _make_training()

    def train_step(x):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    step = tr.graph_step(train_step, torch.randn(5, 6), verify=2)
    step(torch.randn(5, 6))
    assert step.stats.verified == 1
    real = step._replay

    def corrupted():
        real()
        with torch.no_grad():
            model.fc2.bias.add_(1.0)

    step._replay = corrupted
    with pytest.raises(VerifyError, match=r"call 2 of graphed '[^']*train_step': parameter 'fc2.bias' after the step differs"):
        step(torch.randn(5, 6))


def test_emulated_graph_step_with_a_grad_scaler_equals_eager(emulated_step) -> None:
    model, opt = _make_training()
    ref, ref_opt = _make_training()
    scaler, ref_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0), torch.amp.GradScaler("cpu", init_scale=1024.0)

    def make(m, o, s):
        def train_step(x):
            o.zero_grad()
            loss = m(x).pow(2).mean()
            s.scale(loss).backward()
            s.step(o)
            s.update()
            return loss

        return train_step

    xs = [torch.randn(5, 6) for _ in range(4)]
    step = tr.graph_step(make(model, opt, scaler), xs[0])
    assert scaler.get_scale() == 1024.0  # warm-up's updates were undone
    assert int(scaler._growth_tracker) == 0
    ref_step = make(ref, ref_opt, ref_scaler)
    for x in xs:
        torch.testing.assert_close(step(x), ref_step(x).detach())
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)
    assert int(scaler._growth_tracker) == int(ref_scaler._growth_tracker) == 4


def test_emulated_graph_step_zero_grad_at_the_end_and_eval_fallback(emulated_step) -> None:
    model, opt = _make_training()
    ref, ref_opt = _make_training()

    def make(m, o):
        def train_step(x):
            loss = m(x).pow(2).mean()
            loss.backward()
            o.step()
            o.zero_grad(set_to_none=True)
            return loss

        return train_step

    xs = [torch.randn(5, 6) for _ in range(3)]
    step = tr.graph_step(make(model, opt), xs[0])
    ref_step = make(ref, ref_opt)
    for x in xs:
        step(x)
        ref_step(x)
        assert all(p.grad is None for p in model.parameters())  # as after the eager step
    model.eval()
    ref.eval()
    step(xs[0])
    ref_step(xs[0])
    assert step.stats.fallbacks == 1 and step.stats.replays == 3
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)


def test_a_capture_makes_every_live_pool_look_at_its_stream_again() -> None:
    """core/pool.py expect_capture: a capture of ours warms up on the stream it then captures
    on, so a graph called there inside the capture would skip the stream check (on_stream, which
    tells a capturing stream) unless every pool's last stream is forgotten first. Without CUDA,
    on_stream records the stream and reports no capture."""
    from torchreplay.core.pool import expect_capture

    pools = [Pool(CPU), Pool(CPU)]
    for p in pools:
        assert p.on_stream((7, 0, 1)) is False and p.stream == (7, 0, 1)
    expect_capture()
    assert all(p.stream is None for p in pools)
    assert pools[0].on_stream((7, 0, 1)) is False and pools[0].stream == (7, 0, 1)



def test_grad_flags_see_a_layer_frozen_or_unfrozen() -> None:
    m = _mlp()
    m[2].weight.requires_grad_(False)
    flags = GradFlags(list(m.parameters()), [m])
    assert not flags.changed()
    m[0].weight.requires_grad_(False)
    m[2].weight.requires_grad_(True)
    assert flags.changed()
    assert flags.describe() == "0.weight (True -> False), 2.weight (False -> True)"
    m[0].weight.requires_grad_(True)
    m[2].weight.requires_grad_(False)
    assert not flags.changed()
    only = GradFlags(list(m.parameters()), [m], only_unfrozen=True)  # make_graphed_callables'
    assert only.names == ["2.weight"]
    m[0].weight.requires_grad_(False)  # frozen since: autograd drops its gradient itself
    assert not only.changed()
    m[2].weight.requires_grad_(True)
    assert only.changed() and GradFlags([]).changed() is False


def test_emulated_graph_step_runs_eagerly_once_a_layer_is_frozen(emulated_step, caplog) -> None:
    # Eagerly a frozen layer gets no gradient and SGD skips it; a replay would update it
    model, opt = _make_training()

    def train_step(x):
        opt.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    step = tr.graph_step(train_step, torch.randn(5, 6))
    step(torch.randn(5, 6))
    model.fc1.weight.requires_grad_(False)
    frozen = model.fc1.weight.detach().clone()
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        for _ in range(2):
            step(torch.randn(5, 6))
    assert torch.equal(model.fc1.weight, frozen) and model.fc1.weight.grad is None
    assert step.stats.fallbacks == 2 and step.stats.replays == 1
    warned = [r.getMessage() for r in caplog.records if "requires_grad" in r.getMessage()]
    assert len(warned) == 1 and "fc1.weight (True -> False)" in warned[0]
    model.fc1.weight.requires_grad_(True)  # as captured: replays again
    step(torch.randn(5, 6))
    assert step.stats.replays == 2 and step.stats.fallbacks == 2


def test_emulated_graphed_callable_runs_eagerly_once_a_frozen_layer_is_unfrozen(emulated) -> None:
    model, ref = _mlp(), _mlp()
    for m in (model, ref):
        m[0].requires_grad_(False)
    tr.make_graphed_callables(model, (torch.randn(3, 6),))
    model(torch.randn(3, 6)).sum().backward()
    assert model.forward.stats.fallbacks == 0 and model[0].weight.grad is None
    for m in (model, ref):  # unfrozen: the backward graph has no gradient for it
        m.zero_grad(set_to_none=True)
        m[0].requires_grad_(True)
    x = torch.randn(3, 6)
    model(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    assert model.forward.stats.fallbacks == 1
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=n)


def test_emulated_optimizer_step_alone_with_a_gradient_set_to_none_runs_eagerly(emulated_step, caplog) -> None:
    """An optimizer step graphed alone (the partial-network recipe) reads every ``.grad``; eagerly
    a parameter whose ``.grad`` is None is skipped (its momentum buffer untouched), while a
    replay would step it on a zero gradient and move it by its momentum. Such a call runs
    eagerly, warned once and counted; calls with every gradient replay. A step whose own
    backward writes the gradient (``zero_grad(set_to_none=False)`` inside) replays whatever
    ``.grad`` the caller left."""
    model, opt = _make_training()
    ref_model, ref_opt = _make_training()
    params, ref_params = list(model.parameters()), list(ref_model.parameters())
    gen = torch.Generator().manual_seed(3)
    grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(6)]
    for ps, o in ((params, opt), (ref_params, ref_opt)):
        for p, g in zip(ps, grads[0]):
            p.grad = g.clone()
        o.step()  # momentum buffers exist: a zero gradient would still move a parameter
    step = tr.graph_step(lambda: opt.step(), optimizers=opt)
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        for i, gs in enumerate(grads[1:]):
            for ps, o in ((params, step), (ref_params, ref_opt.step)):
                for k, (p, g) in enumerate(zip(ps, gs)):
                    p.grad = None if i in (1, 2) and k == 0 else g.clone()
                o()
            for (n, a), b in zip(model.named_parameters(), ref_params):
                torch.testing.assert_close(a, b, msg=f"call {i}: {n}")
    assert step.stats.fallbacks == 2 and step.stats.replays == 3
    warned = [r.getMessage() for r in caplog.records if "without" in r.getMessage() or "None at" in r.getMessage()]
    assert len(warned) == 1 and "param_groups[0]['params'][0]" in warned[0], warned

    model, opt = _make_training()
    ref_model, ref_opt = _make_training()

    def accumulating(m, o):
        def train_step(x, y):
            o.zero_grad(set_to_none=False)
            ((m(x) - y) ** 2).mean().backward()
            o.step()
        return train_step

    x, y = torch.randn(5, 6), torch.randn(5, 3)
    ref = accumulating(ref_model, ref_opt)
    step = tr.graph_step(accumulating(model, opt), x, y)
    assert step._grads.read_only == []  # every .grad is written by the step's own backward
    for p in model.parameters():
        p.grad = None  # the step's backward gives it again: a replay, not an eager call
    step(x, y)
    ref(x, y)
    assert step.stats.fallbacks == 0 and step.stats.replays == 1
    for (n, a), b in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, msg=n)


def test_an_optimizer_step_graphed_before_any_gradient_is_explained() -> None:
    """The capture of an optimizer step alone whose parameters have no ``.grad`` yet records
    nothing; the error says why and what to do (a backward first), not that the work ran on the
    CPU. With one gradient present, or another failure, the error is left as it is."""
    from torchreplay.core.failures import empty_message

    params = [nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(2))]
    opt = torch.optim.SGD(params, lr=0.1)
    empty = tr.CaptureError(empty_message(opt.step, (), {}, None, torch.device("cuda")))
    better = step_parts_mod.explained(empty, "opt.step", [], [opt])
    assert better is not None and "run one backward first" in str(better)
    assert "no parameter of its optimizer has a .grad" in str(better)
    assert step_parts_mod.explained(tr.CaptureError("another failure"), "opt.step", [], [opt]) is None
    params[1].grad = torch.zeros(2)
    assert step_parts_mod.explained(empty, "opt.step", [], [opt]) is None
    assert step_parts_mod.explained(empty, "opt.step", [], []) is None
