"""The Python state a call can reach, walked, compared and put back (core/effects.py says why).

A walk starts at the call's arguments, the objects its function closes over or is bound to, the
globals its code names, and the modules it runs. It records every mutable thing it meets (an
object's ``__dict__`` and ``__slots__``, never a property; a list; a dict; a closure cell; a
global) as a node: the object and a shallow copy of its contents. Two walks compare node by
node: a tensor or an object by identity, a plain value by equality, a container replaced by a
new one by its items. A walk also puts a node's contents back.
"""

from __future__ import annotations

import contextlib
import dis
import enum
import functools
import itertools
import logging
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

log = logging.getLogger(__name__)

__all__ = [
    "Change", "MAX_DEPTH", "MAX_VALUES", "MISSING", "Node", "diff", "live_value", "put_back",
    "large_tensors", "path_of", "plain_tensors", "roots_of_call", "same_value", "small_tensors", "state_tensors", "value_at", "walk_state", "show",
]

#: How deep below a root the walk goes (``args[0].layers[3].keys`` is depth 3).
MAX_DEPTH = 6
#: The most values one walk records; past it the rest is not compared (logged at DEBUG).
MAX_VALUES = 20_000
#: Items of one list or dict walked into (its length is always compared).
_MAX_ITEMS = 512
#: Tensors the state holds up to this size are copied before the warm-ups and put back after
#: the capture if written (a KV cache's position counter); larger ones are not (the rows a
#: warm-up wrote past a cache's position are written again by the next call).
_SMALL_BYTES = 1 << 20

_SCALARS = (
    type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size,
    torch.memory_format, torch.layout, enum.Enum, slice, range,
)
# What a module's __dict__ holds for torch itself: its state and hooks, watched elsewhere.
_MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__) | {
    "_compiled_call_impl", "_is_full_backward_hook", "_initialize_hook", "_load_hook",
}
# Objects whose state is not Python attributes, or not ours to compare: an optimizer's and a
# GradScaler's Python state (the learning rate, the scaler's per-step stage) graph_step keeps
# itself (training/optimizers.py, training/state.py).
_OPAQUE = (
    type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType,
    functools.partial, torch.Generator, torch.cuda.Stream, torch.cuda.Event,
    type(threading.Lock()), threading.Thread, logging.Logger, torch.optim.Optimizer,
    torch.amp.GradScaler,
)
MISSING = object()
_OURS = "torchreplay."


@dataclass(frozen=True, eq=False)
class Change:
    """One value the captured call changed: where, and what it was before and after."""

    path: str
    before: Any
    after: Any
    #: the node's path and the key within it (attribute, item, index): where to read it again
    where: tuple[str, Any] = ("", None)

    @property
    def tensor(self) -> bool:
        """A tensor replaced by another (read or not decides error or warning)."""
        return isinstance(self.before, torch.Tensor) and isinstance(self.after, torch.Tensor)

    def describe(self) -> str:
        return f"{self.path}: {show(self.before)} -> {show(self.after)}"


class Node:
    """A mutable thing the walk met: its path, the object, and a shallow copy of its contents
    (a list's or dict's first :data:`_MAX_ITEMS` only; ``size`` is its whole length)."""

    __slots__ = ("path", "obj", "kind", "items", "size")

    def __init__(self, path: str, obj: Any, kind: str, items: Any, size: int = -1) -> None:
        self.path, self.obj, self.kind, self.items = path, obj, kind, items
        self.size = size if size >= 0 else len(items)

    @property
    def whole(self) -> bool:
        """Does ``items`` hold all of it (it can be compared item by item and put back)?"""
        return self.size == len(self.items)


class _Global:
    """A global the function assigns (``global n; n += 1``): its module's dict and name."""

    __slots__ = ("globs", "name")

    def __init__(self, globs: dict[str, Any], name: str) -> None:
        self.globs, self.name = globs, name


