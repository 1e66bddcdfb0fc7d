"""The checked policy's test for "nothing holds the last call's output storage any more"
(core/outputs.py ``_free``), on CPU storages: using a storage again is only allowed when no one
could tell, i.e. no tensor over it and no other reference to its Python object is left."""

from __future__ import annotations

import pytest
import torch

from torchreplay import _compat
from torchreplay.core.outputs import _free


def _free_of(live: list[torch.UntypedStorage]) -> list[bool]:
    return _free(live, [_compat.storage_handle(s) for s in live])

pytestmark = pytest.mark.skipif(not _compat.HAS_USE_COUNTS, reason="this torch has no use counts")


def _handed() -> tuple[list[torch.UntypedStorage], torch.Tensor]:
    """Our list of the last call's storages, and the tensor handed out over it (as emit does)."""
    live = [torch.UntypedStorage(48)]
    return live, torch.empty(0).set_(live[0], 0, (4, 3), (3, 1))


def _hold(t: torch.Tensor, hold: str, keep: list) -> None:
    """Make ``t`` reachable (into ``keep``) or tell-apart in the way ``hold`` names."""
    import weakref

    if hold == "variable":
        keep.append(t)
    elif hold == "view":
        keep.append(t.view(-1))
    elif hold == "saved_by_autograd":
        w = torch.randn(4, 3, requires_grad=True)
        keep.append(w * t)  # saves t for the gradient of w
    elif hold == "storage_object":
        keep.append(t.untyped_storage())
    elif hold == "container":
        keep.append({"y": t})
    elif hold == "weakref":
        keep.append(weakref.ref(t))
    elif hold == "data_ptr_only":
        keep.append(t.data_ptr())  # an address holds nothing
    elif hold == "requires_grad":
        t.requires_grad_()
    elif hold == "grad":
        t.grad = torch.zeros(4, 3)
    elif hold == "attribute":
        t.note = "mine"
    elif hold == "unsqueeze_":
        t.unsqueeze_(0)
    else:
        assert hold == "written", hold
        t.add_(1)


def test_a_storage_whose_tensors_were_dropped_is_free() -> None:
    live, t = _handed()
    assert _free_of(live) == [False]
    del t
    assert _free_of(live) == [True]


@pytest.mark.parametrize(
    "hold", ["variable", "view", "saved_by_autograd", "storage_object", "container", "data_ptr_only"]
)
def test_a_storage_anything_can_still_reach_is_not_free(hold: str) -> None:
    live, t = _handed()
    keep: list = []
    _hold(t, hold, keep)
    del t
    assert _free_of(live) == [hold == "data_ptr_only"], hold
    keep.clear()
    assert _free_of(live) == [True], hold


def _handed_tensor() -> tuple[
    list[torch.Tensor], list[int], list[torch.UntypedStorage], list[int], list[int]
]:
    """What Outputs keeps after handing out one tensor with reuse on."""
    from torchreplay.core import outputs

    live = [torch.UntypedStorage(48)]
    handed = [torch.empty(0).set_(live[0], 0, (4, 3), (3, 1))]
    if outputs._HELD_STORAGE_REFS[0] < 0:
        outputs._HELD_STORAGE_REFS[0] = outputs._loop_refcount(live)
    return handed, [t._version for t in handed], live, [_compat.storage_handle(live[0])], [2]


def test_a_dropped_unchanged_tensor_is_unheld() -> None:
    from torchreplay.core.outputs import _unheld

    kept = _handed_tensor()
    assert _unheld(*kept)


@pytest.mark.parametrize(
    "hold",
    ["variable", "view", "saved_by_autograd", "storage_object", "container", "weakref",
     "requires_grad", "grad", "attribute", "unsqueeze_", "written"],
)
def test_a_tensor_anyone_can_reach_or_tell_apart_is_held(hold: str) -> None:
    from torchreplay.core.outputs import _unheld

    handed, versions, live, handles, uses = _handed_tensor()
    keep: list = []
    _hold(handed[0], hold, keep)
    assert not _unheld(handed, versions, live, handles, uses), hold


