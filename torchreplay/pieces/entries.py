"""What the piecewise runtime keeps per captured key and per call size (internal)."""

from __future__ import annotations

from typing import Any, Callable, Container, Iterable, Sequence

import torch

from torchreplay import _compat
from torchreplay._compat.copy_nodes import CopyNode
from torchreplay.core.io import point_or_off
from torchreplay.core.outputs import Outputs
from torchreplay.pieces.handoff import MOVED, Expanded, Handoff, fill_expanded
from torchreplay.pieces.program import Constant, Input, Program

__all__ = [
    "PieceGraph", "Entry", "Route", "hand_out", "entry_key", "pad_shared", "shared_key", "static_buffer",
    "stage_entry", "hold_weakly", "set_sources", "buffer_like", "shares_rows", "copy_expanded", "NOT_EXPANDED",
    "retire_outputs", "give_nodes", "copy_inputs", "ways_in", "make_route",
]

_Tensor = torch.Tensor
_copy_untracked = _compat.foreach_copy_untracked


class PieceGraph:
    """One graphed piece at one key: its graph, the outputs it leaves in the pool, and the
    inputs (made by eager steps) it copies into buffers of its own, or, for a number an eager
    step made (an ``.item()``), the value the graph holds (another value cannot replay); and
    ``backs``: those of its buffers the graph writes in place, copied back after each replay."""

    __slots__ = ("graph", "replay", "out", "copies", "backs", "nodes", "inputs", "spares")

    def __init__(
        self,
        graph: Any,
        out: Sequence[Any],
        copies: list[tuple[int, Any]],
        backs: Sequence[tuple[int, torch.Tensor]] = (),
        nodes: dict[int, CopyNode] | None = None,
        inputs: dict[int, CopyNode] | None = None,
        spares: Sequence[torch.Tensor] = (),
    ):
        self.graph = graph
        self.replay = _compat.direct_replay(graph) if graph is not None else _nothing  # None: recorded no work
        self.out = tuple(out)
        self.copies = copies
        self.backs = tuple(backs)
        #: per position in ``copies``: the graph's own copy into that buffer (_compat/copy_nodes.py),
        #: pointed at each call's value instead of a copy launch
        self.nodes = nodes or {}
        #: the first piece's: per program input, the graph's own copy into its static buffer
        #: (pointed by the call's :class:`Route`: :func:`copy_inputs`)
        self.inputs = inputs or {}
        self.spares = tuple(spares)  # (copies recorded but not found: written at every replay)

    def copy_in(self, reads: tuple[int, ...], env: list[Any]) -> str | None:
        """Copy the values eager steps made into the graph's own buffers, or check that a
        handed-off one is where the graph reads it (:mod:`.handoff`); ``None`` when the graph
        can replay, else why not: a value of another shape or dtype (or, for a number,
        another value) than at capture, or a handed-off value that cannot be put back."""
        dsts: list[_Tensor] = []
        srcs: list[_Tensor] = []
        for pos, buf in self.copies:
            value = env[reads[pos]]
            if type(buf) is Handoff:
                if not buf.at(value):
                    moved = buf.refill(value)
                    if moved is None:
                        same = isinstance(value, _Tensor) and value.shape == buf.shape and value.dtype == buf.dtype
                        return MOVED if same else RESHAPED
                    env[reads[pos]] = moved  # alive until its last reader replayed
            elif type(buf) is Expanded:
                if not buf.fill(value):
                    return RESHAPED
            elif not isinstance(buf, _Tensor):  # a number the graph holds as captured
                if value != buf:
                    return RESHAPED
            elif value.shape != buf.shape or value.dtype != buf.dtype:
                return RESHAPED
            else:
                node = self.nodes.get(pos) if self.nodes else None
                if (node is None or not point_or_off(node, value)) and value.data_ptr() != buf.data_ptr():
                    dsts.append(buf)  # (else the graph copies it, or it is there: a break's
                    srcs.append(value)  # output over memory the break got)
        if dsts:  # one launch for them all, not recorded by autograd
            _copy_untracked(dsts, srcs)
        return None


