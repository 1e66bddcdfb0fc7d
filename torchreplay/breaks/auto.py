"""``breaks="auto"``: find what cannot be captured and the module to break at around each.

One eager run of the call under :func:`torchreplay.check.check_call` sees every op that would break
capture (a host read such as ``.item()``, a data-dependent shape such as ``nonzero``, a copy from
the host), with the user's ``file:line``; while it runs, every submodule's ``forward`` keeps a
stack of the modules being called. Each finding breaks at the innermost module around it whose
outputs keep their shapes (every size of its outputs is a size of its inputs or of its own
parameters and buffers: a ``nonzero``'s count is neither), so that the graph after the break can
read its outputs at fixed addresses. A finding in the model's own top-level code has no module to
break at: that is a :class:`~torchreplay.errors.CaptureError` naming it and the fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn as nn

from torchreplay import _compat
from torchreplay.check import NO_CUDA_OP, check_call
from torchreplay.core.args import CallArgs, owning_module
from torchreplay.config import GraphConfig
from torchreplay.core.capture import capture, on_side_stream, side_stream
from torchreplay.core.constants import DeviceConstants
from torchreplay.core.failures import failed_lines
from torchreplay.core.generators import Draws, remember
from torchreplay.core.pool import Pool
from torchreplay.core.snapshot import StateSnapshot
from torchreplay.errors import CaptureError

__all__ = ["AutoBreak", "find_breaks", "find_on_copies", "suggestion", "suggest"]


@dataclasses.dataclass(frozen=True)
class AutoBreak:
    """A module ``breaks="auto"`` chose, and the first finding that made it a break."""

    path: str
    module: nn.Module = dataclasses.field(repr=False, compare=False)
    op: str = ""
    kind: str = ""
    where: str = ""

    def __str__(self) -> str:
        return f"{self.path} ({type(self.module).__name__}): {self.op} ({self.kind}) at {self.where}"


def _sizes(values: Any) -> set[int]:
    out: set[int] = set()
    for leaf in _compat.tree_flatten(values)[0]:
        if isinstance(leaf, torch.Tensor):
            out.update(int(d) for d in leaf.shape)
    return out


@dataclasses.dataclass(frozen=True)
class _Hit:
    """A finding: the op, its kind, the user's ``file:line``, the modules around it (outermost
    first), and how many module calls had begun when it happened (its place in the call)."""

    op: str
    kind: str
    where: str
    around: tuple[nn.Module, ...]
    entered: int


@dataclasses.dataclass(frozen=True)
class Failed:
    """Where a trial capture failed: each user frame's ``file:line`` (innermost first), the
    error's first line."""

    lines: tuple[str, ...]
    message: str


class _Modules:
    """Each submodule's ``forward`` wrapped while a call runs: the stack of modules being called,
    how many calls began, which modules' outputs kept their shapes (every size of its outputs is
    a size of its inputs or of its own parameters and buffers), and the stack where an error was
    first raised."""

    def __init__(self, named: Sequence[tuple[str, nn.Module]]) -> None:
        self.named = named
        self.stack: list[nn.Module] = []
        self.entered = 0
        self.keeps: dict[int, bool] = {}
        self.raised: tuple[tuple[nn.Module, ...], int] | None = None

    def _wrap(self, m: nn.Module, undo: list[Callable[[], None]]) -> None:
        had = "forward" in m.__dict__
        original = m.forward

        def forward(*a: Any, **k: Any) -> Any:
            self.stack.append(m)
            self.entered += 1
            try:
                out = original(*a, **k)
            except BaseException:
                if self.raised is None:
                    self.raised = (tuple(self.stack), self.entered)
                raise
            finally:
                self.stack.pop()
            own = {int(d) for t in [*m.parameters(), *m.buffers()] for d in t.shape}
            ok = _sizes(out) <= _sizes((a, k)) | own | {1}
            self.keeps[id(m)] = self.keeps.get(id(m), True) and ok
            return out

        m.forward = forward  # type: ignore[method-assign]
        undo.append(lambda: setattr(m, "forward", original) if had else delattr(m, "forward"))

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        self.entered, self.raised = 0, None
        undo: list[Callable[[], None]] = []
        try:
            for _, m in self.named:
                self._wrap(m, undo)
            yield
        finally:
            for u in reversed(undo):
                u()