def test_the_fast_first_check_agrees_with_the_full_one() -> None:
    """emit's first test (the first handed tensor's reference count) passes exactly when only
    our list holds it, so that it never skips a tensor the full test would hand out again."""
    import sys

    from torchreplay.core.outputs import _FIRST_REFS

    handed, *_ = _handed_tensor()
    alone = sys.getrefcount(handed[0])  # outside assert: pytest's rewrite holds temporaries
    kept = handed[0]
    held = sys.getrefcount(handed[0])
    del kept
    assert alone == _FIRST_REFS
    assert held != _FIRST_REFS


def test_held_sees_a_watched_output_saved_by_autograd_and_nothing_else() -> None:
    # A forward graph's saved activations are watched: while autograd keeps one (its backward
    # has not run), the next replay would overwrite it. Other outputs, kept or viewed, do not count.
    from torchreplay.core.outputs import Outputs

    out = [torch.randn(4, 3), torch.randn(4, 3)]
    outputs = Outputs(out, "static", "g", lambda t: True, watch=frozenset({1}))
    user, saved = outputs.emit()
    assert not outputs.held()
    w = torch.randn(4, 3, requires_grad=True)
    pending = w * saved  # saves `saved` for the gradient of w
    assert outputs.held()
    kept = [user, user.view(-1)]  # the caller keeping the user output is not a pending backward
    del pending
    assert not outputs.held()
    assert kept


def test_clone_outputs_are_never_held() -> None:
    from torchreplay.core.outputs import Outputs

    outputs = Outputs([torch.randn(4, 3)], "clone", "g", lambda t: True, watch=frozenset({0}))
    (saved,) = outputs.emit()
    pending = torch.randn(4, 3, requires_grad=True) * saved
    assert not outputs.held()  # a clone is the caller's own memory: a replay cannot touch it
    assert pending is not None


def test_a_second_thread_makes_a_graph_hand_out_clones_once() -> None:
    """core/threads.py: the first caller's thread is remembered; a call from another thread
    turns the outputs into clones, once (later calls of any thread do nothing more)."""
    import threading

    from torchreplay.core.threads import SHARED, Callers, get_ident

    callers, turned = Callers(), []
    shared = lambda: turned.append(get_ident())  # noqa: E731

    def call() -> None:  # what a graph's call does
        if get_ident() != callers.thread:
            callers.another(get_ident(), shared)

    def backward() -> None:  # a forward run again by checkpointing, in autograd's thread
        x = torch.randn(3, requires_grad=True)
        y = x * 2
        y.register_hook(lambda g: call() or g)
        y.sum().backward()

    for _ in range(3):
        call()  # the first caller, then the same thread again
    assert callers.thread == get_ident() and turned == []
    engine = threading.Thread(target=backward)
    engine.start()
    engine.join()
    assert callers.thread == get_ident() and turned == []  # a backward does not count
    other = threading.Thread(target=call)
    other.start()
    other.join()
    assert callers.thread == SHARED and len(turned) == 1
    call()
    assert len(turned) == 1


def test_outputs_made_clones_mark_the_handed_out_stale_and_clone_after() -> None:
    """Outputs.make_clones: what the checked policy handed out so far raises when read, and
    the next outputs are clones, not the graph's memory."""
    from torchreplay.core.outputs import Outputs

    if not (_compat.HAS_CHECKED_OUTPUTS and torch.cuda.is_available()):
        pytest.skip("this torch cannot mark storages stale, or has no GPU to")
    pool = torch.randn(4, 3, device="cuda")  # HAS_CHECKED_OUTPUTS: a CUDA build
    out = Outputs(pool, "checked", "g", lambda t: True, reuse=True)
    handed = out.emit()
    assert handed.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()
    out.make_clones()
    with pytest.raises(RuntimeError, match="StaleOutputError"):
        handed.sum()
    again = out.emit()
    assert torch.equal(again, pool)
    assert again.untyped_storage().data_ptr() != pool.untyped_storage().data_ptr()


