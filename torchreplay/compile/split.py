"""Split an FX graph into pieces: runs of capturable nodes, and the nodes a graph cannot hold.

A node runs eagerly (outside every CUDA graph) when it is one of the user's ``splitting_ops``, or
when it cannot be captured: it runs on the CPU (a CPU tensor in or out), uses another device,
reads a value on the host (``.item()``, ``.tolist()``, ``_local_scalar_dense``), has an output
size that depends on the data (unbacked symbols: ``nonzero``, boolean masks, ``unique``), or
reads or sets the RNG state on the host. Everything else is kept in original order in runs; a run
becomes one graphed piece, so an in-place write keeps its place between the reads around it.

Works on Dynamo's torch-level graphs (``meta["example_value"]``) and on aten graphs
(``meta["val"]``) alike; pure CPU arithmetic on the graph's structure, tested on the CPU.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx as fx

from torchreplay import _compat
from torchreplay.pieces.direct import direct_call
from torchreplay.pieces.program import Split

__all__ = [
    "Segment", "split_graph", "why_eager", "node_value", "op_name", "user_line", "direct_forward",
    "seed_inputs", "host_seeds",
]

_HOST_METHODS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__"}
_HOST_OPS = {"aten._local_scalar_dense", "aten.item", "cuda.synchronize", "synchronize"}
_RNG_STATE = {"get_rng_state", "set_rng_state", "manual_seed", "seed", "get_state", "set_state"}
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


@dataclasses.dataclass
class Segment:
    """A run of nodes that go together: one graphed piece or one eager step.

    Attributes:
        nodes: the nodes, in graph order.
        graphed: captured as a CUDA graph.
        splits: for an eager step, why each of its nodes cannot be captured.
        inputs: the nodes defined outside that it reads (placeholders or earlier segments').
        outputs: its nodes read after it (by a later segment or the graph's output).
        module: a GraphModule of just these nodes: ``module(*inputs) -> tuple(outputs)``.
    """

    nodes: list[fx.Node]
    graphed: bool
    splits: list[Split] = dataclasses.field(default_factory=list)
    inputs: list[fx.Node] = dataclasses.field(default_factory=list)
    outputs: list[fx.Node] = dataclasses.field(default_factory=list)
    module: fx.GraphModule | None = None


def node_value(node: fx.Node) -> Any:
    """The example value of a node (a fake tensor, a SymInt, a tuple, ...), or None."""
    meta = node.meta
    return meta["example_value"] if "example_value" in meta else meta.get("val")


def op_name(node: fx.Node) -> str:
    """``"aten.nonzero.default"``, ``"torch.nonzero"``, ``"Tensor.item"``, ``"mylib.attention"``."""
    t = node.target
    if node.op == "call_method":
        return f"Tensor.{t}"
    if node.op == "call_module":
        return f"module {t}"
    if isinstance(t, _compat.OP_TYPES):
        return str(t)
    module = getattr(t, "__module__", None) or ""
    name = getattr(t, "__name__", None) or str(t)
    if module.startswith("torch"):
        return f"torch.{name}" if module in ("torch", "torch._C._VariableFunctions") else f"{module}.{name}"
    return name


def user_line(node: fx.Node) -> str:
    """The user's ``file:line`` that made the node (the last frame of its stack trace), or ''."""
    trace = node.meta.get("stack_trace") or ""
    frames = _FRAME.findall(trace)
    return f"{frames[-1][0]}:{frames[-1][1]}" if frames else ""


def _matches(node: fx.Node, name: str, splitting_ops: Sequence[Any]) -> bool:
    """Does the node call one of ``splitting_ops``: an op object (packet or overload), or a name
    as ``"mylib.attention"``, ``"mylib::attention"`` or with an overload (``".default"``)."""
    target = node.target
    packet = getattr(target, "overloadpacket", target)
    for op in splitting_ops:
        if op is target or getattr(op, "overloadpacket", op) is packet:
            return True
        if isinstance(op, str):
            op = op.replace("::", ".")
            text = str(target) if not callable(target) or isinstance(
                target, _compat.OP_TYPES
            ) else name
            for candidate in (name, text):
                # One names the other or an overload of it: "a.b" vs "a.b.default".
                if candidate == op or candidate.startswith(op + ".") or op.startswith(candidate + "."):
                    return True
    return False


def _unsafe_tag(node: fx.Node) -> bool:
    """Is the op tagged ``torch.Tag.cudagraph_unsafe`` (a custom op that says it cannot be
    captured)? A torch without the tag has no such ops."""
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    if tag is None:
        return False
    target = node.target
    if isinstance(target, _compat.OpOverloadPacket):
        target = getattr(target, "default", None)
    return tag in getattr(target, "tags", ())


def _varies(node: fx.Node) -> bool:
    """Is the node's value computed from the graph's inputs (not a constant)?"""
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n.op == "placeholder":
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return False


def _tensors(values: Iterable[Any]) -> list[torch.Tensor]:
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(_tensors(v))
    return out


def why_eager(
    node: fx.Node, splitting_ops: Sequence[Any] = (), device: torch.device | None = None
) -> Split | None:
    """Return why ``node`` must run outside a CUDA graph, or None when it can be captured."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return None
    name = op_name(node)
    where = user_line(node)
    if _matches(node, name, splitting_ops):
        return Split(name, "is a splitting op (splitting_ops=)", where, "none needed: split on purpose")
    if _unsafe_tag(node):
        return Split(name, "is tagged torch.Tag.cudagraph_unsafe", where, "none: the op says so")
    short = str(node.target).split(".")[-1] if node.op != "call_method" else str(node.target)
    if node.op == "call_method" and node.target in _HOST_METHODS or any(
        name.startswith(h) for h in _HOST_OPS
    ):
        return Split(
            name,
            "reads a tensor value on the host, which waits for the GPU",
            where,
            "keep the value on the device (torch.where instead of if, no .item())",
        )
    if short in _RNG_STATE or name.endswith("rng_state"):
        return Split(name, "reads or sets the RNG state on the host", where, "seed outside the model")
    value = node_value(node)
    ins = [node_value(a) for a in node.all_input_nodes]
    if _compat.new_unbacked_symbols(value, ins):
        if _sliced_by_a_size(node):
            return Split(
                name,
                "is a slice by a size whose length torch traces as unknown (size-oblivious "
                "tracing gives it a size of its own); a view, run eagerly",
                where,
                "none needed: a view launches no kernel",
            )
        return Split(
            name,
            "has an output size that depends on the data, which the host must read",
            where,
            "pad to a fixed size (e.g. torch.where, or nonzero(..., size=N))",
        )
    tensors = _tensors([value, *ins])
    for t in tensors:
        if t.device.type == "cpu" and (t.dim() > 0 or t is value):
            return Split(
                name,
                "runs on or copies to the CPU, which a CUDA graph cannot replay",
                where,
                "move the tensor to the GPU once, outside the model",
            )
    for a in node.all_input_nodes:
        v = node_value(a)
        if isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.dim() == 0 and _varies(a):
            # A CUDA kernel takes a CPU scalar's value at launch: a graph would keep the
            # captured value. A constant may stay; one that follows the inputs may not.
            return Split(
                name,
                f"reads a CPU scalar tensor ({a.name}) that changes between calls; a graph "
                "would keep its value at capture",
                where,
                "pass it as a CUDA tensor (or a Python number, which Dynamo specialises)",
            )
    for t in tensors:
        if device is not None and t.device.type == "cuda" and t.device != device:
            return Split(name, f"uses {t.device}, but the graph is on {device}", where, "keep one device")
    return None


def _sliced_by_a_size(node: fx.Node) -> bool:
    """Is ``node`` ``t[a:b]`` (slices only, some bound a traced int such as ``x.shape[0]``): a
    view whose length torch 2.11 traces as an unbacked size, though no data decides it."""
    base = node.args[0] if node.args else None
    if node.target is not operator.getitem or not isinstance(base, fx.Node) or not isinstance(
        node_value(base), torch.Tensor
    ):
        return False
    index = node.args[1] if len(node.args) > 1 else None
    items = index if isinstance(index, tuple) else (index,)
    bounds = [b for i in items if isinstance(i, slice) for b in (i.start, i.stop, i.step)]
    return (
        all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in items)
        and any(isinstance(b, fx.Node) and isinstance(node_value(b), (int, torch.SymInt)) for b in bounds)
    )


def _makes_cuda_work(nodes: Sequence[fx.Node]) -> bool:
    for n in nodes:
        if n.op in ("call_function", "call_method", "call_module") and n.target is not operator.getitem:
            # Meta tensors count: tests split graphs traced on the meta device.
            if any(t.device.type != "cpu" for t in _tensors([node_value(n)])):
                return True
    return False


def split_graph(
    gm: fx.GraphModule,
    splitting_ops: Sequence[Any] = (),
    device: torch.device | None = None,
    graphable: Callable[[Sequence[fx.Node]], bool] = _makes_cuda_work,
) -> list[Segment]:
    """Cut ``gm`` into segments in graph order: runs of capturable nodes and eager nodes.

    A run with no CUDA work (only size arithmetic, say) is made eager: it has nothing to replay.
    Each segment gets a GraphModule of its own (sharing ``gm``'s attributes) that takes the
    values it reads and returns the values read after it.
    """
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    segments: list[Segment] = []
    for node in body:
        split = why_eager(node, splitting_ops, device)
        graphed = split is None
        if segments and segments[-1].graphed == graphed and (graphed or not _is_user_split(segments[-1], split)):
            segments[-1].nodes.append(node)
        else:
            segments.append(Segment([node], graphed))
        if split is not None:
            segments[-1].splits.append(split)
    for seg in segments:
        if seg.graphed and not graphable(seg.nodes):
            seg.graphed = False
            seg.splits.append(Split("(no CUDA work)", "only host arithmetic; nothing to replay"))
    # Neighbouring eager segments (a run made eager above) are one step.
    merged: list[Segment] = []
    for seg in segments:
        if merged and not seg.graphed and not merged[-1].graphed:
            merged[-1].nodes += seg.nodes
            merged[-1].splits += seg.splits
        else:
            merged.append(seg)
    owner = {n: k for k, seg in enumerate(merged) for n in seg.nodes}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for k, seg in enumerate(merged):
        members = set(seg.nodes)
        seen: dict[fx.Node, None] = {}
        for n in seg.nodes:
            for a in n.all_input_nodes:
                if a not in members and a.op != "get_attr":
                    seen.setdefault(a)
        seg.inputs = list(seen)
        seg.outputs = [
            n for n in seg.nodes
            if any(u is output or owner.get(u, k) != k for u in n.users)
        ]
        seg.module = _submodule(gm, seg)
    return merged


def _is_user_split(seg: Segment, split: Split | None) -> bool:
    """A user's splitting op is a step of its own (the report names one op per step)."""
    return bool(seg.splits) and (
        seg.splits[-1].reason.startswith("is a splitting op")
        or (split is not None and split.reason.startswith("is a splitting op"))
    )


def _submodule(gm: fx.GraphModule, seg: Segment) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in seg.inputs:
        p = graph.placeholder(a.name)
        p.meta = dict(a.meta)
        env[a] = p

    def lookup(a: fx.Node) -> fx.Node:
        if a not in env and a.op == "get_attr":
            env[a] = graph.node_copy(a)
        return env[a]

    for n in seg.nodes:
        env[n] = graph.node_copy(n, lookup)
    graph.output(tuple(env[n] for n in seg.outputs))
    return fx.GraphModule(gm, graph)


#: the arguments of an attention's backward that hold its dropout's seed, and the backwards that
#: read them on the host outside a capture (cuDNN's reads them on the GPU always)
_SEEDS = ("philox_seed", "philox_offset")
_HOST_SEEDED = ("efficient_attention_backward", "flash_attention_backward")


def seed_inputs(module: fx.GraphModule) -> tuple[int, ...]:
    """The positions of ``module``'s inputs that an attention's backward reads as its dropout's
    seed and offset. A forward that ran inside a capture made them on the GPU (graph-safe RNG);
    outside a capture the backward reads them on the host (``*philox_seed.data_ptr()``), and a
    GPU tensor there is a segmentation fault (HF BERT trained through the backend: the warm-up of
    a backward graph after its forward's graph)."""
    index = {n: i for i, n in enumerate(n for n in module.graph.nodes if n.op == "placeholder")}
    found: set[int] = set()
    for n in module.graph.nodes:
        if n.op != "call_function":
            continue
        op = n.target
        if not isinstance(op, _compat.OpOverload) or not op.__name__.split(".")[0].endswith(_HOST_SEEDED):
            continue
        kinds = _compat.argument_kinds(op)
        for k, (name, *_) in enumerate(kinds or ()):
            if name in _SEEDS:
                value = n.args[k] if k < len(n.args) else n.kwargs.get(name)
                if value in index:
                    found.add(index[value])
    return tuple(sorted(found))


def host_seeds(fn: Callable[..., Any], positions: tuple[int, ...]) -> Callable[..., Any]:
    """``fn`` called with the seeds at ``positions`` on the host where no capture is running
    (a warm-up, an ungraphed call); inside a capture as they are (the backward then reads them
    on the GPU, as the forward's graph wrote them). Only where a graph does not replay: a copy
    to the host waits for the GPU."""
    def call(*args: Any) -> Any:
        if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            args = tuple(
                a.cpu() if i in positions and isinstance(a, torch.Tensor) and a.is_cuda else a
                for i, a in enumerate(args)
            )
        return fn(*args)

    call.__name__ = call.__qualname__ = getattr(fn, "__name__", "fn")
    return call


def direct_forward(module: fx.GraphModule) -> Callable[..., Any] | None:
    """``module.forward`` for an eager step's replays, with every ``torch.library.custom_op``
    it calls called without the dispatcher (``pieces/direct.py``); ``None`` when it calls none
    that can be."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(module.graph, {}))
    changed = False
    for n in graph.nodes:
        op = n.target
        if n.op != "call_function":
            continue
        if isinstance(op, _compat.OpOverloadPacket):  # torch.ops.ns.name(...) in user code
            op = op.default if op.overloads() == ["default"] else None
        if not isinstance(op, _compat.OpOverload):
            continue
        args = [_traced(a) for a in n.args]
        kwargs = {k: _traced(v) for k, v in n.kwargs.items()}
        fn = direct_call(op, args, kwargs)
        if fn is not None:
            n.target = fn
            changed = True
    return fx.GraphModule(module, graph).forward if changed else None


def _traced(a: Any) -> Any:
    """An FX argument as its value at run time will look: a node's traced value, a list as a
    list (FX's code passes a list literal)."""
    if isinstance(a, fx.Node):
        return node_value(a)
    if isinstance(a, (list, tuple)) and type(a) is not tuple:
        return [_traced(v) for v in a]
    return a
