"""The plain Python values a graph froze, found at its first capture and watched at each call.

A replay runs none of the model's Python, so each plain value its code read at capture (a flag,
a scale, a mode string: ``if self.disable_adapters:``, ``x * self.scaling``, ``if
self.config.use_cache:``) and each branch it chose by one is fixed in the graph. Eagerly a call
after such a value changed reads the new one; a replay would compute with the old one, silently.
Values the call itself changes are refused at capture (``core/effects.py``); this is about the
values the caller changes between calls.

:class:`FrozenWatch` runs around the first capture as a trace function (``sys.settrace``; not
under a debugger or coverage, which own it). It traces the lines of each Python frame the call
runs whose code is neither torch's, the standard library's nor ours (the model's, Hugging
Face's, PEFT's, a script's) and loads an attribute chain from a local, a closure cell or a
global (``self.config.use_cache``: a ``LOAD_FAST`` and its ``LOAD_ATTR``\\ s). As each such
line starts, it follows the line's chains from the locals of that moment, through instance
``__dict__``\\ s and submodules only: no property or ``__getattr__`` is ever called (a
property's own frame is traced instead). Only lines that run count: an encoder's ``if
config.is_decoder:`` branch never reads ``config.use_cache``. A chain that ends at a plain
value, or at a small dict or list of them (PEFT's ``scaling``), is kept; a global read bare
(``if DEBUG:``) too. Frames called inside a break are not traced (their reads run again at each
call), and objects the call made itself (a new cache object) are no state: not kept.
Torch's own layers are not traced line by line; as one of their methods starts, its mode is
watched where the method reads it (MC dropout switches the ``Dropout`` layers of an eval model
to ``train()``; fine-tuning freezes the ``BatchNorm`` layers of a training one), and while the
layer trains, the rates the same method reads (floats: a ``Dropout``'s ``p``, a
``BatchNorm``'s ``momentum``). Not seen: a torch layer's shape (a ``Conv2d``'s ``stride``:
nobody changes it after building it, and each value watched costs every call), class
attributes and ``__slots__``. A module's ``training`` that the model's code reads is watched like any value
(the graphed module's own is compared first, as its mode).

:class:`FrozenValues` compares them with the capture's at each call, all in one ``map`` over
the dicts that hold them (35-60 ns a value on the H200's host: 13 us a call for a 32-layer
Hugging Face Llama's 267). On Python >= 3.12 a module's values are compared only after a call
of ``nn.Module.__setattr__`` or ``__delattr__``, any module's, which ``sys.monitoring`` sees
(:func:`counted_writes`): the same Llama's check is about 0.5 us, its 7 values outside modules
(config fields, globals). A write around them (``m.__dict__[k] = v``) is seen at the next
counted one. A call while one differs runs eagerly, as a call in the other train/eval mode does
(``core/modes.py``: ``PY_VALUE``), with one warning per change naming it, both values and the
fix; set back, the graph replays again. (Dict version tags, tried first, cost more on Python
3.12, where torch reads them through a dict watcher.)
"""

from __future__ import annotations

import atexit
import dis
import itertools
import os
import sys
import sysconfig
import threading
import types
import weakref
from typing import Any, Iterable

import torch

from torchreplay.core.pystate import _MODULE_INTERNALS, _OPAQUE, _SCALARS, MISSING, show

# A module's own state torch keeps in its __dict__ (hooks, the parameter dicts), watched
# elsewhere; but ``training`` read by the model's code is a value like any other: a submodule
# switched alone (``model.encoder.eval()``) is no mode change of the graphed module.
_INTERNALS = _MODULE_INTERNALS - {"training"}

__all__ = ["FrozenValues", "FrozenWatch"]

#: Containers kept whole when a chain ends at one: this many items at most, all plain.
MAX_ITEMS = 64
_Module = torch.nn.Module
_ATTR_OPS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})


def _plain(v: Any) -> bool:
    """A value compared by equality: a scalar, or a tuple or frozenset of them."""
    if isinstance(v, _SCALARS):
        return True
    return isinstance(v, (tuple, frozenset)) and len(v) <= MAX_ITEMS and all(isinstance(x, _SCALARS) for x in v)


def _same(a: Any, b: Any) -> bool:
    """As a list's ``==`` compares items (what :meth:`FrozenValues.changed` runs first): the
    same object, or equal (``2 == 2.0``: eagerly the same result)."""
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:
        return False