def ways_in(entries: Iterable[Entry], reads: Sequence[tuple[int, ...]], slots: Container[int]) -> dict[str, int]:
    """How the graphs of ``entries`` (piece ``j`` reads ``reads[j]``) take in the values in
    ``slots`` (an eager step's outputs), counted over every size: ``"node"`` (the graph's own
    copy node), ``"handoff"`` (read where the step made it), ``"launch"`` (one copy launch)."""
    ways = {"node": 0, "handoff": 0, "launch": 0}
    for entry in entries:
        for j, graph in enumerate(entry.graphs):
            for pos, buf in getattr(graph, "copies", None) or ():
                if reads[j][pos] not in slots or isinstance(buf, (int, float, bool)):
                    continue  # (a number: held as captured)
                way = "handoff" if type(buf) is Handoff else "node" if pos in graph.nodes else "launch"
                ways[way] += 1
    return ways


#: Why a call runs ungraphed from a graph whose input made by an eager step changed shape.
RESHAPED = (
    "an input made by an eager step has another shape (or, for a number, another value) than "
    "at capture"
)


def _nothing() -> None:
    return None


class Entry:
    """Everything captured for one key (one padded size and the other input shapes)."""

    __slots__ = (
        "size", "graphs", "sources", "outputs", "position", "inputs", "guard", "steps",
        "feeds", "__weakref__",
    )

    def __init__(self, size: int | None) -> None:
        self.size = size
        self.graphs: list[PieceGraph | None] = []
        #: per program output: ("pool", k) | ("env", slot) | ("input", i) | ("const", value)
        self.sources: list[tuple[str, Any]] = []
        self.outputs: Outputs | None = None
        self.position = -1
        #: the initial slot values of the inputs (static buffers, sizes); args fill the rest
        self.inputs: list[Any] = []
        #: the pool outputs (indices into what Outputs hands out) that must be free to replay
        self.guard: frozenset[int] = frozenset()
        #: per piece: (graph or None, fn, reads, writes, slots last read there, index)
        self.steps: list[tuple[Any, ...]] = []
        #: a backward's: (generation, the forward entries whose saved activations it reads)
        self.feeds: tuple[int, list[Entry]] | None = None

    def invalidate_outputs(self) -> None:
        if self.outputs is not None:
            self.outputs.invalidate()


class Route:
    """A call of ``n`` rows with given input shapes: its entry and the views it copies into."""

    __slots__ = (
        "n", "entry", "shapes", "dsts", "src_idx", "expanded", "pads", "fills", "bases", "backs", "back_idx",
        "consts", "nodes",
    )

    def __init__(self, n: int | None, entry: Entry, shapes: tuple[Any, ...]) -> None:
        self.n = n
        self.entry = entry
        self.shapes = shapes
        self.dsts: list[_Tensor] = []
        self.src_idx: list[int] = []
        #: buffers with expanded dimensions (stride 0), held once: (buffer narrowed to one
        #: element there, input index, those dimensions)
        self.expanded: list[tuple[_Tensor, int, tuple[int, ...]]] = []
        self.pads: list[_Tensor] = []
        #: padding rows filled with another value than 0: (view, value)
        self.fills: list[tuple[_Tensor, Any]] = []
        #: the buffers every size shares, and their padding values (padded only where an
        #: earlier call left rows: ``PiecewiseRuntime._pad_shared``); ``pads`` has the others
        self.bases: list[tuple[_Tensor, Any]] = []
        self.backs: list[_Tensor] = []
        self.back_idx: list[int] = []
        #: the values of the keyed non-tensor inputs (ints other than the size, constants)
        self.consts: list[Any] = []
        #: the entry's first graph's copies of the inputs (:func:`give_nodes`): (node, input
        #: index, the view it fills, or None: this route copies with a launch, the node off)
        self.nodes: list[tuple[CopyNode, int, _Tensor | None]] = []


def make_route(
    n: int | None, size: int | None, entry: Entry, args: Sequence[Any], inputs: Sequence[Input],
    tensors: Sequence[int], keyed: Sequence[int], buffers: dict[Any, _Tensor], sizes: Sequence[int] | None,
) -> Route:
    """The route of a call of ``n`` rows (``size``: its entry's) with ``args``' shapes: the
    views of ``entry``'s static buffers it copies into (its rows), the padding it zeroes or
    fills, the shared buffers it pads, the views it copies back, and its nodes (:func:`give_nodes`)."""
    route = Route(n, entry, tuple(args[i].shape for i in tensors))
    route.consts = [args[i] for i in keyed]
    for i in tensors:
        buf = entry.inputs[i]
        d = inputs[i].dim
        view = buf if d is None or n == size else buf.narrow(d, 0, n)
        expanded = _compat.expanded_dims(view)
        if expanded:  # (a copy cannot write it whole: once per location)
            route.expanded.append((_compat.unexpanded(view), i, expanded))
        else:
            route.dsts.append(view)
            route.src_idx.append(i)
        base = buffers.get(shared_key(i, args[i], sizes)) if d == 0 and sizes else None
        if base is not None:
            route.bases.append((base, inputs[i].fill))
        elif d is not None and n != size and d not in _compat.expanded_dims(buf):  # (else one row)
            route.pads.append(buf.narrow(d, n, size - n))
            if inputs[i].fill != 0:
                route.fills.append((route.pads[-1], inputs[i].fill))
        if inputs[i].written:
            route.backs.append(view)
            route.back_idx.append(i)
    give_nodes(route)
    return route


