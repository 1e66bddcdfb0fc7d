"""The module state a graph reads in place: it has to stay where the capture found it.

A CUDA graph reads a module's parameters and buffers at the addresses they had at capture. Moving
them (``model.half()``, ``model.to(...)``, ``load_state_dict(sd, assign=True)``, a new
``nn.Parameter``, ``p.data = new`` for each weight) leaves the graph reading the old memory: the
old weights, or, once that memory is freed and handed out again, anything at all. Eagerly the
next call would use the new weights. So a graph over a module:

- holds the storages of the state it captured (:attr:`Placed.storages`): while the graph lives,
  that memory is not freed and handed to anyone else, so no replay reads freed memory, whatever
  the caller does;
- at each call compares the first parameter's address with the capture's (one ``data_ptr()``,
  a tenth of a microsecond; every address would cost ~73 ns per tensor, 23 us for ResNet-50's
  320, measured on the H200): a model moved or reloaded as a whole raises
  :class:`~torchreplay.ReplayInputError` naming the tensor and the fix, never a result from the
  old weights. One tensor replaced in the middle of the model is not seen per call: the graph
  computes with its old value (held, not freed). ``verify=`` in training sees it, and so does
  ``tr.compile``, whose runtime gets the parameters as inputs, checks every address and
  captures again.

Updating weights in place (``load_state_dict(sd)``, ``p.copy_(new)`` under ``no_grad``, an
optimizer step) keeps every address and needs nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from torchreplay.errors import ReplayInputError

__all__ = ["Placed"]


class Placed:
    """Where a module's state was at capture. Each call compares ``table[key].data_ptr()``
    with ``at``: ``table`` is the ``_parameters`` (or ``_buffers``) dict of the submodule
    holding the first parameter (or buffer, where there is none), so a new tensor object put
    there (``load_state_dict(..., assign=True)``, ``module.weight = nn.Parameter(...)``) is
    seen as well as one moved in place (``.to()``, ``p.data = ...``)."""

    __slots__ = ("table", "key", "at", "name", "storages")

    def __init__(self, table: dict[str, Any], key: str, name: str, storages: list[Any]) -> None:
        self.table = table
        self.key = key
        self.at = table[key].data_ptr()
        self.name = name
        self.storages = storages

    @classmethod
    def of(cls, module: torch.nn.Module | None, device: torch.device) -> Placed | None:
        """The state of ``module`` on ``device`` (None: nothing to watch)."""
        if module is None:
            return None
        device = torch.device(device)

        def on(t: Any) -> bool:
            d = t.device
            return d.type == device.type and device.index in (None, d.index) and t.numel() > 0

        state = [t for t in (*module.parameters(), *module.buffers()) if on(t)]
        if not state:
            return None
        for kind in ("_parameters", "_buffers"):
            for prefix, sub in module.named_modules():
                table = getattr(sub, kind)
                for key, t in table.items():
                    if t is not None and on(t):
                        name = f"{prefix}.{key}" if prefix else key
                        return cls(table, key, name, [t.untyped_storage() for t in state])
        return None

    def moved(self) -> bool:
        """What each call checks (inlined there): is the first tensor elsewhere now?"""
        return self.table[self.key].data_ptr() != self.at

    def error(self, graph: str) -> ReplayInputError:
        now = self.table.get(self.key)
        where = f"0x{now.data_ptr():x}" if isinstance(now, torch.Tensor) else repr(now)
        return ReplayInputError(
            f"'{graph}': its module's '{self.name}' is at another address than at capture "
            f"(0x{self.at:x} then, {where} now): the model was moved or its "
            "weights replaced (model.to()/.half(), load_state_dict(..., assign=True), "
            "p.data = ...), and the graph reads the memory it captured, so it would compute "
            "with the old weights. Load new weights in place (load_state_dict(sd) without "
            "assign=True, or p.copy_(new) under torch.no_grad()), or graph the model again "
            "(tr.compile captures again by itself)"
        )