def _add(nodes: dict[str, Node], node: Node) -> Node:
    """Add a node under a path no other node has (two roots of one class: ``Linear``,
    ``Linear#2``); walks of the same state name the same things alike."""
    path, n = node.path, 1
    while path in nodes:
        n += 1
        path = f"{node.path}#{n}"
    node.path = path
    nodes[path] = node
    return node


# -- walking -------------------------------------------------------------------------------


def walk_state(
    roots: Sequence[tuple[str, Any]], modules: Sequence[torch.nn.Module], name: str
) -> dict[str, Node]:
    """Walk from ``roots`` (path, value) and ``modules``; return the mutable nodes by path."""
    nodes: dict[str, Node] = {}
    seen: set[int] = set()
    budget = [MAX_VALUES]
    found: list[tuple[str, torch.nn.Module]] = []
    for path, value in roots:
        _walk(path, value, 0, nodes, seen, budget, found)
    found += [(type(m).__name__, m) for m in modules]
    done: set[int] = set()
    while found:  # each module's own attributes; its submodules report themselves
        path, root = found.pop(0)
        for sub, m in _submodules(root, done):
            done.add(id(m))
            own = {k: v for k, v in m.__dict__.items() if k not in _MODULE_INTERNALS}
            node = _add(nodes, Node(f"{path}.{sub}" if sub else path, m, "attrs", own))
            for k, v in own.items():
                _walk(f"{node.path}.{k}", v, 1, nodes, seen, budget, found)
    if budget[0] <= 0:
        log.debug("%s: Python state walk stopped at %d values", name, MAX_VALUES)
    return nodes


def _submodules(root: torch.nn.Module, done: set[int]) -> Iterator[tuple[str, torch.nn.Module]]:
    """``root.named_modules()`` in its order (depth first, parents first), without the modules in
    ``done`` or below them: one loop over the ``_modules`` dicts, not a generator per level
    (a walk is taken twice per size captured; nested generators cost a model of 600 modules a
    millisecond each time)."""
    todo = [("", root)]
    while todo:
        prefix, m = todo.pop()
        if id(m) in done:
            continue
        yield prefix, m
        children = [
            (f"{prefix}.{name}" if prefix else name, sub)
            for name, sub in m._modules.items() if sub is not None
        ]
        todo += reversed(children)


def roots_of_call(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
) -> Iterator[tuple[str, Any]]:
    """Where the walk starts: the arguments, and what the function carries with it."""
    for i, a in enumerate(args):
        yield f"args[{i}]", a
    for k, v in kwargs.items():
        yield f"kwargs[{k!r}]", v
    seen_fns: set[int] = set()
    todo = [fn]
    while todo:
        f = todo.pop()
        if id(f) in seen_fns:
            continue
        seen_fns.add(id(f))
        if isinstance(f, functools.partial):
            todo.append(f.func)
            for i, a in enumerate(f.args):
                yield f"partial.args[{i}]", a
            for k, v in f.keywords.items():
                yield f"partial.keywords[{k!r}]", v
        elif isinstance(f, types.MethodType):
            yield type(f.__self__).__name__, f.__self__
            todo.append(f.__func__)
        elif isinstance(f, types.FunctionType):
            code = f.__code__
            for name, cell in zip(code.co_freevars, f.__closure__ or ()):
                yield name, cell
            for name in _global_names(code):  # read (a script's `model`, `opt`) or assigned
                if name in f.__globals__ or name in _assigned(code):
                    yield f"global {name}", _Global(f.__globals__, name)
        elif isinstance(f, torch.nn.Module):
            yield type(f).__name__, f
        elif not isinstance(f, _OPAQUE):  # a callable object: its attributes
            yield type(f).__name__, f


