"""The piecewise runtime's buffers keep an input's layout (Inductor's code asserts the strides it
was compiled for): static input buffers, the graph's own copies of what eager steps made, and the
copies into an expanded buffer. Pure tensor functions, checked on the CPU; the GPU tests
(``tests/gpu/test_compile_layouts.py``) run them through captured graphs."""

from __future__ import annotations

import pytest
import torch

from torchreplay import _compat
from torchreplay.pieces.entries import Entry, Route, buffer_like, copy_expanded, shares_rows, static_buffer
from torchreplay.pieces.handoff import Expanded


def _layouts() -> dict[str, torch.Tensor]:
    return {
        "contiguous": torch.randn(4, 6, 5),
        "transposed": torch.randn(4, 5, 6).transpose(1, 2),
        "rows inner": torch.randn(6, 5, 4).permute(2, 0, 1),
        "expanded": torch.randn(4, 1, 5).expand(4, 6, 5),
        "sliced": torch.randn(4, 6, 8)[..., :5],
    }


@pytest.mark.parametrize("name", list(_layouts()))
def test_an_unpadded_buffer_has_the_inputs_very_strides(name: str) -> None:
    arg = _layouts()[name]
    buf = static_buffer({}, 0, None, arg, None, None)
    assert buf.shape == arg.shape and buf.stride() == arg.stride()
    _compat.copy_back(buf, arg)
    assert torch.equal(buf, arg)


@pytest.mark.parametrize("name", list(_layouts()))
def test_a_padded_buffer_orders_its_dimensions_as_the_input(name: str) -> None:
    """Padded along dimension 0 to 8 rows: the strides are those of a tensor of 8 rows laid
    out as the input (what Inductor's code, compiled for the symbolic rows, computes)."""
    arg = _layouts()[name]
    buf = static_buffer({}, 0, 8, arg, 0, None)
    assert buf.shape == (8, *arg.shape[1:])
    order = sorted(range(3), key=lambda d: -arg.stride(d))
    assert sorted(range(3), key=lambda d: -buf.stride(d)) == order
    assert _compat.expanded_dims(buf) == _compat.expanded_dims(arg)
    assert not buf.any()


def test_every_size_shares_one_buffer_only_where_the_rows_are_outermost() -> None:
    layouts = _layouts()
    assert shares_rows(layouts["contiguous"]) and shares_rows(layouts["transposed"])
    assert not shares_rows(layouts["rows inner"])
    assert not shares_rows(torch.randn(1, 5).expand(4, 5))  # rows expanded: no rows of their own
    buffers: dict = {}
    small = static_buffer(buffers, 0, 2, layouts["transposed"], 0, [2, 8])
    large = static_buffer(buffers, 0, 8, layouts["transposed"], 0, [2, 8])
    assert len(buffers) == 1 and small.data_ptr() == large.data_ptr()
    assert small.stride() == large.stride()  # the leading rows of one buffer: the same strides
    inner = static_buffer(buffers, 0, 2, layouts["rows inner"], 0, [2, 8])
    assert len(buffers) == 1 and inner.shape[0] == 2  # a buffer of its own


def test_an_expanded_buffer_takes_a_calls_value_once_per_location() -> None:
    arg = _layouts()["expanded"]
    buf = static_buffer({}, 0, None, arg, None, None)
    route = Route(None, Entry(None), ())
    route.expanded.append((_compat.unexpanded(buf), 0, _compat.expanded_dims(buf)))
    value = torch.randn(4, 1, 5).expand(4, 6, 5)
    assert copy_expanded(route, [value]) is None
    assert torch.equal(buf, value)
    # a value with different elements along the expanded dimension cannot be copied in
    assert copy_expanded(route, [torch.randn(4, 6, 5)]) == 0


def test_an_eager_steps_expanded_value_fills_the_graphs_own_buffer() -> None:
    made = torch.randn(3, 1).expand(3, 7)
    held = Expanded(_compat.clone_strided(made))
    assert held.buf.stride() == made.stride()
    again = torch.randn(3, 1).expand(3, 7)
    assert held.fill(again) and torch.equal(held.buf, again)
    assert not held.fill(torch.randn(3, 7))  # not expanded: its columns may differ
    assert not held.fill(torch.randn(3, 1).expand(3, 8))  # another shape


def test_buffer_like_is_dense_in_the_inputs_order() -> None:
    arg = _layouts()["rows inner"]
    buf = buffer_like(arg, [8, 6, 5])
    assert buf.stride() == (1, 40, 8)  # rows innermost, as in the input


@pytest.mark.parametrize("name", list(_layouts()) + ["step", "scalar", "empty"])
def test_dense_tells_whether_a_clone_keeps_the_strides(name: str) -> None:
    """``_compat.dense`` (read from the strides, nothing allocated) says what ``clone`` keeps:
    the clone policy makes the others with their very strides."""
    t = {**_layouts(), "step": torch.randn(12)[::2], "scalar": torch.tensor(1.0),
         "empty": torch.randn(0, 3)}[name]
    assert _compat.dense(t) == (t.clone().stride() == t.stride())