def give_nodes(route: Route) -> None:
    """Let ``route`` copy its inputs by its entry's first graph's own nodes (``PieceGraph.inputs``)
    where each view it copies into is the leading bytes of the node's buffer (its rows of a
    size's buffer along the first dimension, or the whole); where one is not, every node stays
    off for this route and its launch copies them all."""
    first = route.entry.graphs[0] if route.entry.graphs else None
    if first is None or not first.inputs:
        return
    views = dict(zip(route.src_idx, route.dsts))
    nodes = [(node, i, views.get(i)) for i, node in first.inputs.items()]
    if len(nodes) == len(views) and all(
        v is not None and v.is_contiguous() and v.data_ptr() == node.dst for node, _, v in nodes
    ):
        route.nodes, route.dsts, route.src_idx = nodes, [], []
    else:
        route.nodes = [(node, i, None) for node, i, _ in nodes]


def copy_inputs(route: Route, args: Sequence[Any]) -> None:
    """Copy the call's tensors into the entry's static buffers: by the first graph's own nodes,
    each pointed at its tensor (or off: copied here), the rest with one launch. Every node is
    pointed or off before the graph's launch (a node left on reads an older call's tensor)."""
    dsts, srcs = route.dsts, [args[i] for i in route.src_idx]
    for node, i, view in route.nodes:
        a = args[i]
        if view is None:
            node.off()
        elif (
            a.dtype is not view.dtype or a.get_device() != view.get_device()  # (a byte copy)
            or not point_or_off(node, a, view.nbytes)  # (checks the type, layout and flags)
        ):
            node.off()
            dsts = [*dsts, view]
            srcs.append(a)
    if dsts:
        _copy_untracked(dsts, srcs)


#: Why a call runs ungraphed whose input is not expanded where it was at capture
NOT_EXPANDED = "is not expanded (stride 0) where it was at capture: its elements there may differ"


def copy_expanded(route: Route, args: Sequence[Any]) -> int | None:
    """Copy the inputs whose buffers are expanded (``route.expanded``), each location once;
    the index of one that is not expanded there now (nothing replays: the graph reads one of
    its elements where they may differ), else None."""
    for held, i, dims in route.expanded:
        if not fill_expanded(held, dims, args[i]):
            return i
    return None


def shared_key(i: int, arg: _Tensor, sizes: Sequence[int]) -> tuple[Any, ...]:
    """The key of input ``i``'s buffer that every size shares: dimension 0 at the largest size
    (a size's buffer is its leading rows)."""
    return (i, (sizes[-1], *arg.shape[1:]), arg.dtype)


def static_buffer(
    buffers: dict[tuple[Any, ...], _Tensor],
    i: int,
    size: int | None,
    arg: _Tensor,
    dim: int | None,
    sizes: Sequence[int] | None,
) -> _Tensor:
    """The static input buffer of input ``i`` (like ``arg``, padded along ``dim``) at ``size``
    rows, laid out as ``arg`` (:func:`buffer_like`): along dimension 0 with ``sizes``, a view
    of the one buffer every size shares (made in ``buffers`` on first use; only where rows are
    the outermost dimension, so that each size's view has the strides of a tensor of its
    rows); else a buffer of its own."""
    with _compat.normal_tensors():  # calls copy into it under torch.inference_mode or not
        if dim == 0 and sizes and shares_rows(arg):
            key = shared_key(i, arg, sizes)
            base = buffers.get(key)
            if base is None:
                base = buffers[key] = buffer_like(arg, key[1])
            return base.narrow(0, 0, size)  # type: ignore[arg-type]
        if dim is None:  # the very strides (of a slice too)
            return torch.empty_strided(arg.shape, arg.stride(), dtype=arg.dtype, device=arg.device).zero_()
        shape = list(arg.shape)
        shape[dim] = size
        return buffer_like(arg, shape)


