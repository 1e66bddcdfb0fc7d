"""core/placed.py: where a graph's module state was at capture, checked on the CPU."""

from __future__ import annotations

import pytest
import torch

from torchreplay import ReplayInputError
from torchreplay.core.placed import CHANGES, Placed

CPU = torch.device("cpu")


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def test_weights_loaded_in_place_are_not_a_move() -> None:
    model = _model()
    placed = Placed.of(model, CPU)
    assert placed is not None and placed.name == "0.weight"
    model.load_state_dict(_model().state_dict())
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2)
    assert not placed.changed()


@pytest.mark.parametrize("how", ["assign", "parameter", "to", "data"])
def test_a_model_moved_or_reloaded_as_a_whole_is_seen_and_named(how: str) -> None:
    model = _model()
    placed = Placed.of(model, CPU)
    if how == "assign":
        model.load_state_dict(_model().state_dict(), assign=True)
    elif how == "parameter":
        model[0].weight = torch.nn.Parameter(torch.randn(4, 4))
    elif how == "to":
        model.to(torch.float64)
    else:
        for p in model.parameters():
            p.data = p.data.clone()
    assert placed.changed()
    err = placed.error("MyModel")
    assert isinstance(err, ReplayInputError)
    assert "'MyModel'" in str(err) and "'0.weight'" in str(err) and "assign=True" in str(err)


def test_the_first_weight_deleted_is_a_clear_error_not_a_key_error() -> None:
    """``del module.weight`` fires no hook; the per-call check reads the first tensor's entry,
    which is then missing: it sees a change (address 0) and names it, no raw KeyError."""
    model = _model()
    placed = Placed.of(model, CPU)
    del model[0].weight
    assert placed.changed()
    assert "'0.weight' is gone (now None: deleted" in str(placed.error("MyModel"))


def test_the_captured_storages_are_held_so_no_graph_reads_freed_memory() -> None:
    """One tensor moved alone by ``p.data = ...`` (no hook fires) is not seen per call; its old
    memory stays allocated while the graph lives (the graph keeps computing with the old value,
    never with freed memory)."""
    model = _model()
    placed = Placed.of(model, CPU)
    old = model[2].weight.untyped_storage()
    model[2].weight.data = torch.randn(2, 4)
    assert not placed.changed()
    assert any(s.data_ptr() == old.data_ptr() for s in placed.storages)


def test_nothing_to_watch() -> None:
    assert Placed.of(None, CPU) is None
    assert Placed.of(torch.nn.ReLU(), CPU) is None
    assert Placed.of(_model(), torch.device("meta")) is None  # its state is elsewhere


@pytest.mark.parametrize(
    "how, named",
    [
        ("parameter", "'2.weight' is at another address"),
        ("tied", "'2.weight' is at another address"),
        ("buffer", "'1.scale' is at another address"),
        ("assign-one", "'2.bias' is at another address"),
        ("submodule", "submodule '1' was replaced by GELU"),
        ("parametrize", "'0.weight' is gone"),
    ],
)
def test_one_weight_or_submodule_replaced_alone_is_seen_through_the_registration_hooks(
    how: str, named: str
) -> None:
    model = _model()
    model[1].register_buffer("scale", torch.ones(4))
    placed = Placed.of(model, CPU)
    assert placed is not None and not placed.changed()
    if how == "parameter":
        model[2].weight = torch.nn.Parameter(torch.randn(2, 4))
    elif how == "tied":  # a weight tied to another after capture (HF's tie_weights does this)
        model[2].weight = torch.nn.Parameter(torch.randn(4, 2).t())
    elif how == "buffer":
        model[1].scale = torch.zeros(4)
    elif how == "assign-one":
        model.load_state_dict({"2.bias": torch.zeros(2)}, strict=False, assign=True)
    elif how == "submodule":
        model[1] = torch.nn.GELU()
    else:
        torch.nn.utils.parametrizations.weight_norm(model[0])
    assert placed.changed()
    assert named in str(placed.error("G"))


def test_registrations_that_change_nothing_read_are_checked_once() -> None:
    model = _model()
    placed = Placed.of(model, CPU)
    before = placed.seen
    model[0].register_buffer("unused", torch.zeros(3))  # a new name the graph never read
    model[1] = model[1]  # the same module set again
    assert placed.seen == before and not placed.changed()
    assert placed.seen != before  # remembered: the next call compares two integers again
    seen = placed.seen
    other = _model()  # a module no graph watches: no change counted
    other[0].weight = torch.nn.Parameter(torch.randn(4, 4))
    assert placed.seen == seen and not placed.changed() and placed.seen == seen


def test_same_memory_under_a_new_object_counts_only_where_objects_matter() -> None:
    """Inference reads memory: a new Parameter over the same storage changes nothing. Training
    (objects=True) sends gradients to the captured objects, so there it is a change."""
    for objects in (False, True):
        model = _model()
        placed = Placed.of(model, CPU, objects=objects)
        model[2].weight = torch.nn.Parameter(model[2].weight.data)
        assert placed.changed() is objects


def test_several_roots() -> None:
    """graph_step watches every module its step ran."""
    a, b = torch.nn.Linear(2, 2), _model()
    placed = Placed.of([a, b], CPU)
    assert placed is not None and placed.name == "weight"
    b[0].weight = torch.nn.Parameter(torch.randn(4, 4))
    assert placed.changed() and "'0.weight'" in str(placed.error("step"))


def test_skipped_subtrees_are_neither_compared_nor_watched_but_their_replacement_is_seen() -> None:
    """A breakable graph skips its break modules: they run eagerly and may set their own state
    per call."""
    model = _model()
    model[1] = torch.nn.Linear(4, 4)  # the break
    placed = Placed.of(model, CPU, skip=[model[1]])
    seen = placed.seen
    model[1].weight = torch.nn.Parameter(torch.randn(4, 4))  # its own state: not watched
    assert placed.seen == seen == CHANGES[0]
    assert not placed.changed()
    model[1] = torch.nn.Linear(4, 4)  # the break itself replaced: seen in its parent
    assert placed.changed() and "submodule '1' was replaced by Linear" in str(placed.error("G"))
