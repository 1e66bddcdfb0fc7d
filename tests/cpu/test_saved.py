"""Which training forward graphs may replay while saved activations await their backward
(pieces/saved.py), and the sets of graphs a backward keeps per forward graph
(pieces/instances.py): the bookkeeping, on CPU tensors, without CUDA graphs."""

from __future__ import annotations

import gc

import pytest
import torch

from torchreplay.pieces.entries import Entry
from torchreplay.pieces.instances import MAX_MOVES, Instances
from torchreplay.pieces.saved import SavedActivations, guarded, saved_refs


class _Outputs:
    """Stands in for an entry's Outputs: are its saved activations still held?"""

    def __init__(self) -> None:
        self.is_held = True

    def held(self) -> bool:
        return self.is_held


def _entry(position: int, saved: SavedActivations) -> tuple[Entry, torch.Tensor]:
    """A forward entry at ``position`` whose one saved activation is the tensor returned."""
    e = Entry(None)
    e.position = position
    e.outputs = _Outputs()  # type: ignore[assignment]
    e.guard = frozenset({0})
    activation = torch.randn(4, 3)
    saved.sealed(e, [activation], [activation])
    return e, activation


def _replay(saved: SavedActivations, e: Entry) -> None:
    """``e`` replayed: autograd holds its new activations for their backward."""
    e.outputs.is_held = True  # type: ignore[union-attr]
    saved.replayed(e, tainted=False)


def _backward(saved: SavedActivations, e: Entry, args: tuple[torch.Tensor, ...]) -> None:
    """The backward of ``e``'s call replayed over ``args``; then autograd lets its activations
    go (no ``retain_graph``)."""
    saved.read(Entry(None), args)
    e.outputs.is_held = False  # type: ignore[union-attr]


def test_blocks_forward_then_backward_in_reverse_replay_every_graph() -> None:
    """Blocks 0..2 captured in that order: each forward may replay while the earlier blocks'
    activations await their backward; the backwards 2..0 consume them."""
    saved = SavedActivations()
    entries = [_entry(k, saved) for k in range(3)]
    for step in range(3):
        for e, _ in entries:
            assert not saved.blocks(e), (step, e.position)
            _replay(saved, e)
        assert saved.pending == [e for e, _ in entries]
        for e, activation in reversed(entries):
            _backward(saved, e, (torch.randn(2), activation[1:]))  # a view of it, and a tangent
        assert not any(saved.blocks(e) for e, _ in entries)


def test_a_second_forward_before_its_backward_is_blocked_while_held() -> None:
    saved = SavedActivations()
    (a, act_a), (b, _) = _entry(0, saved), _entry(1, saved)
    saved.replayed(a, tainted=False)
    assert saved.blocks(a)  # its own activations would be overwritten
    saved.replayed(b, tainted=False)
    assert saved.blocks(a)  # b's too (captured after a: a's replay may reach them)
    assert saved.blocks(b)  # b's own: held
    b.outputs.is_held = False  # b's autograd graph was freed without a backward
    assert not saved.blocks(b)
    assert saved.blocks(a)  # a's own still held
    saved.read(Entry(None), (act_a,))  # its backward ran with retain_graph=True: still held
    assert saved.blocks(a)
    a.outputs.is_held = False  # the graph let go
    assert not saved.blocks(a) and saved.pending == []


def test_a_tainted_replay_leaves_nothing_pending() -> None:
    saved = SavedActivations()
    a, _ = _entry(0, saved)
    saved.replayed(a, tainted=False)
    saved.replayed(a, tainted=True)
    assert saved.pending == [] and not saved.blocks(a)


def test_a_backward_finds_its_forward_again_after_entries_change(monkeypatch) -> None:
    """Without use counts a backward's read consumes the forward entries it read, found by
    their activations' addresses and remembered per generation: a new entry (which may take
    the addresses of a dropped one) makes the backward look again."""
    from torchreplay.pieces import saved as saved_mod

    monkeypatch.setattr(saved_mod._compat, "HAS_USE_COUNTS", False)
    saved = SavedActivations()
    a, act = _entry(0, saved)
    reader = Entry(None)
    saved.replayed(a, tainted=False)
    saved.read(reader, (act,))
    assert reader.feeds is not None and reader.feeds[1] == [a]
    saved.keep_only([])  # a dropped
    a2 = Entry(None)
    a2.position, a2.outputs, a2.guard = 1, _Outputs(), frozenset({0})  # type: ignore[assignment]
    saved.sealed(a2, [act], [act])  # its activation where a's was
    saved.replayed(a2, tainted=False)
    saved.read(reader, (act,))
    assert reader.feeds[1] == [a2] and saved.pending == []


