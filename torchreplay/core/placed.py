"""The module state a graph reads in place: it has to stay where the capture found it.

A CUDA graph reads a module's parameters and buffers at the addresses they had at capture, and
runs the submodules it found then. Moving or replacing them (``model.half()``, ``model.to(...)``,
``load_state_dict(sd, assign=True)``, ``module.weight = nn.Parameter(...)``, a tied weight,
``model.layers[3] = NewLayer()``, a parametrization or pruning registered afterwards) leaves the
graph reading the old memory and running the old code: the old weights, or, once that memory is
freed and handed out again, anything at all. Eagerly the next call would use the new ones. So a
graph over a module:

- holds the storages of the state it captured (:attr:`Placed.storages`): while the graph lives,
  that memory is not freed and handed to anyone else, so no replay reads freed memory, whatever
  the caller does;
- at each call compares two integers: the first parameter's address with the capture's (a model
  moved or converted as a whole, which torch does by ``p.data = ...`` without telling anyone),
  and a counter that torch's global registration hooks bump whenever a parameter, buffer or
  submodule is set on a watched module (:data:`CHANGES`). When either differs, the whole layout
  is compared with the capture's (every tensor's object and address, every submodule's object:
  tens of microseconds, once per change): anything replaced raises
  :class:`~torchreplay.ReplayInputError` naming it and the fix, never a result from the old
  weights; a registration that changed nothing the graph reads (a new buffer, the same module set
  again) is remembered and costs nothing more.

Comparing every address on every call would cost ~73 ns per tensor (23 us for ResNet-50's 320,
measured on the H200). So what is still not seen is a single tensor moved by ``p.data = new``
alone (no hook fires, the first parameter stays): the graph computes with that tensor's old value
(held, not freed). ``verify=`` in training sees it, and so does ``tr.compile``, whose runtime
gets the parameters as inputs, checks every address and captures again.

Updating weights in place (``load_state_dict(sd)``, ``p.copy_(new)`` under ``no_grad``, an
optimizer step) keeps every address and needs nothing.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch
from torch.nn.modules import module as _nn_module

from torchreplay.errors import ReplayInputError

__all__ = ["CHANGES", "GONE", "Placed"]

#: Bumped whenever a parameter, buffer or submodule is set on a module some graph watches: a
#: graph whose count is behind compares its whole layout at its next call.
CHANGES = [0]
#: The watched modules, by id, held weakly.
_WATCHED: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()
_HOOKED: list[Any] = []
#: What the per-call check reads when the first tensor's entry was deleted (``del
#: module.weight`` fires no hook): an empty tensor, at address 0, which no captured one has.
GONE = torch.empty(0)


def _registered(module: torch.nn.Module, name: str, value: Any) -> None:
    """torch's global registration hook: called before ``module.<name> = value`` lands."""
    if _WATCHED.get(id(module)) is module:
        CHANGES[0] += 1


def _watch(modules: Iterable[torch.nn.Module]) -> None:
    if not _HOOKED:  # once per process; the hooks return None, so they change nothing
        _HOOKED.extend(
            register(_registered)
            for register in (
                _nn_module.register_module_parameter_registration_hook,
                _nn_module.register_module_buffer_registration_hook,
                _nn_module.register_module_module_registration_hook,
            )
        )
    for m in modules:
        _WATCHED[id(m)] = m


def _walk(
    roots: list[torch.nn.Module], skip: set[int]
) -> list[tuple[str, torch.nn.Module]]:
    """``named_modules()`` of each root, each module once, without the subtrees in ``skip``."""
    out: list[tuple[str, torch.nn.Module]] = []
    seen = set(skip)
    stack = [("", m) for m in reversed(roots)]
    while stack:
        prefix, m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        out.append((prefix, m))
        dot = f"{prefix}." if prefix else ""
        stack.extend(
            (dot + k, c) for k, c in reversed(list(m._modules.items())) if c is not None
        )
    return out