def find_breaks(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any],
    trial: Callable[[bool], Failed | None] | None = None, draws: Draws | None = None,
) -> list[AutoBreak]:
    """Run ``fn(*args, **kwargs)`` once, eagerly, under the check, and return the modules to break
    at, in the order their first finding happened (none when nothing would break capture).

    ``trial(constants)``, when given, captures the call once and says where that failed (see
    :func:`_met_by_capture`); it runs only when the check found something a capture fails at,
    with host constants made by kernels where the check saw one made (``lift_fresh``), as a
    build whose warm-up saw one captures.

    Raises:
        CaptureError: a finding outside every submodule (in the top-level code itself).
    """
    root = owning_module(fn)
    named = [(p, m) for p, m in root.named_modules() if m is not root] if root is not None else []
    modules = _Modules(named)
    hits: list[_Hit] = []

    def on_finding(op: str, kind: str, filename: str, lineno: int) -> None:
        if op != NO_CUDA_OP:
            hits.append(_Hit(op, kind, f"{filename}:{lineno}", tuple(modules.stack), modules.entered))

    with modules.watching(), draws.watch(compare=False) if draws is not None else contextlib.nullcontext():
        check_call(fn, tuple(args), dict(kwargs), on_finding=on_finding)
    if trial is not None and any(h.kind in _FAILS for h in hits):
        with modules.watching():
            failed = trial(any(h.op in _LIFTS for h in hits))
        hits = _met_by_capture(hits, failed, modules.raised)
    paths = {id(m): p for p, m in named}
    chosen: dict[int, AutoBreak] = {}
    for h in hits:
        module = next((m for m in reversed(h.around) if modules.keeps.get(id(m), False)), None)
        if module is None:
            raise CaptureError(
                f'breaks="auto": {h.op} ({h.kind}) at {h.where} cannot be captured and runs '
                "outside every submodule whose outputs keep their shapes, so there is nothing to "
                "break at; move it into a function or module and name that in breaks=[...], or "
                "keep it out of the graphed call"
            )
        # What only the capture met: every module of its class, as the next call of it fails too
        # (not of torch's own containers and layers, which any model has many of).
        alike = [m for _, m in named if type(m) is type(module) and modules.keeps.get(id(m), False)] \
            if h.kind == CAPTURE_FAILED and not type(module).__module__.startswith("torch.") else [module]
        for m in alike:
            if id(m) not in chosen:
                chosen[id(m)] = AutoBreak(paths[id(m)], m, h.op, h.kind, h.where)
    return list(chosen.values())


# What a capture fails at (a host read, a data-dependent size, a copy from pageable host
# memory). The other findings (a pinned copy, the CPU's RNG) freeze a value silently: they break
# whether or not a capture fails.
_FAILS = ("host-sync", "dynamic-shape", "host-to-device")
#: the kind of a finding that only the trial capture met (an op that syncs inside its kernel)
CAPTURE_FAILED = "capture failed"
# The check's name of the op that makes a tensor from Python data (core/constants.py).
_LIFTS = ("aten.lift_fresh", "aten.lift_fresh_copy")


def _met_by_capture(
    hits: list[_Hit], failed: Failed | None, raised: tuple[tuple[nn.Module, ...], int] | None
) -> list[_Hit]:
    """The findings a capture of the call does not pass. The check runs the call eagerly, and
    code that asks whether a capture is running (transformers' ``is_tracing`` in its mask
    functions) takes a data-dependent test there that it skips under capture: a break at it
    would run the whole model eagerly. So a trial capture runs, under the same module watch.

    - It captured whole (``failed`` None): no finding of a failing kind is met; dropped.
    - It failed: the findings of a failing kind made before the failure's module call began
      (``raised``: the modules around the error, and how many calls had begun) were passed, and
      are dropped, unless one is at a line where it failed. When no finding is at those lines,
      the check did not see what failed (an op that syncs inside its kernel): the failure is a
      finding of its own, in the modules around it."""
    if failed is None:
        return [h for h in hits if h.kind not in _FAILS]
    lines = set(failed.lines)
    around, entered = raised if raised is not None else ((), 0)
    kept = [h for h in hits if h.kind not in _FAILS or h.where in lines or h.entered >= entered]
    if failed.lines and around and not any(h.where in lines for h in hits):
        kept.append(_Hit(failed.message, CAPTURE_FAILED, failed.lines[0], around, entered))
        kept.sort(key=lambda h: h.entered)
    return kept