def test_backward_sets_are_keyed_by_activations_but_watch_only_parameters() -> None:
    """A backward's sets are keyed by its parameters and saved activations; the activations are
    freed after every backward, which must not drop the set (only a replaced parameter does)."""
    weight = torch.nn.Parameter(torch.randn(3, 3))
    inst = Instances([0, 1], "backward", watched=lambda t: isinstance(t, torch.nn.Parameter))
    dropped: list[str] = []

    def drop(s, why: str) -> None:
        dropped.append(why)

    def call(act: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (weight, act, torch.randn(3))  # the third: a tangent, copied in

    def ptrs(args: tuple[torch.Tensor, ...]) -> list[int | None]:
        return [args[0].data_ptr(), args[1].data_ptr(), None]

    act1, act2 = torch.randn(3), torch.randn(3)
    first = call(act1)
    inst.add(first, ptrs(first))
    second = call(act2)
    assert inst.switch(second, ptrs(second), drop) == "new"
    saved_ptrs = ptrs(second)
    del first, second
    assert inst.switch(call(act1), ptrs(call(act1)), drop) == "found"
    keep = act2.data_ptr()
    act3 = torch.randn(5)  # made while act2 lives: another address
    del act2
    gc.collect()
    assert inst.switch(call(act3), ptrs(call(act3)), drop) == "new"
    assert dropped == [] and len(inst) == 3  # a freed activation drops nothing
    assert saved_ptrs in inst and saved_ptrs[1] == keep
    weight.data = torch.randn(3, 3)  # the parameter replaced: every set that read it goes
    act4 = torch.randn(7)  # act3 lives: another address
    assert inst.switch(call(act4), ptrs(call(act4)), drop) == "new"
    assert len(dropped) == 3 and len(inst) == 1


def test_a_backward_set_goes_once_a_forward_graph_it_reads_was_dropped() -> None:
    """Where AOT autograd passes a backward its parameters as new tensors at every call
    (detached: torch 2.13's ``aot_autograd`` does, on CPU), a backward watches no tensor of its
    sets, and a replaced parameter (``p.data = new``) would leave the old backward set and its
    graphs in place, one more at every weight swap, up to MAX_PARAM_SETS. (On the H200's torch
    2.11, through our backend, the sets went anyway: see the GPU test of weights swapped in
    during training.) A backward's set records the forward entries whose saved tensors it
    reads and goes once one of them was dropped with its graphs; while they are kept it stays,
    whatever tensors its arguments are."""
    saved = SavedActivations()
    e1, act1 = _entry(0, saved)
    e2, act2 = _entry(1, saved)
    inst = Instances([0, 1], "backward", watched=lambda t: isinstance(t, torch.nn.Parameter))
    inst.feeds = saved
    weight = torch.nn.Parameter(torch.randn(3, 3))
    dropped: list[int] = []

    def call(act: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], list[int | None]]:
        args = (weight.detach(), act, torch.randn(3))  # AOT's: a new tensor over the weight
        return args, [args[0].data_ptr(), args[1].data_ptr(), None]

    drop_set = lambda s, why: dropped.append(s.id)  # noqa: E731
    first = inst.add(*call(act1))
    assert first.refs == [] and [r() for r in first.feeds] == [e1]
    assert inst.switch(*call(act2), drop_set) == "new"
    assert inst.switch(*call(act1), drop_set) == "found" and dropped == []
    saved.keep_only([e2])  # e1 dropped with its graphs (its parameters were replaced)
    _, act3 = _entry(2, saved)
    assert inst.switch(*call(act3), drop_set) == "new"
    assert dropped == [first.id] and len(inst) == 2
    args, ptrs = call(act1)
    assert inst.find(args) is None and ptrs not in inst


