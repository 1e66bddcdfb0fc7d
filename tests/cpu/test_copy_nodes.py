"""The graph's own copies into its static inputs (_compat/copy_nodes.py) without a GPU: the
node's state machine over a fake driver, and which node each kind of argument turns on or off
in ``Inputs.copy_in`` (core/io.py), with CPU tensors. The GPU tests (tests/gpu/test_copy_nodes.py)
replay real graphs."""

from __future__ import annotations

import pytest
import torch

from torchreplay._compat import copy_nodes
from torchreplay.core.args import CallArgs
from torchreplay.core.io import Inputs

CPU = torch.device("cpu")


class FakeDriver:
    """The two calls a CopyNode makes at each call, recorded; each answers ``rc`` (0: done)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.set_rc = 0
        self.enable_rc = 0

    def cuGraphExecMemcpyNodeSetParams(self, exe, node, ref, ctx):  # noqa: N802
        self.calls.append(("set", ref._obj.srcDevice, ref._obj.dstDevice))
        return self.set_rc

    def cuGraphNodeSetEnabled(self, exe, node, on):  # noqa: N802
        self.calls.append(("enable", on))
        return self.enable_rc


@pytest.fixture()
def driver(monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(copy_nodes, "_driver", [fake])
    return fake


def node(static: int = 0x1000) -> copy_nodes.CopyNode:
    params = copy_nodes._Memcpy3D()
    params.srcDevice, params.dstDevice, params.WidthInBytes = static, 0x9000, 256  # as recorded
    return copy_nodes.CopyNode(1, 2, params, 3, static)


def test_a_node_is_set_and_turned_on_once_per_new_source(driver) -> None:
    n = node()
    assert n.source == 0 and driver.calls == []  # bind hands it out off
    assert n.point(0x2000)
    assert driver.calls == [("set", 0x2000, 0x1000), ("enable", 1)]  # into the buffer, not the spare
    assert n.point(0x2000) and len(driver.calls) == 2  # the same tensor again: nothing
    assert n.point(0x3000)
    assert driver.calls[2:] == [("set", 0x3000, 0x1000)]  # on already
    n.off()
    assert driver.calls[3:] == [("enable", 0)] and n.source == 0
    n.off()
    assert len(driver.calls) == 4  # off already


def test_a_call_of_fewer_rows_copies_fewer_bytes(driver) -> None:
    """``sizes=``: the graph of 16 rows copies a call's 13 rows (the padding stays)."""
    n = node()
    assert n.width == 256
    n.point(0x2000, 208)
    assert driver.calls == [("set", 0x2000, 0x1000), ("enable", 1)]
    assert n._params.WidthInBytes == 208
    assert n.point(0x2000, 208) and len(driver.calls) == 2
    n.point(0x2000)  # the same tensor, all recorded rows: set again
    assert len(driver.calls) == 3 and n._params.WidthInBytes == 256


def test_the_buffer_itself_turns_the_node_off(driver) -> None:
    n = node(static=0x1000)
    n.point(0x2000)
    assert n.point(0x1000)  # the static buffer (or a view of all of it) holds the values
    assert driver.calls[-1] == ("enable", 0) and n.source == 0


def test_a_refused_source_leaves_the_node_off(driver) -> None:
    n = node()
    n.point(0x2000)
    driver.set_rc = 1
    assert not n.point(0x3000)
    assert driver.calls[-1] == ("enable", 0) and n.source == 0
    driver.set_rc, driver.enable_rc = 0, 1
    assert not n.point(0x4000)  # set, but could not be turned on: still off
    assert n.source == 0


def test_no_address_is_never_a_source(driver) -> None:
    """A tensor with no memory (address 0) while the node is off must not read as "pointed"
    (0 is also what an off node's source says)."""
    n = node()
    assert not n.point(0) and n.source == 0 and driver.calls == []
    n.point(0x2000)
    assert not n.point(0) and n.source == 0 and driver.calls[-1] == ("enable", 0)


def test_a_node_that_cannot_be_turned_off_stops_the_call(driver) -> None:
    n = node()
    n.point(0x2000)
    driver.enable_rc = 1
    with pytest.raises(RuntimeError, match="cannot be replayed"):
        n.off()