def test_a_non_leaf_inputs_gradient_is_handed_out_under_the_policy() -> None:
    """training/pair.py InputGrads: under checked, the backward's buffer itself, the same tensor
    again while nobody kept it, and a kept one raises once a later backward (or another graph of
    the pool) overwrote its memory; clone copies; static is the buffer."""
    from torchreplay.training.pair import InputGrads

    buf = torch.randn(4, 3, device="cuda" if torch.cuda.is_available() else "cpu")
    grads = InputGrads("g (backward)")
    assert grads.emit(0, buf, "static") is buf
    copy = grads.emit(0, buf, "clone")
    assert torch.equal(copy, buf) and copy.data_ptr() != buf.data_ptr()
    if not _compat.HAS_CHECKED_OUTPUTS:
        copy = grads.emit(0, buf, "checked")  # Outputs falls back to clones
        assert torch.equal(copy, buf) and copy.data_ptr() != buf.data_ptr()
        pytest.skip("this torch cannot mark storages stale")
    if not torch.cuda.is_available():  # (a CUDA wheel with no GPU: the marking initializes CUDA)
        pytest.skip("no GPU to mark storages on")

    first = grads.emit(0, buf, "checked")
    assert first.data_ptr() == buf.data_ptr() and torch.equal(first, buf)
    first_id = id(first)
    del first
    again = grads.emit(0, buf, "checked")  # nobody kept it: the same tensor
    assert id(again) == first_id
    kept = again
    del again
    later = grads.emit(0, buf, "checked")  # the next backward: the kept one is stale
    assert later is not kept and later.data_ptr() == buf.data_ptr()
    with pytest.raises(RuntimeError, match=r"StaleOutputError.*'g \(backward\)'"):
        kept.sum()
    grads.invalidate()  # another graph of the pool replayed
    with pytest.raises(RuntimeError, match="StaleOutputError"):
        later.sum()
    last = grads.emit(1, buf, "checked")
    grads.retire()
    with pytest.raises(RuntimeError, match="destroyed"):
        last.sum()


def test_an_output_nobody_can_reach_is_kept_through_invalidation_and_handed_out_again() -> None:
    """Outputs.invalidate (an earlier graph of the pool replayed): a tensor nobody can reach is
    not marked stale but handed out again by the next emit, which tells the pool it has outputs
    out again (the pool stopped counting them); a kept one is marked stale as before."""
    from torchreplay.core.outputs import Outputs

    if not (_compat.HAS_CHECKED_OUTPUTS and torch.cuda.is_available()):
        pytest.skip("this torch cannot mark storages stale, or has no GPU to")
    pool = torch.randn(4, 3, device="cuda")  # HAS_CHECKED_OUTPUTS: a CUDA build
    out = Outputs((pool, pool[0]), "checked", "g", lambda t: True, reuse=True)
    told = []
    out.on_live = lambda: told.append(1)
    first = out.emit()
    assert len(told) == 1
    ids = [id(t) for t in first]
    del first
    out.invalidate()
    out.invalidate()  # kept: nothing to look at again until the next emit
    again = out.emit()
    assert [id(t) for t in again] == ids and len(told) == 2
    del again
    same = out.emit()  # not invalidated since: the pool still counts them out, nothing to tell
    assert [id(t) for t in same] == ids and len(told) == 2
    assert torch.equal(same[0], pool) and torch.equal(same[1], pool[0])
    kept = same[1]
    del same
    out.invalidate()  # held: marked stale, though kept once before
    with pytest.raises(RuntimeError, match="StaleOutputError"):
        kept.sum()
    fresh = out.emit()
    assert id(fresh[1]) not in ids and torch.equal(fresh[1], pool[0]) and len(told) == 3


def _handed_inference_tensor() -> tuple[list[torch.Tensor], list, list[torch.UntypedStorage], list[int], list[int]]:
    """As :func:`_handed_tensor`, for an output made under ``torch.inference_mode``: an inference
    tensor, with its layout where a normal one has its version counter."""
    from torchreplay.core import outputs

    live = [torch.UntypedStorage(48)]
    with torch.inference_mode():
        handed = [torch.empty(0).set_(live[0], 0, (4, 3), (3, 1))]
    assert handed[0].is_inference()
    if outputs._HELD_STORAGE_REFS[0] < 0:
        outputs._HELD_STORAGE_REFS[0] = outputs._loop_refcount(live)
    layouts = [(torch.Size((4, 3)), (3, 1), 0)]
    return handed, layouts, live, [_compat.storage_handle(live[0])], [2]


def test_a_dropped_inference_tensor_is_unheld_even_written() -> None:
    """Values written in place are the next replay's to overwrite, as in a new tensor."""
    from torchreplay.core.outputs import _unheld_inference

    handed, *rest = _handed_inference_tensor()
    assert _unheld_inference(handed, *rest)
    with torch.inference_mode():
        handed[0].add_(1)
    assert _unheld_inference(handed, *rest)