def test_a_forward_entry_is_kept_until_dropped_though_a_later_one_saves_its_parameter() -> None:
    """Two forward graphs of one block (two shapes) that save only its parameter: the later
    one's record of that address replaces the first's, but the first entry is kept (a
    backward set reading it stays) until the forward drops it with its graphs."""
    import weakref

    saved = SavedActivations()
    weight = torch.randn(3, 3)
    first, second = Entry(None), Entry(None)
    saved.sealed(first, [weight], [])
    saved.sealed(second, [weight], [])
    reads_first = [weakref.ref(first)]
    assert saved.keeps(reads_first)
    saved.keep_only([first, second])
    assert saved.keeps(reads_first)
    saved.keep_only([second])
    assert not saved.keeps(reads_first) and saved.keeps([weakref.ref(second)])


def test_only_saved_activations_a_replay_writes_are_guarded() -> None:
    """A forward saves an activation in the pool, a view of its static input buffer and two
    parameters (one of them transposed): only the first two are guarded. The parameters are
    the caller's tensors, which other references hold whenever they like (the module, the
    call's arguments); guarding them blocked every forward after a forward-only call."""
    pool = torch.empty(64)
    weight, bias = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))
    buffer = torch.randn(2, 4)
    e = Entry(None)
    e.inputs = [buffer, None, None, None]  # the static input buffer; parameters are passed
    outs = [pool[:8].view(2, 4), buffer.view(8), weight.t(), bias, torch.randn(3)]
    e.sources = [("input", 0)] + [("pool", k) for k in range(len(outs))]
    in_pool = lambda t: t.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()  # noqa: E731
    refs = saved_refs(e, frozenset(range(1, 5)))  # program outputs 1..4: what the forward saves
    assert refs == [0, 1, 2, 3]
    assert guarded(e, outs, refs, in_pool) == {0, 1}
    assert guarded(e, outs, [], in_pool) == frozenset()


@pytest.mark.parametrize("use_counts", [True, False])
def test_a_backward_consumes_only_the_forward_whose_activations_it_read(monkeypatch, use_counts) -> None:
    """One block at two shapes: both forward graphs save the same weight. The backward of the
    second reads the weight and its own activation: it consumes that forward only, so the
    first's activations still await their backward (a forward of the first shape stays
    blocked while they are held). The weight stays put for a backward all the same. With
    use counts, autograd letting the second's activations go is what releases them; without,
    the read, by the activations' addresses (not the weight's)."""
    from torchreplay.pieces import saved as saved_mod

    monkeypatch.setattr(saved_mod._compat, "HAS_USE_COUNTS", use_counts)
    saved = SavedActivations()
    weight = torch.nn.Parameter(torch.randn(4, 4))
    (a, act_a), (b, act_b) = _entry(0, saved), _entry(1, saved)
    for e, act in ((a, act_a), (b, act_b)):
        saved.sealed(e, [act, weight], [act])
    saved.replayed(a, tainted=False)
    saved.replayed(b, tainted=False)
    _backward(saved, b, (act_b, weight, torch.randn(4)))
    assert saved.blocks(a) and not saved.blocks(b) and saved.pending == [a]
    assert saved.holds(weight) and saved.holds(act_a) and not saved.holds(torch.randn(4))


def _params_call(params: list[torch.nn.Parameter]) -> tuple[tuple[torch.Tensor, ...], list[int | None]]:
    """A call's args (the parameters, read in place, then an input copied in) and their ptrs."""
    args = (*params, torch.randn(3))
    return args, [p.data_ptr() for p in params] + [None]