class FakeNode:
    """What copy_in asks of a node."""

    def __init__(self, dst: int) -> None:
        self.dst, self.source, self.log = dst, 0, []

    def point(self, ptr: int, nbytes: int = 0) -> bool:
        self.log.append(("point", ptr) if not nbytes else ("point", ptr, nbytes))
        self.source = 0 if ptr == self.dst else ptr
        return True

    def off(self) -> None:
        self.log.append("off")
        self.source = 0


def inputs_with_nodes(*samples: torch.Tensor) -> tuple[Inputs, list[FakeNode]]:
    inp = Inputs(CallArgs(lambda *a: a, samples, {}), CPU)
    nodes = [FakeNode(s.static.data_ptr()) for s in inp.tensor_slots]
    inp.attach(nodes)  # type: ignore[arg-type]
    return inp, nodes


@pytest.mark.parametrize("count", [1, 2])
def test_copy_in_points_plain_tensors_and_copies_the_rest_itself(count: int) -> None:
    inp, nodes = inputs_with_nodes(*[torch.randn(4, 8) for _ in range(count)])
    statics = list(inp.static_args)
    plain = [torch.randn(4, 8) for _ in range(count)]
    before = [s.clone() for s in statics]
    inp.copy_in(tuple(plain), {})
    for n, x, s, b in zip(nodes, plain, statics, before):
        assert n.log[-1] == ("point", x.data_ptr()) and n.source == x.data_ptr()
        assert torch.equal(s, b)  # the graph's node copies it, not the call
    others = [
        torch.randn(8, 4).t(),  # another layout of the same shape
        torch.randn(4, 8, dtype=torch.float16),  # a widening cast
        torch.complex(torch.randn(4, 8), torch.randn(4, 8)).conj().imag,  # the negative bit
    ]
    for x in others:
        args = tuple([x] + plain[1:])
        inp.copy_in(args, {})
        assert nodes[0].log[-1] == "off" and nodes[0].source == 0
        torch.testing.assert_close(statics[0], x.float(), rtol=0, atol=0)  # copied by the call
    inp.copy_in(tuple([statics[0]] + plain[1:]), {})  # the graph's own buffer
    assert nodes[0].log[-1] == "off"


def test_which_arguments_a_graph_copies_itself(monkeypatch) -> None:
    monkeypatch.setattr(copy_nodes, "available", lambda: True)

    def statics(*samples):
        return Inputs(CallArgs(lambda *a: a, samples, {}), CPU).copied_by_graph()

    assert len(statics(torch.randn(4, 8), torch.randn(3), 7)) == 2  # constants are not copied
    assert len(statics(*[torch.randn(2) for _ in range(3)])) == 3
    assert statics(*[torch.randn(2) for _ in range(4)]) == []  # four cost what a launch does
    assert statics(torch.randn(4, 8), torch.randn(2, dtype=torch.complex64)) == []  # all or none
    assert statics(torch.empty(0, 8)) == []
    monkeypatch.setattr(copy_nodes, "available", lambda: False)
    assert statics(torch.randn(4, 8)) == []


def test_which_arguments_a_size_graph_copies_itself(monkeypatch) -> None:
    """``sizes=``: arguments that vary along their first dimension (a prefix of rows) or not at
    all; one varying along another dimension leaves every copy to the call."""
    from torchreplay.sizes.routes import copy_targets

    monkeypatch.setattr(copy_nodes, "available", lambda: True)
    inp = Inputs(CallArgs(lambda *a: a, (torch.randn(16, 8), torch.randn(4), 3), {}), CPU)
    targets = copy_targets(inp, [0, None, None], 4, 16)
    assert list(targets) == [0, 1]
    assert targets[0].shape == (4, 8) and targets[0].data_ptr() == inp.slots[0].static.data_ptr()
    assert targets[1] is inp.slots[1].static
    assert copy_targets(inp, [0, None, None], 16, 16)[0] is inp.slots[0].static
    assert copy_targets(inp, [1, None, None], 4, 16) == {}