@functools.lru_cache(maxsize=256)
def _global_names(code: types.CodeType, ops: tuple[str, ...] = ("LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL")) -> tuple[str, ...]:
    """Globals the code reads or assigns, by name, nested functions included."""
    names: list[str] = []
    for ins in dis.get_instructions(code):
        if ins.opname in ops and ins.argval not in names:
            names.append(ins.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += [n for n in _global_names(const, ops) if n not in names]
    return tuple(names)


def _assigned(code: types.CodeType) -> tuple[str, ...]:
    return _global_names(code, ("STORE_GLOBAL", "DELETE_GLOBAL"))


def _walk(
    path: str,
    value: Any,
    depth: int,
    nodes: dict[str, Node],
    seen: set[int],
    budget: list[int],
    modules: list[tuple[str, torch.nn.Module]],
) -> None:
    budget[0] -= 1
    if budget[0] <= 0 or depth > MAX_DEPTH or isinstance(value, (torch.Tensor, *_SCALARS)):
        return
    if id(value) in seen:
        return
    if isinstance(value, torch.nn.Module):
        seen.add(id(value))
        modules.append((path, value))
        return
    if isinstance(value, _Global):
        globs, name = value.globs, value.name
        _add(nodes, Node(path, globs, "global", {name: globs.get(name, MISSING)}))
        _walk(name, globs.get(name), depth, nodes, seen, budget, modules)
        return
    if isinstance(value, types.CellType):
        seen.add(id(value))
        try:
            contents = value.cell_contents
        except ValueError:  # an empty cell: a name assigned later
            contents = MISSING
        _add(nodes, Node(f"closure {path}", value, "cell", {"": contents}))
        _walk(path, contents, depth, nodes, seen, budget, modules)
        return
    if isinstance(value, _OPAQUE) or value is MISSING or type(value).__module__.startswith(_OURS):
        return  # (a graph of ours called inside keeps its own counters)
    seen.add(id(value))
    if isinstance(value, (list, tuple)):
        if isinstance(value, list):
            _add(nodes, Node(path, value, "list", value[:_MAX_ITEMS], len(value)))
        for i, v in enumerate(value[:_MAX_ITEMS]):
            _walk(f"{path}[{i}]", v, depth + 1, nodes, seen, budget, modules)
    elif isinstance(value, dict):
        first = dict(itertools.islice(value.items(), _MAX_ITEMS))
        _add(nodes, Node(path, value, "dict", first, len(value)))
        for k, v in first.items():
            _walk(f"{path}[{k!r}]", v, depth + 1, nodes, seen, budget, modules)
    else:
        attrs = _attributes(value)
        if attrs is None:
            return
        _add(nodes, Node(path, value, "attrs", attrs))
        for k, v in attrs.items():
            _walk(f"{path}.{k}", v, depth + 1, nodes, seen, budget, modules)


def _attributes(obj: Any) -> dict[str, Any] | None:
    """An object's attributes from ``__dict__`` and ``__slots__`` (no property is called)."""
    d = getattr(obj, "__dict__", None)
    out = dict(d) if isinstance(d, dict) else None
    for s in _slot_names(type(obj)):
        try:
            v = getattr(obj, s)
        except AttributeError:  # a slot never set
            continue
        out = {} if out is None else out
        out[s] = v
    return out


@functools.lru_cache(maxsize=None)
def _slot_names(cls: type) -> frozenset[str]:
    names: set[str] = set()
    for c in cls.__mro__:
        slots = c.__dict__.get("__slots__", ())
        names.update((slots,) if isinstance(slots, str) else slots)
    return frozenset(names - {"__dict__", "__weakref__"})


def _own_pytree(node: Node) -> bool:
    """A list or dict of the call's own arguments (their tensors are our static inputs)."""
    return node.kind in ("list", "dict") and node.path.startswith(("args[", "kwargs[")) and "." not in node.path


def state_tensors(nodes: dict[str, Node]) -> Iterator[tuple[Node, Any, torch.Tensor]]:
    """Each tensor the state holds (not in the call's own pytree), with its node and key."""
    for node in nodes.values():
        if _own_pytree(node):
            continue
        pairs = enumerate(node.items) if node.kind == "list" else node.items.items()
        for key, v in pairs:
            if isinstance(v, torch.Tensor):
                yield node, key, v


def plain_tensors(nodes: dict[str, Node]) -> list[torch.Tensor]:
    """The tensors the state holds that a build may have to put back, each once. Not the
    arguments' own tensors (the static inputs, put back apart), nor a module's parameters and
    buffers (``StateSnapshot``'s), nor a leaf autograd tracks (a module's or an optimizer's)."""
    out: dict[int, torch.Tensor] = {}
    for node in nodes.values():
        if _own_pytree(node):
            continue  # the call's own pytree: its tensors are the static inputs
        values = node.items if node.kind == "list" else node.items.values()
        for t in values:
            if (
                isinstance(t, torch.Tensor) and id(t) not in out and t.layout == torch.strided
                and not t.requires_grad and t.device.type != "meta"
            ):
                out[id(t)] = t
    return list(out.values())


def is_small(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage is at most :data:`_SMALL_BYTES`: copied whole to be put back."""
    return t.untyped_storage().nbytes() <= _SMALL_BYTES


def small_tensors(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, int | None, torch.Tensor]]:
    """Those of ``tensors`` of at most :data:`_SMALL_BYTES` (a position, a length, a step
    count), each with its version (None for an inference tensor, which has no counter) and a
    copy."""
    with torch.no_grad():
        return [
            (t, None if t.is_inference() else t._version, t.detach().clone())
            for t in tensors if is_small(t)
        ]


def large_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Those of ``tensors`` over :data:`_SMALL_BYTES`: what a build writes into them is
    recorded and put back (core/rewind.py), not copied whole."""
    return [t for t in tensors if not is_small(t)]


# -- comparing and putting back -----------------------------------------------------------------


def _same(a: Any, b: Any, old: dict[int, Node], new: dict[int, Node], depth: int = 0) -> bool:
    """Is ``b`` what ``a`` was, for the next call? Tensors and objects by identity, plain
    values by equality, a new container by its items as each walk saw them (``old``, ``new``:
    the walks' lists and dicts by id; the call may have changed the old one before replacing
    it)."""
    if a is b:
        return True
    if type(a) is not type(b) or isinstance(a, torch.Tensor):
        return False
    if isinstance(a, _SCALARS):
        try:
            return bool(a == b)
        except Exception:  # an enum or value whose == raises: identity only
            return False
    if depth >= 3 or not isinstance(a, (list, tuple, dict)):
        return False
    na, nb = old.get(id(a)), new.get(id(b))
    if na is not None and nb is not None and not (na.whole and nb.whole):
        return False  # a large container replaced: not compared item by item
    ia = na.items if na is not None else a
    ib = nb.items if nb is not None else b
    if isinstance(a, dict):
        return ia.keys() == ib.keys() and all(_same(v, ib[k], old, new, depth + 1) for k, v in ia.items())
    return len(ia) == len(ib) and all(_same(x, y, old, new, depth + 1) for x, y in zip(ia, ib))


def diff(before: dict[str, Node], after: dict[str, Node]) -> list[Change]:
    """What changed between two walks, node by node (a node replaced is its parent's change)."""
    changes: list[Change] = []
    old_ids = {id(n.obj): n for n in before.values() if n.kind in ("list", "dict")}
    new_ids = {id(n.obj): n for n in after.values() if n.kind in ("list", "dict")}
    for path, old in before.items():
        new = after.get(path)
        if new is None or new.obj is not old.obj:
            continue
        if old.kind in ("list", "dict") and old.size != new.size:
            changes.append(Change(path, _Count(old.size), _Count(new.size), (path, None)))
        if old.kind == "list":
            pairs: Iterable[tuple[Any, Any, Any]] = (
                (i, a, b) for i, (a, b) in enumerate(zip(old.items, new.items))
            )
        elif old.kind == "dict" and not (old.whole and new.whole):
            continue  # a large dict: its size only
        else:
            keys = list(old.items) + [k for k in new.items if k not in old.items]
            pairs = ((k, old.items.get(k, MISSING), new.items.get(k, MISSING)) for k in keys)
        changes += [
            Change(_child(path, old.kind, k), a, b, (path, k))
            for k, a, b in pairs if not _same(a, b, old_ids, new_ids)
        ]
    return changes


def path_of(node: Node, key: Any) -> str:
    """The path of ``key`` in ``node`` as messages show it (``cache.layers[0].keys``)."""
    return _child(node.path, node.kind, key)


def _child(path: str, kind: str, key: Any) -> str:
    if kind == "list":
        return f"{path}[{key}]"
    if kind == "attrs":
        return f"{path}.{key}"
    if kind == "dict":
        return f"{path}[{key!r}]"
    return path  # a cell or a global: the node's own path


def value_at(nodes: dict[str, Node], where: tuple[str, Any]) -> Any:
    """The value at a change's place in a walk, or None."""
    node = nodes.get(where[0])
    if node is None:
        return None
    if node.kind == "list":
        return node.items[where[1]] if isinstance(where[1], int) and where[1] < len(node.items) else None
    return node.items.get(where[1])


def live_value(node: Node, key: Any) -> Any:
    """The value at ``(node, key)`` now (a change's place, read again without a walk): an
    item, an attribute, a cell's or a global's contents, or a container's length for ``None``."""
    obj = node.obj
    if node.kind in ("list", "dict"):
        if key is None:
            return len(obj)
        if node.kind == "list":
            return obj[key] if isinstance(key, int) and key < len(obj) else MISSING
        return obj.get(key, MISSING)
    if node.kind == "cell":
        try:
            return obj.cell_contents
        except ValueError:
            return MISSING
    if node.kind == "global":
        return obj.get(key, MISSING)
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict) and key in d and key not in _slot_names(type(obj)):
        return d[key]
    try:
        return getattr(obj, key) if key in _slot_names(type(obj)) else MISSING
    except AttributeError:
        return MISSING


def same_value(a: Any, b: Any) -> bool:
    """The same object, or an equal plain value (what :func:`live_value` returns, compared)."""
    if a is b:
        return True
    if type(a) is not type(b) or not isinstance(a, _SCALARS):
        return False
    try:
        return bool(a == b)
    except Exception:
        return False


def put_back(node: Node) -> None:
    obj, items = node.obj, node.items
    if node.kind == "list":
        if node.whole:
            if len(obj) != len(items) or any(a is not b for a, b in zip(obj, items)):
                obj[:] = items
        elif len(obj) > node.size:  # a long list: what was appended since
            del obj[node.size:]
    elif node.kind == "dict":
        if node.whole and (obj.keys() != items.keys() or any(obj[k] is not v for k, v in items.items())):
            obj.clear()
            obj.update(items)
    elif node.kind == "cell":
        if items[""] is not MISSING:
            obj.cell_contents = items[""]
    elif node.kind == "global":
        for name, v in items.items():
            if v is MISSING:
                obj.pop(name, None)
            else:
                obj[name] = v
    else:
        d = getattr(obj, "__dict__", None)
        d = d if isinstance(d, dict) else None
        slots = _slot_names(type(obj))
        for k, v in items.items():
            if d is not None and k not in slots:
                if d.get(k, MISSING) is not v:
                    d[k] = v  # not through __setattr__: a module's or a frozen object's rules
            else:
                with contextlib.suppress(Exception):
                    object.__setattr__(obj, k, v)
        if d is not None:
            module = isinstance(obj, torch.nn.Module)
            for k in [k for k in d if k not in items and not (module and k in _MODULE_INTERNALS)]:
                del d[k]  # set since: a first call's cache, made again by the next eager call


class _Count(int):
    """A list's length, shown as such."""

    def __repr__(self) -> str:
        return f"{int(self)} items"


def show(v: Any) -> str:
    if v is MISSING:
        return "(absent)"
    if isinstance(v, torch.Tensor):
        return f"tensor{tuple(v.shape)} at {v.data_ptr():#x}"
    if isinstance(v, _SCALARS) or isinstance(v, _Count):
        text = repr(v)
        return text if len(text) <= 40 else text[:37] + "..."
    return f"a {type(v).__name__} at {id(v):#x}"