def test_a_set_whose_parameters_were_freed_waits_until_its_outputs_are_let_go() -> None:
    """FSDP frees a block's unsharded parameters right after its forward, while that forward's
    output is the next block's input: the set is not used again, but its graphs (and the
    outputs they handed out) go only once nothing holds those outputs."""
    block0 = [torch.nn.Parameter(torch.randn(3, 3))]
    block1 = [torch.nn.Parameter(torch.randn(3, 3))]
    inst = Instances([0], "fwd")
    dropped: list[int] = []
    holding = {0}  # the ids of the sets whose outputs are held
    drop = lambda s, why: dropped.append(s.id)  # noqa: E731
    held = lambda s: s.id in holding  # noqa: E731
    args, ptrs = _params_call(block0)
    first = inst.add(args, ptrs)
    block0[0].untyped_storage().resize_(0)  # resharded: its memory freed (data_ptr() raises)
    args, ptrs = _params_call(block1)
    assert inst.switch(args, ptrs, drop, held) == "new"
    assert dropped == [] and inst.pending == [first] and len(inst) == 1
    holding.clear()  # the backward ran: block 0's output is let go
    block1[0].data = torch.randn(3, 3)
    args, ptrs = _params_call(block1)
    assert inst.switch(args, ptrs, drop, held) == "new"
    assert sorted(dropped) == [0, 1] and inst.pending == []


def _instances_of(params: list[torch.nn.Parameter]) -> Instances:
    """The instances of one forward graph, with a first set captured over ``params``."""
    inst = Instances([0], "fwd")
    inst.add(*_params_call(params))
    return inst


def drop(s: object, why: str) -> None:  # what the runtime passes to drop a set's graphs
    pass


def _moved_call(params: list[torch.nn.Parameter], keep: list[torch.Tensor]) -> tuple:
    """Move the first parameter by ``p.data = new`` (its old memory kept taken, so the address
    is new each time) and return the call's ``(args, ptrs)``."""
    keep.append(params[0].data)
    params[0].data = torch.randn(3, 3)
    return _params_call(params)


def test_parameters_that_keep_moving_are_no_longer_captured() -> None:
    """A parameter found at another address MAX_MOVES times (FSDP's resharding reallocates
    it around every call): its calls are "moving" (run without graphs) from then on, while
    another instance whose parameters stay put is still captured and found."""
    moving = [torch.nn.Parameter(torch.randn(3, 3))]
    steady = [torch.nn.Parameter(torch.randn(3, 3))]
    inst = _instances_of(steady)
    outcomes = []
    keep = []
    for _ in range(MAX_MOVES + 2):
        outcomes.append(inst.switch(*_moved_call(moving, keep), drop))
    assert outcomes == ["new"] * MAX_MOVES + ["moving"] * 2
    assert inst.current is None  # the runtime's fast path must not find a dropped set's graphs
    args, ptrs = _params_call(steady)
    assert inst.switch(args, ptrs, drop) == "found"
    other = [torch.nn.Parameter(torch.randn(3, 3))]
    args, ptrs = _params_call(other)
    assert inst.switch(args, ptrs, drop) == "new"


def test_weights_swapped_in_now_and_then_keep_being_captured() -> None:
    """``p.data = new`` between runs of replays (a reload, an RL weight sync): each move after
    graphs that replayed starts the count again, so the set is captured anew every time, never
    "moving"; once moves come at every call (the new set's graphs never replay), MAX_MOVES of
    them in a row stop the captures."""
    weights = [torch.nn.Parameter(torch.randn(3, 3))]
    inst = _instances_of(weights)
    keep = []
    for _ in range(3 * MAX_MOVES):
        # the old set replayed
        assert inst.switch(*_moved_call(weights, keep), drop, replayed=True) == "new"
    outcomes = []
    for _ in range(MAX_MOVES + 1):
        outcomes.append(inst.switch(*_moved_call(weights, keep), drop, replayed=False))
    assert outcomes == ["new"] * (MAX_MOVES - 1) + ["moving"] * 2