def buffer_like(arg: _Tensor, shape: Sequence[int]) -> _Tensor:
    """Zeros of ``shape`` laid out as ``arg``: its dimensions ordered as its strides order them
    (a transposed input stays transposed) and its expanded dimensions expanded (held once).
    Inductor's code asserts the strides of each input it was compiled for ("expected size
    16==16, stride 16==1"), so a copy must keep them."""
    expanded = _compat.expanded_dims(arg)
    order = sorted(range(arg.dim()), key=lambda d: -arg.stride(d))  # (stable: ties keep their order)
    held = torch.zeros(
        [1 if d in expanded else shape[d] for d in order], dtype=arg.dtype, device=arg.device
    ).permute(sorted(range(arg.dim()), key=order.__getitem__))
    return held.expand(*shape) if expanded else held


def shares_rows(arg: _Tensor) -> bool:
    """Can ``arg``'s buffer be the leading rows of one every size shares? Its rows (dimension
    0) must be its outermost dimension, and not expanded."""
    return arg.dim() > 0 and 0 not in _compat.expanded_dims(arg) and all(
        arg.stride(0) >= s for d, s in enumerate(arg.stride()) if arg.size(d) > 1
    )


def stage_entry(
    size: int | None,
    args: Sequence[Any],
    inputs: Sequence[Any],
    buffers: dict[tuple[Any, ...], _Tensor],
    sizes: Sequence[int] | None,
    n_slots: int,
    passed: Sequence[int],
) -> tuple[Entry, list[Any]]:
    """A new entry of ``size`` with its static input buffers (in ``buffers``) filled from the
    call's ``args``, and the slot values a capture starts from. ``inputs``: the program's;
    ``passed``: the inputs taken from each call as they are."""
    entry = Entry(size)
    env: list[Any] = [None] * n_slots
    for i, inp in enumerate(inputs):
        a = args[i]
        if inp.kind == "tensor":
            buf = static_buffer(buffers, i, size, a, inp.dim, sizes)
            rows = a.shape[inp.dim] if inp.dim is not None else None
            with torch.no_grad():
                if rows is None:
                    _compat.copy_back(buf, a)
                else:  # the call's rows, as many as fit: realistic values for eager steps
                    m = min(rows, buf.shape[inp.dim])
                    _compat.copy_back(buf.narrow(inp.dim, 0, m), a.narrow(inp.dim, 0, m))
                    if inp.dim not in _compat.expanded_dims(buf):  # (else its rows are one)
                        buf.narrow(inp.dim, m, buf.shape[inp.dim] - m).fill_(inp.fill)
            env[i] = buf
        elif inp.kind == "int" and inp.is_size:
            env[i] = size
        else:
            env[i] = a
    entry.inputs = [None if i in passed else env[i] for i in range(len(inputs))]
    entry.inputs += [None] * (n_slots - len(entry.inputs))
    return entry, env


def pad_shared(route: Route, clean: dict[int, int], writes_varying: bool) -> None:
    """Make the padding rows of the buffers every size shares (``route.bases``) hold their
    padding value where an earlier call may have left rows of its own (only then: a run of calls
    of the same rows pads once), and note in ``clean`` (per buffer, by id: from which row on it
    holds the padding value; missing: nothing is known) what holds after this call.
    ``writes_varying``: the program writes those inputs in place, so a replay dirties its rows."""
    n, size = route.n, route.entry.size
    assert n is not None and size is not None
    for base, fill in route.bases:
        key = id(base)
        c = clean.get(key, base.shape[0])
        if n >= c:
            c = n
        elif n < size:  # rows [n, c) may hold an earlier call's: reset them all
            rows = base.narrow(0, n, c - n)
            if fill == 0:
                rows.zero_()
            else:
                rows.fill_(fill)
            c = n
        clean[key] = max(c, size) if writes_varying else c


def set_sources(
    entry: Entry, program: Program, env: list[Any], graphed: set[int], inputs: dict[int, int]
) -> list[torch.Tensor]:
    """Where each program output of ``entry`` comes from at a replay (``entry.sources``), from
    the slot values ``env`` of its capture: ``graphed``, the slots graphs write; ``inputs``,
    ``id(tensor) -> input index`` of the inputs whose tensor a graph may return as an output.
    Returns the pool outputs, in the order the sources index them."""
    pool_outs: list[torch.Tensor] = []
    n_inputs = len(program.inputs)
    for o in program.outputs:
        if isinstance(o, Constant):
            entry.sources.append(("const", o.value))
        elif o < n_inputs:
            entry.sources.append(("input", o))
        elif o in graphed and isinstance(env[o], torch.Tensor):
            if id(env[o]) in inputs:
                entry.sources.append(("input", inputs[id(env[o])]))
            else:
                entry.sources.append(("pool", len(pool_outs)))
                pool_outs.append(env[o])
        else:
            entry.sources.append(("env", o))
    return pool_outs


