"""Which values of eager steps a graph reads where they are (pieces/handoff.py): the program
analysis, on programs of exactly known structure (no device needed)."""

from __future__ import annotations

import torch

from torchreplay.pieces.handoff import can_hand_off, handed_slots
from torchreplay.pieces.program import Input, Piece, Program


def _piece(reads, writes, graphed, direct=False):
    fn = lambda *a: a  # noqa: E731
    return Piece(fn, tuple(reads), tuple(writes), graphed, "p", replay_fn=fn if direct else None)


def test_only_outputs_of_custom_op_steps_that_a_graph_reads_and_nobody_returns() -> None:
    # slot 0: input; 1: graph; 2, 3: custom-op step; 4: graph; 5: plain eager step; 6: graph
    pieces = [
        _piece([0], [1], True),
        _piece([1], [2, 3], False, direct=True),  # 2 read by a graph, 3 returned
        _piece([2], [4], True),
        _piece([4], [5], False),  # no replay_fn: not a custom op's step, copied as before
        _piece([5], [6], True),
    ]
    program = Program((Input("x", "tensor"),), pieces, outputs=(6, 3))
    assert handed_slots(program) == {1: frozenset({2})}


def test_a_value_only_eager_steps_read_is_not_handed_off() -> None:
    pieces = [
        _piece([0], [1], False, direct=True),
        _piece([1], [2], False, direct=True),  # reads 1 eagerly: nothing for a graph
        _piece([2], [3], True),
    ]
    program = Program((Input("x", "tensor"),), pieces, outputs=(3,))
    assert handed_slots(program) == {1: frozenset({2})}


def test_host_tensors_and_other_values_are_copied() -> None:
    t = torch.zeros(4, 4)
    assert not can_hand_off(t)  # not on a CUDA device
    assert not can_hand_off(3)
    assert not can_hand_off(None)


def test_a_piece_that_fails_to_capture_makes_its_outputs_an_eager_steps(monkeypatch) -> None:
    """A graph after it must copy them in, as from any eager step: they are new tensors at
    every call (GPU: tests/gpu/test_compile.py, the graph after a failed piece)."""
    import types

    from torchreplay.config import GraphConfig
    from torchreplay.errors import CaptureError
    from torchreplay.pieces import capturing

    def fails(*a, **k):
        raise CaptureError("capture of 'p' failed at x.py:1: Tensor.tolist ...")

    monkeypatch.setattr(capturing, "capture", fails)
    piece = _piece([0], [1, 2], True)
    rt = types.SimpleNamespace(
        _pieces=[piece], _handoffs={}, _inputs=(Input("x", "tensor"),), _from_eager=set(),
        _alloc=None, device=torch.device("cpu"), _stream=None, pool=None, config=GraphConfig(),
        _warmed=set(), strict=False, _graphable=[True], failures={}, name="g", _putback=None)
    assert capturing.capture_piece(rt, 0, [torch.zeros(2)]) == (None, None)
    assert rt._from_eager == {1, 2} and rt._graphable == [False] and 0 in rt.failures


def test_a_step_hands_off_unless_every_value_is_small_and_copyable_by_node(monkeypatch) -> None:
    """``hands_off``: a graph copies a step's values by its own nodes only when each is at most
    NODE_BYTES and the graph can (core/io.graph_copyable); otherwise the step hands them off."""
    from torchreplay.pieces import handoff

    small, big = torch.zeros(handoff.NODE_BYTES // 4), torch.zeros(handoff.NODE_BYTES // 4 + 1)
    monkeypatch.setattr(handoff, "graph_copyable", lambda ts: True)
    assert not handoff.hands_off([small])
    assert not handoff.hands_off([small, 3])
    assert handoff.hands_off([small, big])
    assert handoff.hands_off([big])
    assert not handoff.hands_off([3, None])  # nothing a graph could read where it is: no private pool
    monkeypatch.setattr(handoff, "graph_copyable", lambda ts: False)  # no driver calls, or too many
    assert handoff.hands_off([small])
    assert not handoff.hands_off([])


def test_ways_in_counts_how_the_graphs_take_an_eager_steps_outputs_over_every_size() -> None:
    """``ways_in`` (tr.explain's line under an eager piece): per graph copy of the step's slots,
    its copy node, a handoff or a launch; a number held as captured, and other slots, not."""
    import types

    from torchreplay.pieces.entries import PieceGraph, ways_in
    from torchreplay.pieces.handoff import Handoff

    buf, handed = torch.zeros(2), Handoff.__new__(Handoff)
    # piece 0 graphed, piece 1 the eager step (writes slot 3), piece 2 reads (3, 4, 5), 4: a
    # number from the step, 5: another step's value
    reads = [(0,), (2,), (3, 4, 5)]
    small = PieceGraph(None, (), [(0, buf), (1, 7), (2, buf)], nodes={0: object()})
    large = PieceGraph(None, (), [(0, handed), (2, buf)])
    by_launch = PieceGraph(None, (), [(0, buf)])
    entries = [types.SimpleNamespace(graphs=[PieceGraph(None, (), []), None, g]) for g in (small, large, by_launch)]
    assert ways_in(entries, reads, {3, 4}) == {"node": 1, "handoff": 1, "launch": 1}
    assert ways_in(entries, reads, {5}) == {"node": 0, "handoff": 0, "launch": 2}