def test_a_set_replayed_by_another_blocks_parameters_does_not_keep_its_own_captured() -> None:
    """FSDP2 with ``reshard_after_forward=True`` on two H200s: block 1's unsharded parameters
    are allocated where block 0's were just freed, so block 1's call finds block 0's set (same
    addresses) and replays its graphs, correctly. That replay is not block 0's tensors paying
    off: before, it marked the set as replayed, each move of block 0's parameters then started
    their count again, and block 0 was captured anew at every step, for good (the GPU test
    ``test_fsdp2_blocks_compiled_one_by_one_equal_eager[True]``: +2 captures a step). Now block
    0 runs "moving" after MAX_MOVES steps, and the captures stop. (This is the sets' half;
    the runtime's fast path must switch to tell the set, which it did not do while the
    addresses stayed: ``test_runtime_copies.py``'s test of blocks gathered at each other's
    addresses runs the whole path.)"""
    block0 = [torch.nn.Parameter(torch.randn(3, 3))]
    block1 = [torch.nn.Parameter(torch.randn(3, 3))]
    inst = _instances_of([torch.nn.Parameter(torch.randn(3, 3))])  # a first set, elsewhere
    slabs = [torch.randn(3, 3) for _ in range(4 * MAX_MOVES + 8)]  # each step's memory
    outcomes: list[tuple[str, str]] = []
    # replayed=: did the current set's graphs replay in a call after the one that captured
    # them (the runtime's test)? Only after a "found" call.
    second = "new"
    for step in range(2 * MAX_MOVES + 6):
        block0[0].data = slabs[step]  # unsharded for its forward
        first = inst.switch(*_params_call(block0), drop, replayed=second == "found")
        block0[0].data = torch.empty(0)  # resharded: freed
        block1[0].data = slabs[step]  # unsharded where block 0's were
        second = inst.switch(*_params_call(block1), drop, replayed=first == "found")
        block1[0].data = torch.empty(0)
        outcomes.append((first, second))
    assert outcomes[0] == ("new", "found"), outcomes
    assert all(o == ("moving", "moving") for o in outcomes[-4:]), outcomes


def test_find_is_a_switch_to_the_calls_own_tensors_at_their_addresses_only() -> None:
    """``Instances.find``, the runtime's quick look-up when the current set is not the call's
    (keyed by the first address read in place; the common case: the blocks of a model compiled
    block by block share one runtime). It finds the set of the call's own tensors at their
    addresses, makes it current and most recently used; it finds nothing where ``switch`` must
    look further: other tensors at a set's addresses (FSDP2, where the set must learn those
    replays are not its own), a moved parameter, a set dropped as gone."""
    blocks = [[torch.nn.Parameter(torch.randn(3, 3)), torch.nn.Parameter(torch.randn(3))] for _ in range(3)]
    inst = Instances([0, 1], "fwd")
    sets = [inst.add(*_params_call(b)) for b in blocks]
    for k in (1, 0, 2, 2, 1):
        args, _ = _params_call(blocks[k])
        assert inst.find(args) is sets[k] and inst.current is sets[k] and sets[k].own
        assert list(inst.sets.values())[-1] is sets[k] and inst.unchanged(args)
    other = [blocks[0][0].detach(), blocks[0][1].detach()]  # other tensors, block 0's memory
    args, ptrs = _params_call(other)
    assert inst.find(args) is None and inst.current is sets[1]
    assert inst.switch(args, ptrs, drop) == "found" and not sets[0].own
    keep: list[torch.Tensor] = []
    args, ptrs = _moved_call(blocks[1], keep)
    assert inst.find(args) is None
    assert inst.switch(args, ptrs, drop) == "new" and sets[1] not in inst.sets.values()
    blocks[1][0].data = keep[-1]  # back where the dropped set had it: still not found
    args, _ = _params_call(blocks[1])
    assert inst.find(args) is None
    args, _ = _params_call(blocks[2])
    assert inst.find(args) is sets[2]
    keep.append(blocks[2][1].data)
    blocks[2][1].data = torch.randn(3)  # a parameter but the first moved: the same key
    args, _ = _params_call(blocks[2])
    assert inst.find(args) is None