def _skipped_dirs() -> tuple[str, tuple[str, ...], str]:
    paths = sysconfig.get_paths()
    stdlib = os.path.join(paths.get("stdlib", "/nonexistent"), "")
    ours = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")
    # (our built-in models are models like the user's: watched)
    return stdlib, (os.path.join(os.path.dirname(torch.__file__), ""), ours), os.path.join(ours, "models", "")


_STDLIB, _SKIPPED, _MODELS = _skipped_dirs()
_TORCH = _SKIPPED[0]
# nn.Module's own methods read every module's state: not a layer's reads
_MODULE_PY = os.path.abspath(sys.modules[_Module.__module__].__file__ or "")
_Chain = tuple[str, str, tuple[str, ...]]  # (start kind, start name, attributes)


def _watched_file(filename: str) -> bool:
    if filename.startswith("<") or (filename.startswith(_SKIPPED) and not filename.startswith(_MODELS)):
        return False
    # (a pyenv or venv keeps site-packages under the standard library's folder)
    return not (filename.startswith(_STDLIB) and "-packages" not in filename[len(_STDLIB):])


def chains_of(code: types.CodeType) -> dict[int, tuple[_Chain, ...]]:
    """The attribute chains ``code`` loads, by the line each starts on:
    ``("local", "self", ("config", "use_cache"))`` for ``self.config.use_cache``,
    ``("global", "DEBUG", ())`` for a bare global; ``{}`` when its file is not watched."""
    out: dict[int, list[_Chain]] = {}
    if _watched_file(code.co_filename):
        start: tuple[str, str, int] | None = None
        attrs: list[str] = []

        def end() -> None:
            if start is not None and (attrs or start[0] == "global"):
                chain = (start[0], start[1], tuple(attrs))
                if chain not in out.setdefault(start[2], []):
                    out[start[2]].append(chain)

        line: int | None = None
        for ins in dis.get_instructions(code):
            op = ins.opname
            positions = getattr(ins, "positions", None)  # (Python >= 3.11: each instruction's)
            if positions is not None:
                line = positions.lineno
            elif type(ins.starts_line) is int:  # (3.10: the first instruction of each line's)
                line = ins.starts_line
            if op in _ATTR_OPS and start is not None:
                attrs.append(ins.argval)
                continue
            end()
            start, attrs = None, []
            if line is None:
                continue
            if op.startswith("LOAD_FAST") or op == "LOAD_DEREF":  # (a pair loads two: the last)
                name = ins.argval[-1] if isinstance(ins.argval, tuple) else ins.argval
                start = ("local", name, line) if isinstance(name, str) else None
            elif op == "LOAD_GLOBAL":
                start = ("global", ins.argval, line)
        end()
    return {line: tuple(chains) for line, chains in out.items()}


def layer_reads(code: types.CodeType) -> tuple[str, ...]:
    """The attributes a method of torch's own layers reads from ``self`` (``Dropout.forward``:
    ``p``, ``training``, ``inplace``); ``()`` for other code."""
    if not code.co_filename.startswith(_TORCH) or code.co_filename == _MODULE_PY:
        return ()
    if code.co_argcount < 1 or code.co_varnames[0] != "self":
        return ()
    names: dict[str, None] = {}
    previous = None
    for ins in dis.get_instructions(code):
        if ins.opname in _ATTR_OPS and previous is not None and previous.opname.startswith("LOAD_FAST"):
            loaded = previous.argval[-1] if isinstance(previous.argval, tuple) else previous.argval
            if loaded == "self":
                names[ins.argval] = None
        previous = ins
    return tuple(names)


def _dict_of(obj: Any) -> dict[str, Any] | None:
    """An instance's own ``__dict__`` (no ``__getattribute__`` of its class is called)."""
    if isinstance(obj, (torch.Tensor, *_OPAQUE)) or type(obj).__module__.startswith("torchreplay."):
        return None
    try:
        d = object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        return None
    return d if type(d) is dict else None


def _container(v: Any) -> bool:
    if type(v) is list:
        return len(v) <= MAX_ITEMS and all(_plain(x) for x in v)
    if type(v) is dict:
        return len(v) <= MAX_ITEMS and all(_plain(k) and _plain(x) for k, x in v.items())
    return False