class Placed:
    """Where a module's state was at capture, and which submodules it had.

    Each call runs :meth:`changed`, inlined: ``placed.seen != CHANGES[0] or
    placed.table.get(placed.key, GONE).data_ptr() != placed.at``, and only when that is true
    the whole comparison, :meth:`moved`. ``table`` is the ``_parameters`` (or ``_buffers``)
    dict of the submodule holding the first parameter (or buffer, where there is none), so
    ``.to()`` and ``p.data = ...`` on the whole model are seen without a hook.

    Args (of :meth:`of`):
        objects: a tensor replaced by another object over the same memory counts as a change
            too (training: gradients go to the objects the graphs were captured with).
    """

    __slots__ = ("table", "key", "at", "name", "storages", "seen", "_layout", "_objects", "_what")

    def __init__(
        self,
        table: dict[str, Any],
        key: str,
        name: str,
        storages: list[Any],
        layout: list[tuple[bool, dict[str, Any], str, Any, int, str]],
        objects: bool,
    ) -> None:
        self.table = table
        self.key = key
        self.at = table[key].data_ptr()
        self.name = name
        self.storages = storages
        self.seen = CHANGES[0]
        self._layout = layout
        self._objects = objects
        self._what = ""

    @classmethod
    def of(
        cls,
        module: torch.nn.Module | Iterable[torch.nn.Module] | None,
        device: torch.device,
        *,
        objects: bool = False,
        skip: Iterable[torch.nn.Module] = (),
    ) -> Placed | None:
        """The state of ``module`` (or of several root modules) on ``device`` (None: nothing
        to watch). ``skip``: submodules the graph does not read, with what is under them (the
        breaks of a breakable graph, which run eagerly: they may set their own state per call),
        neither compared nor watched; replacing one of them is still seen in its parent."""
        if module is None:
            return None
        roots = [module] if isinstance(module, torch.nn.Module) else list(module)
        device = torch.device(device)

        def on(t: Any) -> bool:
            d = t.device
            return d.type == device.type and device.index in (None, d.index) and t.numel() > 0

        subs = _walk(roots, {id(m) for m in skip})
        layout: list[tuple[bool, dict[str, Any], str, Any, int, str]] = []
        first: dict[str, tuple[dict[str, Any], str, str]] = {}
        for prefix, sub in subs:
            dot = f"{prefix}." if prefix else ""
            for key, child in sub._modules.items():
                layout.append((True, sub._modules, key, child, 0, dot + key))
            for kind in ("_parameters", "_buffers"):
                table = getattr(sub, kind)
                for key, t in table.items():
                    if t is not None and on(t):
                        layout.append((False, table, key, t, t.data_ptr(), dot + key))
                        first.setdefault(kind, (table, key, dot + key))
        if not first:
            return None
        table, key, name = first.get("_parameters") or first["_buffers"]
        storages = {}
        for is_module, _, _, t, _, _ in layout:
            if not is_module:
                s = t.untyped_storage()
                storages.setdefault(s.data_ptr(), s)
        _watch(m for _, m in subs)
        return cls(table, key, name, list(storages.values()), layout, objects)

    def changed(self) -> bool:
        """What each call checks (inlined there: this is that line)."""
        return (
            self.seen != CHANGES[0] or self.table.get(self.key, GONE).data_ptr() != self.at
        ) and self.moved()

    def moved(self) -> bool:
        """The slow check, after the fast one saw a change: is anything the graph reads
        elsewhere, or any submodule replaced? If not, the change is remembered as seen."""
        now = CHANGES[0]  # before comparing: a registration meanwhile is checked next call
        first = self.table.get(self.key)
        if not isinstance(first, torch.Tensor) or first.data_ptr() != self.at:
            self._what = self._tensor_change(self.name, first, self.at)
            return True
        for is_module, table, key, obj, ptr, name in self._layout:
            now_obj = table.get(key)
            if is_module:
                if now_obj is not obj:
                    gone = "removed" if now_obj is None else f"replaced by {type(now_obj).__name__}"
                    self._what = f"its submodule '{name}' was {gone}"
                    return True
            elif (
                not isinstance(now_obj, torch.Tensor)
                or now_obj.data_ptr() != ptr
                or (self._objects and now_obj is not obj)
            ):
                self._what = self._tensor_change(name, now_obj, ptr)
                return True
        self.seen = now
        return False

    @staticmethod
    def _tensor_change(name: str, now: Any, at: int) -> str:
        if not isinstance(now, torch.Tensor):
            return (
                f"its module's '{name}' is gone (now {now!r}: deleted, or a parametrization or "
                "pruning?)"
            )
        if now.data_ptr() == at:
            return f"its module's '{name}' is another tensor object over the same memory"
        return (
            f"its module's '{name}' is at another address than at capture (0x{at:x} then, "
            f"0x{now.data_ptr():x} now)"
        )

    def error(self, graph: str) -> ReplayInputError:
        if not self._what:
            self.moved()
        return ReplayInputError(
            f"'{graph}': {self._what or 'its module changed since capture'}: the model was "
            "moved, or its weights or submodules replaced (model.to()/.half(), "
            "load_state_dict(..., assign=True), module.weight = nn.Parameter(...), "
            "model.layer = ..., p.data = ...), and the graph reads the memory and runs the code "
            "it captured, so it would compute with the old ones. Load new weights in place "
            "(load_state_dict(sd) without assign=True, or p.copy_(new) under torch.no_grad()), "
            "or graph the model again (tr.compile captures again by itself)"
        )