def test_a_parameter_a_graph_returns_is_the_calls_own_not_the_captures() -> None:
    """entries.set_sources, given what the runtime maps (copied-in buffers and, since FSDP,
    inputs read in place): a forward graph that returns a parameter it read in place (AOT saves
    it for the backward) hands out the call's argument, not the tensor object of the capture:
    FSDP gathers a parameter again at the same address into another tensor. Its own
    activations come from the pool, a copied-in input's buffer is that input, and a slot no
    graph wrote comes from the call's slots."""
    from torchreplay.pieces.entries import set_sources
    from torchreplay.pieces.program import Constant, Input, Piece, Program

    program = Program(
        inputs=(Input("x", "tensor"), Input("weight", "static")),
        pieces=[
            Piece(lambda x, w: (x @ w, w, x), (0, 1), (2, 3, 4), True, "piece 0"),
            Piece(lambda h: (h.sum(),), (2,), (5,), False, "piece 1"),
        ],
        outputs=(2, 3, 4, 5, 1, Constant(7)),
    )
    buffer, weight = torch.randn(2, 3), torch.nn.Parameter(torch.randn(3, 3))
    activation = buffer @ weight
    env = [buffer, weight, activation, weight, buffer, activation.sum()]
    inputs = {id(buffer): 0, id(weight): 1}  # a copied-in buffer, an input read in place
    entry = Entry(None)
    pool_outs = set_sources(entry, program, env, {2, 3, 4}, inputs)
    assert entry.sources == [
        ("pool", 0), ("input", 1), ("input", 0), ("env", 5), ("input", 1), ("const", 7),
    ]
    assert len(pool_outs) == 1 and pool_outs[0] is activation


def test_the_addresses_explain_matches_a_module_by_are_those_of_live_tensors_only() -> None:
    """``tr.explain(torch.compile(model, backend="torchreplay"))`` finds the model's graphs by
    the addresses of its parameters. A dropped model's graphs live on in Dynamo's cache, and the
    allocator hands its memory to the next model: its graphs were listed as the new model's
    (found on the GPU when the by-name test ran before the explain test)."""
    inst = Instances([0], "fwd")
    old = torch.nn.Parameter(torch.randn(4))
    inst.add((old,), [old.data_ptr()])
    at = old.data_ptr()
    assert inst.live() == {at}
    del old
    gc.collect()
    assert inst.live() == set()


def test_a_copy_captured_later_replays_while_the_first_calls_activations_are_held() -> None:
    """``model(a) + model(b)``: the second call's graph ``a`` would overwrite what the first
    call left for its backward, so the runtime captures a copy, later in the pool, whose replay
    cannot reach it; at the next step both replay again, and a third call needs a third copy."""
    saved = SavedActivations()
    (a, act_a), (copy, act_copy) = _entry(0, saved), _entry(1, saved)
    saved.replayed(a, tainted=False)  # model(a)
    assert saved.blocks(a) and not saved.blocks(copy)
    saved.replayed(copy, tainted=False)  # model(b), through the copy
    assert saved.blocks(copy)  # a third call needs a third copy
    assert not saved.blocks(_entry(2, saved)[0])
    for e, activation in ((copy, act_copy), (a, act_a)):  # the backwards, in reverse
        _backward(saved, e, (activation,))
    assert not saved.blocks(a) and saved.pending == []


def test_a_copys_key_keeps_the_parameter_sets_id_last() -> None:
    """A copy's entry is told from the graph's by its key, and dropped with its set of
    parameters (the set's id is the last item of every key of that set)."""
    from types import SimpleNamespace

    from torchreplay.pieces.instances import drop_entries
    from torchreplay.pieces.program import Input
    from torchreplay.pieces.runtime import PiecewiseRuntime

    inputs = [Input("x", "tensor"), Input("w", "static")]
    rt = SimpleNamespace(_inputs=inputs, _tensors=[0], _instances=SimpleNamespace(current=SimpleNamespace(id=7)))
    args = (torch.randn(8, 4), torch.randn(4, 4))
    key, first_copy = PiecewiseRuntime._key(rt, None, args), PiecewiseRuntime._key(rt, None, args, 1)
    assert key != first_copy != PiecewiseRuntime._key(rt, None, args, 2)
    assert key[-1] == first_copy[-1] == 7
    counted = SimpleNamespace(_entries={key: 0, first_copy: 0, PiecewiseRuntime._key(rt, None, args, 2): 0})
    assert PiecewiseRuntime.copies.fget(counted) == 2  # (tr.explain says how many)
    entries = {key: Entry(None), first_copy: Entry(None), (*key[:-1], 8): Entry(None)}
    drop_entries(entries, [], 7, "dropped")
    assert list(entries) == [(*key[:-1], 8)]