@pytest.mark.parametrize(
    "hold",
    ["variable", "view", "storage_object", "container", "weakref", "requires_grad", "attribute",
     "unsqueeze_", "t_", "as_strided_", "resize_", "set_"],
)
def test_an_inference_tensor_anyone_can_reach_or_tell_apart_is_held(hold: str) -> None:
    """No version counter: what it would show (a change of layout in place, a set_ to other
    memory) is seen from the layout and the storage's use count."""
    from torchreplay.core.outputs import _unheld_inference

    handed, layouts, live, handles, uses = _handed_inference_tensor()
    keep: list = []
    with torch.inference_mode():
        t = handed[0]
        if hold == "t_":
            t.t_()
        elif hold == "as_strided_":
            t.as_strided_((4, 3), (1, 4))
        elif hold == "resize_":  # the same strides, fewer rows
            t.resize_(2, 3)
        elif hold == "set_":
            t.set_(torch.UntypedStorage(48), 0, (4, 3), (3, 1))
        else:
            _hold(t, hold, keep)
        del t
    assert not _unheld_inference(handed, layouts, live, handles, uses), hold


def test_an_output_that_is_an_argument_is_the_callers_tensor() -> None:
    """``return x, mask`` or ``x.add_(1); return x``: eagerly the output is the caller's own
    tensor. Under checked it is handed out as that tensor (not the graph's static copy, which the
    next call overwrites); under clone and static, as before."""
    from torchreplay.core.outputs import Outputs

    static_x, static_mask, y = torch.randn(4, 3), torch.ones(4, 3), torch.randn(4, 3)
    inputs = [static_x, None, static_mask]  # argument leaves: a tensor, a flag, a tensor
    out = Outputs({"y": y, "mask": static_mask, "x": (static_x,)}, "checked", "g", lambda t: False,
                  inputs=inputs)
    assert sorted(out.passed) == [(1, 2), (2, 0)]  # leaves: y, mask, x
    x, mask = torch.randn(4, 3), torch.ones(4, 3)
    got = out.emit([x, True, mask])
    assert got["x"][0] is x and got["mask"] is mask and got["y"] is y
    out.make_clones()  # called from a second thread: the caller's tensor is still its own
    assert out.emit([x, True, mask])["x"][0] is x
    for policy in ("clone", "static"):
        other = Outputs((static_x,), policy, "g", lambda t: False, inputs=inputs)
        assert other.passed == [] and other.emit([x, True, mask])[0] is static_x


def test_an_output_that_is_a_view_of_an_argument_is_that_view_of_the_callers_tensor() -> None:
    """Eagerly ``x[:, 1:]`` is a view of the caller's tensor (it sees the caller's later writes,
    stays valid after later calls); it was a view of the graph's static copy."""
    from torchreplay.core.outputs import Outputs

    static_x = torch.randn(4, 6)
    outs = (static_x[:, 1:], static_x.view(24), static_x.t(), static_x.view(torch.int32), torch.randn(4, 6)[0])
    out = Outputs(outs, "checked", "g", lambda t: t.untyped_storage().data_ptr() == static_x.data_ptr(),
                  inputs=[static_x])
    assert [v[0] for v in out.views] == [0, 1, 2]  # not a reinterpreting view, not another tensor
    for _ in range(3):
        x = torch.randn(4, 6)
        got = out.emit([x])
        assert got[0]._base is x and torch.equal(got[0], x[:, 1:])
        assert torch.equal(got[1], x.view(24)) and torch.equal(got[2], x.t())
        x.add_(1)  # the caller's later write: eagerly the view sees it
        assert torch.equal(got[0], x[:, 1:]) and got[4] is outs[4]
    # A caller's tensor laid out otherwise (a transposed one): not a view of it (the graph's)
    x = torch.randn(6, 4).t()
    got = out.emit([x])
    assert got[0].untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_one_output_that_is_a_view_of_an_argument() -> None:
    """``return x.view(-1)``: the output alone, not in a tuple (emit's shortest path; on the
    CPU the policy falls back to clone, so the checked path is tests/gpu/test_graph.py's)."""
    from torchreplay.core.outputs import Outputs

    static_x = torch.randn(4, 6)
    out = Outputs(static_x.view(-1), "checked", "g",
                  lambda t: t.untyped_storage().data_ptr() == static_x.data_ptr(), inputs=[static_x])
    for _ in range(3):
        x = torch.randn(4, 6)
        y = out.emit([x])
        assert y._base is x and torch.equal(y, x.view(-1))