def _trial(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], device: torch.device,
    constants: bool, gens: Sequence[torch.Generator] = (),
) -> Failed | None:
    """Capture the call once (no warm-up: the check just ran it), into a pool of its own that
    goes with the graph, with host constants made by kernels where ``constants``
    (core/constants.py), registering the CUDA generators ``gens`` the check's run drew from
    (unregistered, the first draw from one fails the capture: a break where none is needed);
    None when it captured."""
    def call(*a: Any, **k: Any) -> Any:
        with DeviceConstants() if constants else contextlib.nullcontext():
            return fn(*a, **k)

    remember(call, list(gens))  # (what a capture without warm-ups registers)

    try:
        captured = capture(call, tuple(args), dict(kwargs), device=device, stream=side_stream(device),
                           pool=Pool(device), config=GraphConfig(diagnose=False), warmup=False,
                           collectives=False, host_draws=False)
    except CaptureError as exc:
        lines, message = failed_lines(exc)
        return Failed(tuple(lines), message)
    graphs = [g for g in captured.graphs if g is not None]
    del captured  # (its outputs are in the pool)
    for g in graphs:
        g.reset()
    del graphs
    torch.cuda.empty_cache()  # the pool's memory back to the device, as for any dropped graph
    return None


def suggestion(found: Sequence[AutoBreak]) -> str:
    """``breaks=[Attention]`` (a class when several instances of it were chosen), else
    ``model.get_submodule('path')``."""
    by_class: dict[type, list[AutoBreak]] = {}
    for b in found:
        by_class.setdefault(type(b.module), []).append(b)
    names = []
    for cls, chosen in by_class.items():
        names.append(cls.__name__ if len(chosen) > 1 else f"model.get_submodule({chosen[0].path!r})")
    return "breaks=[" + ", ".join(names) + ']' if names else ""


def find_on_copies(fn: Callable[..., Any], call: CallArgs, device: torch.device) -> list[AutoBreak]:
    """:func:`find_breaks` on copies of the call's tensors, on the device's side stream, without
    gradients; module state (buffers, RNG) is put back after."""
    with torch.no_grad():
        leaves = [x.clone() if isinstance(x, torch.Tensor) else x for x in call.leaves]
    a, k = call.unflatten(leaves)
    module = owning_module(fn)
    snapshot = StateSnapshot(module, device, find=module is None)  # a function's: as they run
    draws = snapshot.draws  # (the generators the run draws from: the module's own, the arguments)
    draws.keep(call.leaves)  # (a generator argument, put back though no op draws from it)
    try:
        with on_side_stream(side_stream(device), device), torch.no_grad(), snapshot.running():
            return find_breaks(fn, a, k, draws=draws,
                               trial=lambda constants: _trial(fn, a, k, device, constants, draws.generators))
    finally:
        snapshot.restore()


def suggest(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], device: torch.device) -> str:
    """For the message of a failed capture: the ``breaks=`` that would graph the rest, or ``""``
    when none would."""
    try:
        found = find_on_copies(fn, CallArgs(fn, args, kwargs), device)
    except Exception:  # noqa: BLE001 - a suggestion must not hide the capture's own error
        return ""
    if not found:
        return ""
    where = "; ".join(str(b) for b in found[:3]) + ("; ..." if len(found) > 3 else "")
    return (
        f'. To graph everything around what cannot be captured: tr.graph(..., {suggestion(found)})'
        f' or breaks="auto" (it would break at {where})'
    )
