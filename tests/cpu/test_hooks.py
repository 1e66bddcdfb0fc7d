"""Forward hooks that change after capture (core/modes.py ``Hooks``): the per-call test is one
attribute read until a hook handle is made anywhere; then every module's hooks are compared
with capture's. A hook added or removed after capture is a reason to run eagerly; hooks present
at capture with Python code of their own are named once."""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
import torch.nn.utils.prune
from torch.optim.optimizer import register_optimizer_step_pre_hook

from torchreplay.core.modes import HOOKS, EagerCalls, Hooks


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Sequential(nn.Linear(3, 3)))


def test_a_hook_added_after_capture_anywhere_in_the_tree_is_seen_and_its_removal_too() -> None:
    m = model()
    hooks = Hooks(m)
    assert hooks.at == torch.utils.hooks.RemovableHandle.next_id
    other = nn.Linear(2, 2).register_forward_hook(lambda *a: None)  # not ours: same hooks
    assert hooks.look() and hooks.at == torch.utils.hooks.RemovableHandle.next_id
    handle = m[2][0].register_forward_hook(lambda *a: None)
    assert not hooks.look() and hooks.at == -1  # every call looks again while they differ
    assert hooks.changed_names() == "Linear"
    handle.remove()
    assert hooks.look()
    pre = m.register_forward_pre_hook(lambda *a: None)  # on the module itself
    assert not hooks.look()
    pre.remove()
    glob = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert not hooks.look() and "the global hooks" in hooks.changed_names()
    finally:
        glob.remove()
    assert hooks.look()
    other.remove()


def test_a_hook_removed_after_capture_is_seen() -> None:
    m = model()
    handle = m[1].register_forward_hook(lambda *a: None)
    hooks = Hooks(m)
    handle.remove()  # a removal makes no handle: the next registration anywhere shows it,
    m[0].register_forward_hook(lambda *a: None).remove()  # or this call's look
    assert not hooks.look()


def test_eager_calls_gives_the_hooks_reason_and_names_hooks_with_effects(caplog) -> None:
    m = model()
    seen = []
    m[1].register_forward_hook(lambda mod, i, o: seen.append(o))
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        calls = EagerCalls("m", m.training, m)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "ReLU" in said[0] and "only then" in said[0]
    assert calls.reason(m) is None
    h = m[0].register_forward_hook(lambda *a: None)
    assert calls.reason(m) == HOOKS
    h.remove()
    assert calls.reason(m) is None


def test_torch_own_hooks_are_not_named(caplog) -> None:
    m = model()
    torch.nn.utils.prune.l1_unstructured(m[0], "weight", amount=0.5)  # a forward pre-hook object
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        EagerCalls("m", False, m)
    assert not caplog.records


def test_a_users_method_hook_is_named(caplog) -> None:
    class Collector:
        def __init__(self) -> None:
            self.seen: list[torch.Tensor] = []

        def keep(self, module: nn.Module, args: object, out: torch.Tensor) -> None:
            self.seen.append(out)

    m = model()
    m[2].register_forward_hook(Collector().keep)
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        EagerCalls("m", False, m)
    assert len(caplog.records) == 1 and "Sequential" in caplog.records[0].getMessage()


def test_training_hooks_backward_gradient_and_optimizer_hooks_are_seen() -> None:
    """A training graph runs none of them at replay either: a full backward hook of a
    submodule, a parameter's gradient hook or post-accumulate hook, an optimizer's step hook,
    and the global ones; without ``backward`` only forward hooks count."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    params = list(m.parameters())
    hooks = Hooks(m, backward=True, tensors=params, optimizers=[opt])
    forward_only = Hooks(m)
    for add, name in (
        (lambda: m[2][0].register_full_backward_hook(lambda *a: None), "Linear"),
        (lambda: m[0].register_full_backward_pre_hook(lambda *a: None), "Linear"),
        (lambda: params[1].register_hook(lambda g: g), "a tensor of shape (3,)"),
        (lambda: params[0].register_post_accumulate_grad_hook(lambda p: None), "a tensor of shape (3, 3)"),
        (lambda: opt.register_step_post_hook(lambda *a: None), "SGD"),
        (lambda: torch.nn.modules.module.register_module_full_backward_hook(lambda *a: None),
         "the global hooks"),
        (lambda: register_optimizer_step_pre_hook(lambda *a: None),
         "the global hooks"),
    ):
        handle = add()
        try:
            assert not hooks.look() and hooks.changed_names() == name
            assert forward_only.look()  # an inference graph runs no backward
        finally:
            handle.remove()
        assert hooks.look()


def test_make_graphed_callables_leaves_out_the_modules_own_hooks() -> None:
    """They run eagerly around the graphed forward: only its submodules' count."""
    m = model()
    hooks = Hooks(m, own=False, backward=True)
    own = m.register_forward_hook(lambda *a: None)
    assert hooks.look()
    own.remove()
    inner = m[1].register_forward_hook(lambda *a: None)
    assert not hooks.look() and hooks.changed_names() == "ReLU"
    inner.remove()


def test_hooks_of_several_root_modules() -> None:
    a, b = model(), model()
    hooks = Hooks([a, b])
    h = b[0].register_forward_pre_hook(lambda *x: None)
    assert not hooks.look()
    h.remove()
    assert hooks.look()