def test_a_size_route_points_its_nodes_at_the_call_rows(monkeypatch) -> None:
    """A call of 3 rows into the graph of 4: the node copies 3 rows' bytes; a widening cast
    turns it off; the rows are never copied by the call when the node took them."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_buckets import install_cpu_graphs

    import torchreplay as tr

    install_cpu_graphs(monkeypatch.setattr)
    g = tr.graph(lambda x: x * 2, torch.randn(3, 8), sizes=[2, 4])
    g(torch.randn(3, 8))  # the route of 3 rows
    route = g._routes[3]
    static = g._inputs.slots[0].static
    fake = FakeNode(static.data_ptr())
    route.nodes[0] = (fake, route.dsts[0].nbytes)
    before = static.clone()
    x = torch.randn(3, 8)
    g(x)
    assert fake.log[-1] == ("point", x.data_ptr(), 3 * 8 * 4)
    assert torch.equal(static[:3], before[:3])  # the node's rows: not copied by the call
    g(x.double().float().half())  # a widening cast: copied by the call
    assert fake.log[-1] == "off"


def test_stats_say_how_many_inputs_the_graph_copies_itself() -> None:
    from torchreplay.stats import GraphStats

    stats = GraphStats()
    assert "by itself" not in stats.explain() and stats.as_dict()["graph_copies"] == 0
    stats.graph_copies = 2
    assert "copies 2 input(s) in by itself" in stats.explain() and stats.as_dict()["graph_copies"] == 2


@pytest.mark.parametrize("count", [1, 2])
def test_tensors_of_torch_func_transforms_are_never_copied_by_address(count: int) -> None:
    """A forward-AD dual has its primal's storage: a copy by address would drop the tangent, and
    the graph would replay without it, silently. vmap's batched tensor has no storage. Both are
    left to the call's own copy, which raises what the graph turns into an eager run
    (``TransformedInput``), with one argument or several."""
    import torch.autograd.forward_ad as fw_ad

    from torchreplay.core.io import TransformedInput

    inp, nodes = inputs_with_nodes(*[torch.randn(4, 8) for _ in range(count)])
    rest = tuple(torch.randn(4, 8) for _ in range(count - 1))
    with fw_ad.dual_level():
        dual = fw_ad.make_dual(torch.randn(4, 8), torch.randn(4, 8))
        with pytest.raises(TransformedInput):
            inp.copy_in((dual, *rest), {})
    assert ("point", dual.data_ptr()) not in nodes[0].log
    with pytest.raises(TransformedInput):
        torch.func.vmap(lambda a: inp.copy_in((a, *rest), {}))(torch.randn(3, 4, 8))
    plain = torch.randn(4, 8)
    inp.copy_in((plain, *rest), {})  # and pointed again after
    assert nodes[0].log[-1] == ("point", plain.data_ptr())


def _piece_route(bufs: list[torch.Tensor], views: list[torch.Tensor]) -> tuple[object, list[FakeNode]]:
    """A compiled program's route (pieces/entries.py) whose entry's first graph copies the
    inputs ``bufs`` in itself, the call copying into ``views`` of them."""
    from torchreplay.pieces.entries import Entry, PieceGraph, Route, give_nodes

    nodes = [FakeNode(b.data_ptr()) for b in bufs]
    entry = Entry(bufs[0].shape[0])
    entry.graphs = [PieceGraph(None, (), [], inputs=dict(enumerate(nodes)))]  # type: ignore[arg-type]
    route = Route(views[0].shape[0], entry, tuple(v.shape for v in views))
    route.dsts, route.src_idx = list(views), list(range(len(views)))
    give_nodes(route)
    return route, nodes


def test_a_compiled_programs_first_graph_copies_the_call_rows_itself() -> None:
    """The piecewise runtime (compile backend): a call of 3 rows into a size of 4 points the
    first graph's node at its 3 rows' bytes, and launches no copy of its own; a tensor of
    another dtype, or one a byte copy would not keep (transposed), turns the node off and is
    copied by the call."""
    from torchreplay.pieces.entries import copy_inputs

    buf, other = torch.randn(4, 8), torch.randn(2, 2)
    route, nodes = _piece_route([buf, other], [buf.narrow(0, 0, 3), other])
    assert route.dsts == [] and [v is not None for _, _, v in route.nodes] == [True, True]
    x, y = torch.randn(3, 8), torch.randn(2, 2)
    before = buf.clone()
    copy_inputs(route, (x, y))
    assert nodes[0].log == [("point", x.data_ptr(), 3 * 8 * 4)]
    assert nodes[1].log == [("point", y.data_ptr(), 2 * 2 * 4)]
    assert torch.equal(buf, before)  # the graph copies them, not the call
    copy_inputs(route, (x, y.t()))
    assert nodes[1].log[-1] == "off" and torch.equal(other, y.t())
    copy_inputs(route, (x.double(), y))
    assert nodes[0].log[-1] == "off" and torch.equal(buf[:3], x)


def test_a_route_whose_rows_are_not_leading_bytes_keeps_the_nodes_off() -> None:
    """Rows along a later dimension are not a prefix of the buffer's bytes: that route turns
    every node of its entry off at each call (another route may have pointed them) and copies
    everything with its own launch."""
    from torchreplay.pieces.entries import copy_inputs

    buf = torch.randn(8, 4)
    route, nodes = _piece_route([buf], [buf.narrow(1, 0, 3)])
    assert [v for _, _, v in route.nodes] == [None] and len(route.dsts) == 1
    x = torch.randn(8, 3)
    copy_inputs(route, (x,))
    assert nodes[0].log == ["off"] and torch.equal(buf[:, :3], x)


def test_an_eager_steps_value_is_copied_by_the_next_graphs_node() -> None:
    """The value an eager step made (a splitting op's output) goes into the next graph's
    buffer by that graph's own node where it is a plain dense tensor of the captured layout;
    otherwise by a copy launch, the node off; another shape runs the call ungraphed."""
    from torchreplay.pieces.entries import RESHAPED, PieceGraph

    buf = torch.randn(4, 8)
    node = FakeNode(buf.data_ptr())
    graph = PieceGraph(None, (), [(0, buf)], nodes={0: node})  # type: ignore[dict-item]
    value = torch.randn(4, 8)
    before = buf.clone()
    assert graph.copy_in((5,), [None] * 5 + [value]) is None
    assert node.log == [("point", value.data_ptr())] and torch.equal(buf, before)
    odd = torch.randn(8, 4).t()
    assert graph.copy_in((0,), [odd]) is None
    assert node.log[-1] == "off" and torch.equal(buf, odd)
    assert graph.copy_in((0,), [torch.randn(2, 8)]) == RESHAPED


def test_a_breaks_outputs_go_into_the_next_segment_by_node_one_launch_or_not_at_all(monkeypatch) -> None:
    """The segment after a break (``PieceGraph.copy_in``): a new tensor goes in by the segment's
    node; those without a node in one launch for them all; a view of what the break got, at its
    buffer's address already, is not copied."""
    from torchreplay.pieces import entries
    from torchreplay.pieces.entries import PieceGraph

    launches: list[int] = []
    real = entries._copy_untracked
    monkeypatch.setattr(entries, "_copy_untracked", lambda d, s: (launches.append(len(d)), real(d, s)))
    by_node, other, third, state = torch.randn(4, 8), torch.randn(4, 8), torch.randn(2, 8), torch.randn(6, 8)
    in_place = state[:2]  # a view the break returned of what it got: read where it is
    node = FakeNode(by_node.data_ptr())
    copies = [(0, by_node), (1, other), (2, third), (3, in_place)]
    graph = PieceGraph(None, (), copies, nodes={0: node})  # type: ignore[dict-item]
    values = [torch.randn(4, 8), torch.randn(4, 8), torch.randn(2, 8), state[:2]]
    before, kept = by_node.clone(), state.clone()
    assert graph.copy_in((0, 1, 2, 3), values) is None
    assert node.log == [("point", values[0].data_ptr())] and torch.equal(by_node, before)
    assert launches == [2] and torch.equal(other, values[1]) and torch.equal(third, values[2])
    assert torch.equal(state, kept)


def test_binding_a_graphs_copies_keeps_the_spares_only_where_they_were_not_found(monkeypatch, caplog) -> None:
    """``core/capture.bind_copies``, which the first graph's input copies and a breakable
    graph's copies of a break's outputs share: found, the nodes and no spare to keep; not
    found, no node, the spares kept (each replay writes them) and one warning naming the graph;
    a graph that recorded no work, nothing."""
    import logging

    from torchreplay.core.capture import bind_copies

    statics, spares = [torch.randn(4)], [torch.empty(4)]
    monkeypatch.setattr(copy_nodes, "bind", lambda g, st, sp: ["node"])
    assert bind_copies(object(), statics, spares, "'m'") == (["node"], [])  # type: ignore[arg-type]
    assert bind_copies(None, statics, spares, "'m'") == ([], [])
    monkeypatch.setattr(copy_nodes, "bind", lambda g, st, sp: None)
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        nodes, kept = bind_copies(object(), statics, spares, "'m', the segment after break b")  # type: ignore[arg-type]
    assert nodes == [] and kept == spares
    assert "'m', the segment after break b: the graph's own copies were not found" in caplog.text
