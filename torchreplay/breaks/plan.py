"""Which calls of a model run eagerly between graph segments (``breaks=``), and what each one reads.

What ``tr.graph(..., breaks=...)`` (:mod:`torchreplay.breaks.graph`) breaks at. A break is named by:

- a module instance (that one submodule) or a module class (every instance of it in the model):
  its ``forward`` is wrapped while the model runs;
- a Python function: the names that refer to it in the globals of the model's code (the
  ``forward`` of every submodule's class, or the function itself) and in that code's closures are
  rebound while the model runs (a function the code imports under another name, or reaches
  through an attribute, is not seen: name the module that calls it, or make it a custom op);
- an op: a ``torch.library`` custom op or an aten op, as an op object or a name (``"mylib.attn"``,
  ``"mylib::attn"``, ``"aten.nonzero"``, with or without an overload): seen at dispatch by a
  ``TorchDispatchMode``.

The rule for what a break reads, fixed at capture and applied at each replay:

- a tensor the caller passed (one of the call's own argument leaves): the graph's input buffer
  holds this call's contents, so the break reads it there (``"argument"``);
- a tensor made inside the model: read where the segment before the break left it (``"tensor"``);
- a non-tensor or CPU value the caller passed (a sequence length, a block table on the host): taken
  from this call's argument at the same path, never frozen (``"rebound"``);
- any other value (computed inside the model): a constant, the value at capture (``"constant"``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import inspect
import sys
import types
from typing import Any, Callable, Iterator, Literal, Sequence

import torch
import torch.nn as nn

from torchreplay import _compat
from torchreplay.check import user_line
from torchreplay.core.args import CallArgs, format_path
from torchreplay.errors import CaptureError

__all__ = [
    "Break", "ArgRule", "BreakCall", "Recorder", "resolve_breaks", "intercept", "plan_breaks",
    "check_reached", "outside_breaks", "same_path", "objects", "made_anew",
]

BreakKind = Literal["module", "class", "function", "op"]
RuleKind = Literal["argument", "tensor", "rebound", "constant"]


@dataclasses.dataclass(frozen=True)
class Break:
    """One entry of ``breaks=``, resolved."""

    kind: BreakKind
    target: Any
    name: str


@dataclasses.dataclass(frozen=True)
class ArgRule:
    """Where one leaf of a break's arguments comes from at replay.

    Attributes:
        path: the leaf in the break's call, e.g. ``"args[1]"`` or ``"kwargs['lengths']"``.
        kind: ``"argument"``, ``"tensor"``, ``"rebound"`` or ``"constant"`` (see the module).
        source: for ``"argument"`` and ``"rebound"``: the name of the caller's leaf.
        leaf: for ``"argument"`` and ``"rebound"``: its position in the call's flat leaves.
    """

    path: str
    kind: RuleKind
    source: str = ""
    leaf: int | None = None


@dataclasses.dataclass(frozen=True)
class BreakCall:
    """One call of a break during a run of the model, in order, with what it got and gave.

    Attributes:
        index: its place among the run's break calls.
        brk: the break.
        rules: per leaf of its arguments, where the leaf comes from at replay.
        where: the model's ``file:line`` that called it.
        call: what runs the break itself (the module's own ``forward``, the function, the op).
        spec: the pytree structure of its ``(args, kwargs)``.
        values: its argument leaves in this run.
        outputs: its output leaves in this run.
        out_spec: the pytree structure of its output.
    """

    index: int
    brk: Break
    rules: tuple[ArgRule, ...]
    where: str
    call: Callable[..., Any] = dataclasses.field(repr=False, compare=False, default=print)
    spec: Any = dataclasses.field(repr=False, compare=False, default=None)
    values: tuple[Any, ...] = dataclasses.field(repr=False, compare=False, default=())
    outputs: tuple[Any, ...] = dataclasses.field(repr=False, compare=False, default=())
    out_spec: Any = dataclasses.field(repr=False, compare=False, default=None)


def resolve_breaks(breaks: Any) -> tuple[Break, ...]:
    """Check ``breaks=`` and resolve each entry to a :class:`Break`.

    Raises:
        ValueError: an entry that is none of the kinds above, or an op name that torch does not
            know, named with its position; ``"auto"`` (found by a run: :mod:`.auto`).
    """
    if breaks is None:
        return ()
    if isinstance(breaks, str) and breaks == "auto":
        raise ValueError(
            'breaks="auto" is found by a run of the model (torchreplay.breaks.auto), not '
            "resolved from names: pass it to tr.graph"
        )
    if isinstance(breaks, (str, nn.Module, type)) or not isinstance(breaks, (list, tuple)):
        breaks = [breaks]
    out = []
    for i, b in enumerate(breaks):
        if isinstance(b, nn.Module):
            out.append(Break("module", b, type(b).__name__))
        elif isinstance(b, type) and issubclass(b, nn.Module):
            out.append(Break("class", b, b.__name__))
        elif isinstance(b, _compat.OP_TYPES):
            out.append(Break("op", _packet(b), str(_packet(b))))
        elif isinstance(b, str):
            op = _op_by_name(b)
            if op is None:
                raise ValueError(
                    f"breaks[{i}] = {b!r}: no such op; name a torch.library op as 'ns.op' or "
                    "'ns::op' (it must be registered before the call), or an aten op as "
                    "'aten.nonzero'"
                )
            out.append(Break("op", op, str(op)))
        elif isinstance(b, types.FunctionType):
            out.append(Break("function", b, b.__qualname__))
        elif isinstance(b, type) and issubclass(b, torch.autograd.Function):
            raise ValueError(
                f"breaks[{i}] = {b.__qualname__} is a torch.autograd.Function: name the module or "
                "the Python function that calls its apply (flash-attn's flash_attn_func, say), "
                "or make it a torch.library custom op and name the op"
            )
        else:
            raise ValueError(
                f"breaks[{i}] = {b!r} ({type(b).__name__}): expected a module instance or class, a "
                "Python function, an op object or an op name"
            )
    return tuple(out)


def _packet(op: Any) -> Any:
    return getattr(op, "overloadpacket", op)


def _op_by_name(name: str) -> Any:
    parts = name.replace("::", ".").split(".")
    if len(parts) < 2:
        return None
    ns, op_name = parts[0], parts[1]
    try:
        return getattr(getattr(torch.ops, ns), op_name)
    except (AttributeError, RuntimeError):
        return None


class _OpBreaks(_compat.LightDispatchMode):
    """Runs ``on_op(brk, call, args, kwargs)`` for each op that is a break."""

    def __init__(self, ops: dict[Any, Break], on_op: Callable[..., Any]) -> None:
        super().__init__()
        self.ops = ops
        self.on_op = on_op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        brk = self.ops.get(_packet(func))
        if brk is None:
            return func(*args, **kwargs)
        return self.on_op(brk, func, args, kwargs)


@contextlib.contextmanager
def intercept(
    fn: Callable[..., Any],
    breaks: Sequence[Break],
    on_break: Callable[..., Any],
    reached: set[Break] | None = None,
) -> Iterator[None]:
    """While the context is open, each call of a break in ``fn`` goes to
    ``on_break(brk, call, args, kwargs)``, where ``call(*args, **kwargs)`` runs the break itself.
    A break called inside another break runs as is (part of the outer one). ``reached`` collects
    every break called, nested ones included. Everything is put back on exit."""
    inside = [False]

    def dispatch(brk: Break, call: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        if reached is not None:
            reached.add(brk)
        if inside[0]:
            return call(*args, **kwargs)
        inside[0] = True
        try:
            return on_break(brk, call, args, kwargs)
        finally:
            inside[0] = False

    undo: list[Callable[[], None]] = []
    modules = _modules_of(fn)
    try:
        for brk in breaks:
            if brk.kind in ("module", "class"):
                targets = [brk.target] if brk.kind == "module" else [
                    m for m in modules if isinstance(m, brk.target)
                ]
                for m in targets:
                    undo.append(_wrap_forward(m, brk, dispatch))
            elif brk.kind == "function":
                for namespace in _namespaces(fn, modules):
                    for key, value in list(namespace.items()):
                        if value is brk.target:
                            undo.append(_rebind(namespace, key, brk, dispatch))
                for cell in _cells(fn, modules):  # a function the model's code closes over
                    if cell.cell_contents is brk.target:
                        undo.append(_rebind_cell(cell, brk, dispatch))
        ops = {brk.target: brk for brk in breaks if brk.kind == "op"}
        with _OpBreaks(ops, dispatch) if ops else contextlib.nullcontext():
            yield
    finally:
        for u in reversed(undo):
            u()


def _modules_of(fn: Callable[..., Any]) -> list[nn.Module]:
    """The modules ``fn`` runs: itself, the module it is bound to, or, for a plain function
    (``def decode(ids): return model(ids)``), the modules its code closes over or names as
    globals, with their submodules."""
    owner = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module):
        owners = [owner]
    else:
        code = inspect.unwrap(fn)
        cells = []
        for cell in getattr(code, "__closure__", None) or ():
            with contextlib.suppress(ValueError):  # an empty cell
                cells.append(cell.cell_contents)
        names = getattr(getattr(code, "__code__", None), "co_names", ())
        found = getattr(code, "__globals__", {})
        owners = [v for v in cells + [found.get(n) for n in names] if isinstance(v, nn.Module)]
    seen: dict[int, nn.Module] = {}
    for o in owners:
        for m in o.modules():
            seen.setdefault(id(m), m)
    return list(seen.values())


def _namespaces(fn: Callable[..., Any], modules: list[nn.Module]) -> list[dict[str, Any]]:
    """The globals of the model's code: each submodule class's ``forward``, and ``fn`` itself."""
    seen: dict[int, dict[str, Any]] = {}
    for f in _code_of(fn, modules):
        g = getattr(f, "__globals__", None)
        if isinstance(g, dict):
            seen[id(g)] = g
    return list(seen.values())


def _code_of(fn: Callable[..., Any], modules: list[nn.Module]) -> list[Any]:
    """``fn`` and each submodule class's ``forward``, unwrapped, each once (a model of 160
    modules has a handful of classes; this runs at every capture of every size)."""
    forwards = {id(f): f for f in [fn] + [type(m).forward for m in modules]}
    return [inspect.unwrap(getattr(f, "__func__", f)) for f in forwards.values()]


def _cells(fn: Callable[..., Any], modules: list[nn.Module]) -> list[Any]:
    """The closure cells of the model's code (``fn`` and each submodule class's ``forward``)."""
    out = []
    for f in _code_of(fn, modules):
        for cell in getattr(f, "__closure__", None) or ():
            try:
                cell.cell_contents
            except ValueError:  # an empty cell
                continue
            out.append(cell)
    return out


def _rebind_cell(cell: Any, brk: Break, dispatch: Callable[..., Any]) -> Callable[[], None]:
    original = cell.cell_contents

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return dispatch(brk, original, args, kwargs)

    cell.cell_contents = wrapper

    def undo() -> None:
        cell.cell_contents = original

    return undo


def _wrap_forward(m: nn.Module, brk: Break, dispatch: Callable[..., Any]) -> Callable[[], None]:
    had = "forward" in m.__dict__
    original = m.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return dispatch(brk, original, args, kwargs)

    m.forward = forward  # type: ignore[method-assign]

    def undo() -> None:
        if had:
            m.forward = original  # type: ignore[method-assign]
        else:
            del m.forward

    return undo


def _rebind(namespace: dict[str, Any], key: str, brk: Break, dispatch: Callable[..., Any]) -> Callable[[], None]:
    original = namespace[key]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return dispatch(brk, original, args, kwargs)

    namespace[key] = wrapper

    def undo() -> None:
        namespace[key] = original

    return undo


class Recorder:
    """The ``on_break`` of :func:`intercept` that records each break call (a
    :class:`BreakCall`) and runs it: ``run(record, call, args, kwargs)`` when given (a capture
    stops there, and may hand the model other tensors than the break's own), else the call.

    Args:
        leaves, paths: the call's flat argument leaves (as the model sees them: a graph's
            static buffers) and their names.
    """

    def __init__(
        self,
        leaves: Sequence[Any],
        paths: Sequence[str],
        run: Callable[[BreakCall, Callable[..., Any], Any, Any], Any] | None = None,
    ) -> None:
        self._caller = _leaves_by_id(leaves)
        self._paths = list(paths)
        self._run = run
        self.calls: list[BreakCall] = []

    def __call__(self, brk: Break, call: Callable[..., Any], a: Any, k: Any) -> Any:
        flat, spec = _compat.tree_flatten_with_path((tuple(a), dict(k)))
        rules = []
        for keypath, leaf in flat:
            path = format_path(keypath, ())
            i = _source(self._caller, leaf)
            source = self._paths[i] if i is not None else ""
            if i is not None and isinstance(leaf, torch.Tensor) and leaf.device.type != "cpu":
                rules.append(ArgRule(path, "argument", source, i))
            elif i is not None:
                rules.append(ArgRule(path, "rebound", source, i))
            elif isinstance(leaf, torch.Tensor) and leaf.device.type != "cpu":
                rules.append(ArgRule(path, "tensor"))
            else:
                rules.append(ArgRule(path, "constant"))
        record = BreakCall(
            len(self.calls), brk, tuple(rules), user_line(), call, spec, tuple(v for _, v in flat)
        )
        out = call(*a, **k) if self._run is None else self._run(record, call, a, k)
        outs, out_spec = _compat.tree_flatten(out)
        self.calls.append(dataclasses.replace(record, outputs=tuple(outs), out_spec=out_spec))
        return out


def outside_breaks(fn: Callable[..., Any], breaks: Sequence[Break]) -> Callable[..., Any]:
    """``fn``, with every break run unseen by dispatch modes and the profile hook: what
    ``tr.check`` looks at when a segment of a breakable graph fails to capture (the breaks run
    eagerly; their ops are no reason)."""

    def unseen(brk: Break, call: Callable[..., Any], a: Any, k: Any) -> Any:
        hook = sys.getprofile()
        sys.setprofile(None)
        try:
            with _compat.dispatch_modes_off():
                return call(*a, **k)
        finally:
            sys.setprofile(hook)

    def run(*args: Any, **kwargs: Any) -> Any:
        with intercept(fn, breaks, unseen):
            return fn(*args, **kwargs)

    run.__qualname__ = getattr(fn, "__qualname__", type(fn).__name__)
    return run


def plan_breaks(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any] | None,
    breaks: Any,
) -> list[BreakCall]:
    """Run ``fn(*args, **kwargs)`` once, eagerly, and return each break call with the rule for
    each of its argument leaves (the segment plan a capture follows).

    Raises:
        CaptureError: a break in ``breaks`` that the call never reached (nothing to break at).
    """
    call = CallArgs(fn, args, dict(kwargs or {}))
    resolved = resolve_breaks(breaks)
    recorder = Recorder(call.leaves, call.paths)
    reached: set[Break] = set()
    with intercept(fn, resolved, recorder, reached):
        fn(*call.args, **call.kwargs)
    check_reached(resolved, reached)
    return recorder.calls


def check_reached(resolved: Sequence[Break], reached: set[Break]) -> None:
    """Raise when a break of ``breaks=`` never ran (a wrong name breaks nothing, silently)."""
    missing = [b.name for b in resolved if b not in reached]
    if missing:
        raise CaptureError(
            f"breaks: {', '.join(missing)} never ran during the sample call, so there is nothing "
            "to break at; check the names, or leave them out of breaks="
        )


def _leaves_by_id(leaves: Sequence[Any]) -> dict[Any, int]:
    """The caller's leaves, found again in a break's arguments: tensors and other objects by
    identity; plain numbers by value (Python shares small ints, so identity says nothing of
    them), when exactly one of the caller's leaves has that value."""
    found: dict[Any, int] = {}
    by_value: dict[Any, list[int]] = {}
    for i, v in enumerate(leaves):
        if isinstance(v, (bool, int, float)):
            by_value.setdefault((type(v), v), []).append(i)
        elif v is not None and not isinstance(v, str):
            found[id(v)] = i
    for key, idx in by_value.items():
        if len(idx) == 1:
            found[key] = idx[0]
    return found


