"""Training through the compile backend: the forward and the backward of each piece as CUDA graphs.

A Dynamo graph that needs gradients is split as for inference (:mod:`torchreplay.compile.split`).
Each capturable piece is compiled by Inductor, which runs AOT autograd on it: one forward graph
(the piece's outputs, then the activations it saves) and one backward graph. Both reach
:class:`GraphingCompiler` (Inductor's ``inner_compile`` hook, where cudagraph trees sit too), which
runs each on a :class:`~torchreplay.pieces.runtime.PiecewiseRuntime` of its own pool:

- forward: parameters read in place, arguments copied in; outputs ``checked`` as for inference.
  Its saved activations stay in its pool until the backward ran: while the last call's are still
  held (a second forward before the first backward, ``model(a).sum() + model(b).sum()``), a call
  runs its compiled code without the graph, into fresh memory, counted. Never an overwritten
  activation.
- backward: the activations the forward graph saved in its pool (and parameters) are read in
  place, where the forward's replay left them; the others (an input the forward saved as is)
  are copied in. Which is which is decided at the first backward. A call whose forward ran without its graph
  (its activations are elsewhere) runs ungraphed too. The values read in place are put back
  after capture. They are compiled without donated buffers (``_compat.inductor_compile``): with
  them Inductor may write a gradient into a saved activation's memory, the forward's pool, which
  the next forward replay overwrites (and our clones of the backward's own memory miss it).
  Gradients are handed out as clones (``AccumulateGrad`` may keep a gradient as ``.grad``: a
  view of the pool would be overwritten by the next backward).
- several module instances (a block class compiled once, regional compilation): the forward
  runtime keeps graphs per set of parameters, the backward per set of parameters and saved
  activations (one per forward graph); each forward graph's activations await their own
  backward (:mod:`torchreplay.pieces.saved`), so the forwards of blocks 1..N and then the
  backwards N..1 all replay.

Eager pieces (what cannot be captured) run between them with ordinary autograd.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from torchreplay import _compat
from torchreplay.compile.split import host_seeds, seed_inputs
from torchreplay.config import CompileConfig
from torchreplay.pieces.program import Input, Piece, Program, run_in_order
from torchreplay.pieces.runtime import PiecewiseRuntime
from torchreplay.pieces.saved import SavedActivations

__all__ = ["GraphingCompiler", "training_program_fn", "written_inputs"]

log = logging.getLogger(__name__)


class GraphingCompiler:
    """Inductor's ``inner_compile`` for one piece: compile with Inductor, then run the compiled
    forward or backward graph on a piecewise runtime of one graphed piece.

    Args:
        config: the backend's options (warm-up, output policy, strict, max_graphs).
        name: the piece's name, e.g. ``"graph 0 piece 2"``.
        register: called with each runtime made (the backend keeps them for ``tr.explain``).
        static: the positions of the piece's inputs that are parameters or buffers (the
            forward graph takes the piece's inputs in order; Inductor's own
            ``static_input_idxs`` leaves out the parameters Dynamo passes as inputs).
    """

    def __init__(
        self,
        config: CompileConfig,
        name: str,
        register: Callable[[PiecewiseRuntime], None],
        static: frozenset[int] = frozenset(),
    ) -> None:
        self.config = config
        self.name = name
        self.register = register
        self.static = static
        #: the piece's forward runtime; its backward's replays mark its activations consumed
        self.forward: PiecewiseRuntime | None = None

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
        code = _compat.compile_fx_inner(gm, example_inputs, donate=False, **kwargs)
        compiled = getattr(code, "current_callable", None)
        if compiled is None:  # not a CompiledFxGraph: leave it as Inductor made it
            log.warning("torchreplay: %s: Inductor returned no callable to graph", self.name)
            return code
        backward = bool(kwargs.get("is_backward", False))
        static = set(kwargs.get("static_input_idxs") or ())
        if not backward:
            static |= self.static
        inputs = []
        written = written_inputs(gm)  # (a buffer the forward writes: put back after capture)
        for i, ex in enumerate(example_inputs):
            if isinstance(ex, torch.Tensor):
                kind = ("pinned" if backward else "static") if i in static else "tensor"
                wrote = written is None or i in written
                inputs.append(Input(f"input {i}", kind, written=wrote))  # type: ignore[arg-type]
            elif isinstance(ex, (int, torch.SymInt)):
                inputs.append(Input(f"input {i}", "int"))
            else:
                inputs.append(Input(f"input {i}", "other"))
        output = next(n for n in gm.graph.nodes if n.op == "output")
        leaves = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
        n_in, n_out = len(inputs), len(leaves)
        slots = tuple(range(n_in, n_in + n_out))
        what = "backward" if backward else "forward"
        seeds = seed_inputs(gm)  # an attention's backward run outside a capture reads them on the host
        piece = Piece(
            fn=host_seeds(_Unboxed(compiled), seeds) if seeds else _Unboxed(compiled),
            reads=tuple(range(n_in)),
            writes=slots,
            graphed=True,
            name=f"{self.name} {what}",
            nodes=sum(n.op == "call_function" for n in gm.graph.nodes),
        )
        if backward:
            # Which saved values stay put is known at the first backward: parameters, and
            # activations in the forward graph's pool, are read in place; others (an input
            # the forward saved as is, a value made without its graph) are copied in.
            make = lambda args: self._runtime(inputs, piece, slots, True, (), args)  # noqa: E731
            code.current_callable = _Boxed(None, make)
            return code
        guard: Sequence[int] = ()
        start = _compat.saved_outputs_start()
        if start is not None:
            guard = range(start, n_out)
        runtime = self._runtime(inputs, piece, slots, False, guard, None)
        self.forward = runtime
        code.current_callable = _Boxed(runtime, None)
        return code

    def _runtime(
        self,
        inputs: list[Input],
        piece: Piece,
        slots: tuple[int, ...],
        backward: bool,
        guard: Sequence[int],
        args: Sequence[Any] | None,
    ) -> PiecewiseRuntime:
        graph_config = self.config.graph_config()
        forward = self.forward
        saved = forward.saved if forward is not None else None
        if backward:
            # AccumulateGrad may keep a gradient as .grad: it must be the caller's memory.
            graph_config = dataclasses.replace(graph_config, outputs="clone")
            assert args is not None
            inputs = [
                dataclasses.replace(x, kind="tensor")
                if x.kind == "pinned" and not _stays_put(args[i], saved)
                else x
                for i, x in enumerate(inputs)
            ]
        runtime = PiecewiseRuntime(
            Program(tuple(inputs), [piece], slots),
            name=piece.name,
            config=graph_config,
            strict=self.config.strict,
            max_graphs=self.config.max_graphs,
            guard_outputs=guard,
        )
        if backward and saved is not None:
            runtime.after_replay = saved.read
            pinned = [i for i, x in enumerate(inputs) if x.kind == "pinned"]
            # another forward graph's activations (another instance or shape): graphed if that
            # forward replayed, so that they are what it saved in its pool
            runtime.admit = lambda call: all(_stays_put(call[i], saved) for i in pinned)
            runtime.reads(saved)
        self.register(runtime)
        return runtime


def _stays_put(t: Any, saved: SavedActivations | None) -> bool:
    """A parameter or buffer, or an activation a forward graph saved in its pool. Not any
    tensor in that pool: a block's input that is the previous block's output lies there too,
    where the first block's input (the caller's) does not; copied in, both are alike."""
    if not isinstance(t, torch.Tensor):
        return False
    if _compat.is_static_input(t):
        return True
    return saved is not None and saved.holds(t)


class _Unboxed:
    """Call Inductor's boxed code (``fn(list)``, which empties the list) with positional args."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[list[Any]], Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(list(args))