def test_tr_graph_hands_out_arguments_and_their_views_as_the_callers(monkeypatch) -> None:
    """Through the emulated capture (test_buckets): the one-shape graph passes the call's own
    tensors to emit, so an argument returned is the caller's and a view of one is its view."""
    import test_buckets
    import torchreplay as tr

    test_buckets.install_cpu_graphs(monkeypatch.setattr)
    lin = torch.nn.Linear(4, 4)
    g = tr.graph(lambda x, m: (lin(x) * m, m, x.view(-1), m[:2]), torch.randn(2, 4), torch.randn(4))
    with torch.no_grad():
        for _ in range(3):
            x, m = torch.randn(2, 4), torch.randn(4)
            y, mo, flat, head = g(x, m)
            torch.testing.assert_close(y, lin(x) * m)
            assert mo is m and flat._base is x and head._base is m
            x.add_(1)
            assert torch.equal(flat, x.view(-1))


def test_a_later_entrys_output_saved_by_an_eager_op_blocks_an_earlier_replay() -> None:
    """HF Mixtral trained through the backend: a layer at a new token count is captured at a
    later pool position; the next layer replays an earlier entry, which may write where the new
    entry's outputs lie, while transformers' eager grouped-mm op had saved one for its backward
    (a StaleOutputError in the backward). The caller's outputs are watched with the saved
    activations: held by an autograd node, they block the replay (it runs into fresh memory);
    held by the caller alone they do not (marked stale, as for any kept output). Once the
    caller's graph is gone, nothing blocks: we watch the caller's output (which carries that
    graph, and the activations its backward saved) without keeping it alive."""
    from torchreplay.core.outputs import Outputs
    from torchreplay.pieces.entries import Entry
    from torchreplay.pieces.saved import SavedActivations, user_outputs

    earlier, later = Entry(None), Entry(None)
    earlier.position, later.position = 0, 1
    later.sources = [("pool", 0), ("pool", 1), ("input", 0)]  # program outputs 0, 1, 2
    saved_outputs = frozenset({1})  # program output 1 is a saved activation
    assert user_outputs(later, saved_outputs) == frozenset({0})
    later.outputs = Outputs(
        [torch.randn(4, 3), torch.randn(4, 3)], "static", "fwd", lambda t: True,
        watch=frozenset({1}), watch_callers=user_outputs(later, saved_outputs),
    )

    class Forward(torch.autograd.Function):  # as AOTAutograd's: saves the activation
        @staticmethod
        def forward(ctx: "Any", x: torch.Tensor) -> torch.Tensor:
            user, activation = later.outputs.emit()
            # a new tensor handed out at each call, as the checked policy's on a GPU (this CPU
            # build cannot mark storages stale: "static" stands in, which hands out its own)
            later.outputs.static[0] = torch.randn(4, 3)
            ctx.save_for_backward(activation)
            return user

        @staticmethod
        def backward(ctx: "Any", g: torch.Tensor) -> torch.Tensor:
            (activation,) = ctx.saved_tensors
            return g * activation

    saved = SavedActivations()
    w = torch.randn(4, 3, requires_grad=True)
    y = Forward.apply(torch.randn(4, 3, requires_grad=True))
    saved.replayed(later, tainted=False)  # pending: awaits its backward
    assert saved.blocks(earlier)  # its activation awaits the backward
    y.sum().backward()
    assert not saved.blocks(earlier)  # the caller holding its output alone does not block
    y = Forward.apply(torch.randn(4, 3, requires_grad=True))
    saved.replayed(later, tainted=False)
    pending = w * y  # an eager op saves the output for its backward
    del y  # (the caller's last reference; the eager op's node still holds it)
    assert saved.blocks(earlier)
    del pending  # the whole graph goes: nothing is held any more
    assert not saved.blocks(earlier)
    assert "saved for the backward" in later.outputs._stale_messages[1]
    assert "saved for the backward" not in later.outputs._stale_messages[0]