def hand_out(
    entry: Entry,
    env: list[Any],
    args: tuple[Any, ...],
    program: Program,
    n: int | None,
    tainted: bool,
    in_pool: Callable[[_Tensor], bool],
) -> tuple[Any, ...]:
    """The outputs of a replay of ``entry``: pool outputs through the output policy (clones for
    a tainted call, whose graphs' outputs the next call would overwrite), sliced to the call's
    ``n`` rows where the program says which dimension has them."""
    handed = entry.outputs.emit() if entry.outputs is not None and not tainted else None
    out: list[Any] = []
    dims = program.output_dims
    for k, (kind, ref) in enumerate(entry.sources):
        if kind == "pool":
            if handed is not None:
                value = handed[ref]
            else:
                value = env[program.outputs[k]]  # type: ignore[index]
                if isinstance(value, _Tensor) and in_pool(value):
                    value = _compat.clone_strided(value)  # (Inductor's padded strides too)
        elif kind == "env":
            value = env[ref]
        elif kind == "input":
            value = args[ref]
        else:
            value = ref
        d = dims[k]
        if n is not None and d is not None and isinstance(value, _Tensor) and kind != "input":
            # (clamped: the leading rows of a fixed-size buffer, buf[:n], may have fewer)
            value = value.narrow(d, 0, min(n, value.shape[d]))
        out.append(value)
    return tuple(out)


_HASHABLE = (int, float, bool, str, type(None), torch.dtype, torch.device)


def entry_key(
    size: int | None, args: Sequence[Any], inputs: Sequence[Any], tensors: Sequence[int]
) -> tuple[Any, ...]:
    """What tells one captured entry from another: the size, each tensor's shape (at that
    size) and dtype, ints other than the size, and constants a graph may hold."""
    key: list[Any] = [size]
    for i in tensors:
        shape = list(args[i].shape)
        d = inputs[i].dim
        if d is not None:
            shape[d] = size
        key.append((tuple(shape), args[i].dtype))
    for i, x in enumerate(inputs):
        if x.kind == "int" and not x.is_size:
            key.append(args[i])
        elif x.kind == "other":  # a constant a graph may hold: another value, another key
            key.append(args[i] if isinstance(args[i], _HASHABLE) else id(args[i]))
    return tuple(key)


def hold_weakly(entry: Entry, pool_outs: list[_Tensor], in_pool: Callable[[_Tensor], bool]) -> None:
    """Hold the outputs of ``entry``'s graphs that lie in the pool through tensors that do not
    keep their memory allocated (``pool_outs`` too, in place), so that later captures in the
    pool may use that memory. Only for outputs copied out at every replay (``outputs="clone"``:
    a backward's gradients): nothing reads them after the call, and every replay writes them
    again before they are read. Without this, a backward with graphs per module instance would
    keep every instance's gradients in its pool, on top of the ``.grad`` tensors."""
    weak: dict[int, _Tensor] = {}

    def held(t: Any) -> Any:
        if not isinstance(t, _Tensor) or not in_pool(t):
            return t
        if id(t) not in weak:
            weak[id(t)] = _compat.weak_alias(t)
        return weak[id(t)]

    for graph in entry.graphs:
        if graph is not None:
            graph.out = tuple(held(t) for t in graph.out)
    pool_outs[:] = [held(t) for t in pool_outs]


def retire_outputs(entries: dict[tuple[Any, ...], Entry]) -> None:
    """A runtime is being destroyed (or its graphs released): the outputs its ``entries``
    handed out raise when read, and the entries let go of the tensors they hold in the pool
    (graph outputs, their copies of eager steps' outputs), so that the pool's blocks are free
    when the pool's finalizer empties the cache right after this; the runtime's own attributes
    go only later. (A function of the entries, not a runtime's method: the pool's finalizer
    holds it, and a bound method would keep the runtime alive for good.)"""
    for entry in entries.values():
        if entry.outputs is not None:
            entry.outputs.retire()
        entry.inputs = []
        for graph in entry.graphs:
            if graph is not None:
                graph.out = ()
                graph.copies = []
                graph.backs = ()