class _Boxed:
    """Inductor's calling convention (one list of arguments, emptied) around a runtime, made
    at the first call by ``make(args)`` when not given."""

    __slots__ = ("runtime", "make")
    _boxed_call = True

    def __init__(
        self,
        runtime: PiecewiseRuntime | None,
        make: Callable[[Sequence[Any]], PiecewiseRuntime] | None,
    ) -> None:
        self.runtime = runtime
        self.make = make

    def __call__(self, args: list[Any]) -> Any:
        call = tuple(args)
        args.clear()  # as Inductor's code does: the caller's list holds no input past here
        runtime = self.runtime
        if runtime is None:
            assert self.make is not None
            runtime = self.runtime = self.make(call)
        return runtime(*call)


def training_program_fn(program: Program) -> Callable[..., tuple[Any, ...]]:
    """Run a training program's pieces in order: graphed pieces are Inductor's autograd
    functions over graphed forward and backward code, eager pieces plain autograd."""
    last = program.last_reads()

    def run(*args: Any) -> tuple[Any, ...]:
        return run_in_order(program, args, last)

    return run


def written_inputs(gm: fx.GraphModule) -> set[int] | None:
    """The positions of the placeholders of an AOT graph that its ops write in place (their
    schema marks the argument written: the ``copy_`` into a BatchNorm's running statistics
    that AOT autograd keeps in the forward graph), directly or through a chain of views; None
    when unknown (a higher-order op, such as a user Triton kernel's wrapper, whose writes no
    schema says): every input then counts as written."""
    places = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    found: set[int] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if _compat.higher_order(n.target):
            return None
        for node in _compat.written_arguments(n.target, n.args, n.kwargs, fx.Node):
            while (node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node)
                   and _compat.returns_view(node.target)):
                node = node.args[0]  # (a write through a view writes what it views)
            if node in places:
                found.add(places[node])
    return found