def _source(caller: dict[Any, int], leaf: Any) -> int | None:
    if isinstance(leaf, (bool, int, float)):
        return caller.get((type(leaf), leaf))
    return caller.get(id(leaf))


_PLAIN = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
          torch.memory_format, enum.Enum, type, types.FunctionType, types.BuiltinFunctionType,
          types.MethodType, nn.Module)


def objects(leaves: Sequence[Any]) -> list[tuple[int, Any]]:
    """The leaves that are objects a call may make anew (a cache object), by position: not
    tensors, numbers, strings, dtypes, classes, functions or modules."""
    return [(j, x) for j, x in enumerate(leaves)
            if x is not None and not isinstance(x, torch.Tensor) and not isinstance(x, _PLAIN)]


def made_anew(now: list[tuple[int, Any]], before: list[tuple[int, Any]]) -> Any:
    """The first object of ``now`` (:func:`objects`) that is another object than ``before``'s
    at its place, and not an equal one (a frozen dataclass made at each call is harmless)."""
    was = dict(before)
    for j, x in now:
        if j in was and was[j] is not x and not (type(x) is type(was[j]) and _equal(x, was[j])):
            return x
    return None


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an __eq__ that cannot say: not equal
        return False


def same_path(
    name: str, plan: Sequence[BreakCall], calls: Sequence[BreakCall], out_spec: Any, out: Any,
    size: int | None,
) -> None:
    """Raise when a capture's run took another path than the plan's (other breaks, other
    argument rules, another output structure): its segments would not fit the program. Or
    when a break got an object the model made anew for this run (HF's ``DynamicCache`` with
    ``use_cache=True``, filled by the attention): at replay the break would get the capture's."""
    at = f"at size {size}" if size is not None else "at capture"
    want = [(c.brk, tuple((r.kind, r.leaf) for r in c.rules), len(c.outputs)) for c in plan]
    got = [(c.brk, tuple((r.kind, r.leaf) for r in c.rules), len(c.outputs)) for c in calls]
    if got != want:
        first = next((k for k, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        raise CaptureError(
            f"'{name}' {at} took another path than the sample call: its break calls "
            f"differ from call {first} on ({len(got)} calls, {len(want)} in the sample). A "
            "breakable graph needs the same breaks, with arguments of the same kinds, at "
            "every size; branch on sizes inside a break, not around it"
        )
    if _compat.tree_flatten(out)[1] != out_spec:
        raise CaptureError(f"'{name}' {at} returned another output structure than the sample call")
    for c, p in zip(calls, plan):
        anew = made_anew(objects(c.values), objects(p.values))
        if anew is not None:
            raise CaptureError(
                f"'{name}': break {c.brk.name} (at {c.where}) gets a {type(anew).__name__} the "
                "model makes anew at each call: every replay would hand it the capture's, with "
                "what was put in it then. Make it once and pass it to the model, or leave it out "
                "(HF: use_cache=False, or pass a StaticCache)"
            )
