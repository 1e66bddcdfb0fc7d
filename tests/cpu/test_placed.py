"""core/placed.py: where a graph's module state was at capture, checked on the CPU."""

from __future__ import annotations

import pytest
import torch

from torchreplay import ReplayInputError
from torchreplay.core.placed import Placed

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
    assert not placed.moved()


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
    assert placed.moved()
    err = placed.error("MyModel")
    assert isinstance(err, ReplayInputError)
    assert "'MyModel'" in str(err) and "'0.weight'" in str(err) and "assign=True" in str(err)


def test_the_captured_storages_are_held_so_no_graph_reads_freed_memory() -> None:
    """One tensor replaced alone is not seen per call; its old memory stays allocated while
    the graph lives (the graph keeps computing with the old value, never with freed memory)."""
    model = _model()
    placed = Placed.of(model, CPU)
    old = model[2].weight.untyped_storage()
    model[2].weight.data = torch.randn(2, 4)
    assert not placed.moved()
    assert any(s.data_ptr() == old.data_ptr() for s in placed.storages)


def test_nothing_to_watch() -> None:
    assert Placed.of(None, CPU) is None
    assert Placed.of(torch.nn.ReLU(), CPU) is None
    assert Placed.of(_model(), torch.device("meta")) is None  # its state is elsewhere