class FrozenWatch:
    """Around the first capture (a context manager): which plain values the call's code read.

    ``paused``: above 0 inside a break (its reads run again at each call). ``found`` maps each
    place (``(id(dict), key)``, or ``(id(container), None)``) to (owner, dict or container, key).
    """

    def __init__(self) -> None:
        self.paused = 0
        self.found: dict[tuple[int, Any], tuple[Any, Any, Any]] = {}
        self._previous: Any = None
        self._on = False
        # Each code object's chains by line, read once per capture (a few thousand at most)
        self._chains: dict[types.CodeType, dict[int, tuple[_Chain, ...]]] = {}
        self._layers: dict[types.CodeType, tuple[str, ...]] = {}  # torch's layers' methods

    def __enter__(self) -> FrozenWatch:
        self._previous = sys.gettrace()
        if self._previous is None:  # (under a debugger or coverage: not watched, unguarded)
            self._on = True
            sys.settrace(self._call)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._on:
            sys.settrace(None)
            self._on = False

    def _call(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        """A frame starts: trace its lines where its code loads any chain (not inside a break)."""
        if event != "call" or self.paused:
            return None
        try:
            code = frame.f_code
            chains = self._chains.get(code)
            if chains is None:
                chains = self._chains[code] = chains_of(code)
            if chains:
                return self._line
            names = self._layers.get(code)
            if names is None:
                names = self._layers[code] = layer_reads(code)
            if names:
                self._layer(frame.f_locals.get("self"), names)
        except Exception:  # never the capture's failure: this frame's values go unguarded
            pass
        return None

    def _layer(self, module: Any, names: tuple[str, ...]) -> None:
        """A torch layer's method starts: its mode, where it reads it (a ``Dropout`` or a
        ``BatchNorm`` switched alone, as MC dropout and frozen batch norms do), and while it
        trains the rates the same method reads (floats: a ``Dropout``'s ``p``, a
        ``BatchNorm``'s ``momentum``; a ``LayerNorm`` reads no mode, and none of its values).
        Its shape (ints, tuples, strings) and, in eval, its constants are not watched: nobody
        changes them after building it, and each value costs every call."""
        d = _dict_of(module) if isinstance(module, _Module) else None
        if d is None:
            return
        training = d.get("training") is True and "training" in names
        for name in names:
            if name in d and (name == "training" or (training and type(d[name]) is float)):
                self.found.setdefault((id(d), name), (module, d, name))

    def _line(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        """A line starts: the chains it loads, from the locals as they are now. Lines the call
        does not run are not read (an encoder's ``if config.is_decoder:`` branch)."""
        if event == "line" and not self.paused:
            try:
                chains = self._chains[frame.f_code].get(frame.f_lineno)
                if chains:
                    self._read(frame, chains)
            except Exception:
                pass
        return self._line

    def _read(self, frame: types.FrameType, chains: Iterable[tuple[str, str, tuple[str, ...]]]) -> None:
        local = frame.f_locals
        globs = frame.f_globals
        for kind, name, attrs in chains:
            if kind == "global":
                if name not in globs:
                    continue
                if not attrs:
                    if _plain(globs[name]):
                        self.found.setdefault((id(globs), name), (globs.get("__name__", "?"), globs, name))
                    continue
                obj = globs[name]
            else:
                obj = local.get(name, MISSING)
            if obj is not MISSING:
                self._follow(obj, attrs)

    def _follow(self, obj: Any, attrs: tuple[str, ...]) -> None:
        for attr in attrs:
            d = _dict_of(obj)
            if d is None:
                return
            if attr in d:
                if isinstance(obj, _Module) and attr in _INTERNALS:
                    return
                v = d[attr]
            elif isinstance(obj, _Module) and obj._modules.get(attr) is not None:
                obj = obj._modules[attr]
                continue
            else:
                return
            if _plain(v):
                self.found.setdefault((id(d), attr), (obj, d, attr))
                return
            if _container(v):  # (its items, and the attribute that holds it: replaced, or not)
                self.found.setdefault((id(d), attr), (obj, d, attr))
                self.found.setdefault((id(v), None), (obj, v, attr))
                return
            obj = v


class FrozenValues:
    """The plain values a graph's code read at capture, each where it was (:class:`FrozenWatch`),
    tested at each call by :meth:`changed`.

    Args:
        found: :attr:`FrozenWatch.found`.
        state: the Python state as it was before the captured call, by id (what the walk of
            ``core/pystate.py`` met, with its paths): an object the call made itself (a new
            cache object each call) is no state, and is neither watched nor kept alive.
    """

    __slots__ = ("_always", "_counted", "_seen", "_sized", "_sizes", "_lists", "_copies", "_whole", "last")

    def __init__(self, found: dict[tuple[int, Any], tuple[Any, Any, Any]], state: dict[int, tuple[Any, str]]) -> None:
        # Each value in a dict (an instance's, a global's, a small dict's item), compared at each
        # call; or, where every write to its owner goes through a __setattr__ and __delattr__
        # written in Python (a module's) and Python shows their calls (>= 3.12), compared only
        # after one (:func:`counted_writes`).
        self._always = _Values()
        self._counted = _Values()
        self._seen = -1
        self._sized: list[dict[Any, Any]] = []  # small dicts kept whole: their lengths too
        self._sizes: list[int] = []
        self._lists: list[list[Any]] = []  # small lists kept whole: compared with copies
        self._copies: list[list[Any]] = []
        self._whole: list[str] = []  # the paths of the dicts in _sized, then of the lists
        self.last = ""  # what the last call of changed() found
        for (_, key), (owner, where, attr) in found.items():
            if isinstance(owner, str):  # a global: its module's name
                path = f"global {attr!r} of {owner}"
            elif state.get(id(owner), (None,))[0] is owner:
                path = f"{state[id(owner)][1]}.{attr}"
            else:  # (made by the call)
                continue
            if key is None and type(where) is list:
                self._lists.append(where)
                self._copies.append(list(where))
                self._whole.append(path)
            elif key is None:  # a dict: each item, and its length
                self._sized.append(where)
                self._sizes.append(len(where))
                self._whole.insert(len(self._sized) - 1, path)
                for k, v in where.items():
                    self._always.add(where, k, v, f"{path}[{k!r}]")
            else:
                value = where.get(key, MISSING)  # (a dict or list held changes with no write)
                counted = not isinstance(owner, str) and _plain(value) and counted_writes(type(owner))
                (self._counted if counted else self._always).add(where, key, value, path)

    def __bool__(self) -> bool:
        return bool(self._always.values or self._counted.values or self._lists)

    def changed(self) -> bool:
        """Does a value differ from the capture's (then :attr:`last` says which)?"""
        if _DISARMED or self._seen != _EPOCH[0]:  # a module written since this graph compared
            if _DISARMED:
                _rearm()
            epoch = _EPOCH[0]  # (a write during the comparison marks its code again)
            said = self._counted.differs()
            if said:
                self.last = said
                return True
            self._seen = epoch
        said = self._always.differs()
        if said:
            self.last = said
            return True
        if self._sized and [*map(len, self._sized)] != self._sizes:
            for d, n, path in zip(self._sized, self._sizes, self._whole):
                if len(d) != n:
                    self.last = f"{path} holds {len(d)} items (at capture: {n})"
                    return True
        if self._lists and self._lists != self._copies:
            for lst, copy, path in zip(self._lists, self._copies, self._whole[len(self._sized):]):
                if lst != copy:
                    self.last = _said(path, copy, lst, whole=True)
                    return True
        return False

    def paths(self) -> list[str]:
        """What is watched (for tests and messages): each value's path, then each whole
        dict's and list's."""
        return list(dict.fromkeys(self._counted.paths + self._always.paths + self._whole))


class _Values:
    """Values in dicts: each dict, key, value at capture and path, in four lists, read per call
    in one ``map`` (25-50 ns a value)."""

    __slots__ = ("dicts", "keys", "values", "paths")

    def __init__(self) -> None:
        self.dicts: list[dict[Any, Any]] = []
        self.keys: list[Any] = []
        self.values: list[Any] = []
        self.paths: list[str] = []

    def add(self, d: dict[Any, Any], key: Any, value: Any, path: str) -> None:
        self.dicts.append(d)
        self.keys.append(key)
        self.values.append(value)
        self.paths.append(path)

    def differs(self) -> str:
        """What differs from the capture, said; ``""`` when nothing does. A list's ``==``
        tests identity before equality, item by item, in C."""
        if self.values and [*map(_get, self.dicts, self.keys, _MISSINGS)] != self.values:
            for d, key, value, path in zip(self.dicts, self.keys, self.values, self.paths):
                if not _same(d.get(key, MISSING), value):
                    return _said(path, value, d.get(key, MISSING))
        return ""


# The writes to the classes that hold watched values, seen by sys.monitoring (Python >= 3.12)
# once a graph watches such a value: a ``PY_RETURN`` event on their ``__setattr__`` and
# ``__delattr__`` code. The first write after a check turns its code's event off and marks it
# (:data:`_DISARMED`: a burst, ``model.train()``'s one write a module, costs one event); the
# next check of any graph turns the events back on and starts a new epoch (:data:`_EPOCH`)
# before it compares. So a check that finds nothing marked and the epoch it last compared in
# needs no comparison: nothing has been written since.
_EPOCH = [0]
_DISARMED: list[types.CodeType] = []
_LOCK = threading.Lock()  # (a write on one thread, a check on another)
_TOOL: list[int | None] = []  # the tool id claimed, or None where none is free
_COUNTED: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()  # (a test's class dies)
_TOOL_IDS = (4, 3)  # (sys.monitoring leaves 3 and 4 unassigned; 0-2 and 5 are the debugger's,
# coverage's, profilers' and optimizers')


def _on_write(code: types.CodeType, offset: int, value: Any) -> None:
    """A counted ``__setattr__`` returns, its write made: mark its code, and stop its events
    until the next check (after the mark: a check in between sees the mark)."""
    try:  # (never the user's write's failure: an event left on costs a little, no more)
        with _LOCK:
            if code not in _DISARMED:
                _DISARMED.append(code)
                sys.monitoring.set_local_events(_TOOL[0], code, 0)  # type: ignore[arg-type]
    except Exception:
        pass


def _rearm() -> None:
    """Before a comparison: the marked codes' events on again, then a new epoch (writes made
    while they were off are before it: every graph compares again)."""
    monitoring = sys.monitoring  # type: ignore[attr-defined]
    with _LOCK:
        for code in _DISARMED:
            monitoring.set_local_events(_TOOL[0], code, monitoring.events.PY_RETURN)
        _DISARMED.clear()
        _EPOCH[0] += 1


def counted_writes(cls: type) -> bool:
    """Are the writes to an instance of ``cls`` seen from now on (:data:`_EPOCH`)? True where
    ``cls.__setattr__`` and ``cls.__delattr__`` are Python code (``nn.Module``'s) and
    ``sys.monitoring`` has a free tool id; False where either is ``object``'s (plain objects, a
    Hugging Face config: their values are compared at every call) and on Python 3.11 and older.
    A write that goes around them (``m.__dict__[k] = v``) is not seen."""
    known = _COUNTED.get(cls)
    if known is not None:
        return known
    monitoring = getattr(sys, "monitoring", None)
    codes = [getattr(getattr(cls, name, None), "__code__", None) for name in ("__setattr__", "__delattr__")]
    counted = False
    if monitoring is not None and all(isinstance(code, types.CodeType) for code in codes):
        if not _TOOL:
            _TOOL.append(_claim(monitoring))
        tool = _TOOL[0]
        if tool is not None:
            try:
                with _LOCK:
                    for code in codes:  # (one marked now is turned on at the next check)
                        if code not in _DISARMED:
                            monitoring.set_local_events(tool, code, monitoring.events.PY_RETURN)
                counted = True
            except ValueError:  # (code monitoring refuses: compared at every call)
                pass
    _COUNTED[cls] = counted
    return counted


def _claim(monitoring: Any) -> int | None:
    for tool in _TOOL_IDS:
        try:
            monitoring.use_tool_id(tool, "torchreplay")
        except ValueError:  # (another tool holds it)
            continue
        monitoring.register_callback(tool, monitoring.events.PY_RETURN, _on_write)
        atexit.register(_release, monitoring, tool)
        return tool
    return None


def _release(monitoring: Any, tool: int) -> None:
    """At exit, before modules are torn down: no more events (a write in a finalizer would
    call into a half-gone module)."""
    try:
        monitoring.register_callback(tool, monitoring.events.PY_RETURN, None)
        monitoring.free_tool_id(tool)
    except Exception:
        pass


_get = dict.get
_MISSINGS = itertools.repeat(MISSING)


def _said(path: str, then: Any, now: Any, whole: bool = False) -> str:
    def text(v: Any) -> str:
        if not whole or v is MISSING:
            return show(v)
        r = repr(v)
        return r if len(r) <= 60 else r[:57] + "..."

    return f"{path} is {text(now)} (at capture: {text(then)})"
