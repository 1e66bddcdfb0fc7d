"""One call's arguments, flattened once.

Every step after the caller hands us ``(fn, args, kwargs)`` reads the same :class:`CallArgs`: the
device (:func:`infer_device`), the static input buffers (:class:`~torchreplay.core.io.Inputs`),
the many-size plan (:func:`torchreplay.sizes.plan.plan_inputs`) and the padded samples of a
many-size graph (:meth:`CallArgs.with_leaves`). The pytree walk, the key paths and the names used
in messages (``args[0] 'x'``, ``kwargs['mask']``) are computed here and nowhere else.

This is the lowest module of ``core/``: it imports nothing of torchreplay but ``_compat`` and
``errors``.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch

from torchreplay import _compat
from torchreplay.errors import CaptureError, UnsupportedError

__all__ = [
    "CallArgs", "ModuleGroup", "fn_name", "owning_module", "called_module", "roots_of", "infer_device",
    "param_names", "format_path",
]

_Tensor = torch.Tensor


def fn_name(fn: Callable[..., Any]) -> str:
    """A short name for ``fn`` in messages: ``'MLP'``, ``'decode_step'``."""
    if isinstance(fn, torch.nn.Module):
        return type(fn).__name__
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def owning_module(fn: Callable[..., Any]) -> torch.nn.Module | None:
    """The module whose state ``fn`` uses: ``fn`` itself, or the ``self`` of a bound method."""
    if isinstance(fn, torch.nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


def roots_of(modules: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """The modules that are not a submodule of another one in ``modules``, in their order."""
    if len(modules) < 2:
        return list(modules)
    inner: set[int] = set()
    for m in modules:
        for sub in m.modules():
            if sub is not m:
                inner.add(id(sub))
    return [m for m in modules if id(m) not in inner]


class ModuleGroup(torch.nn.Module):
    """The root modules a plain function ran at capture, seen as one module (never called).

    A graph over a module compares ``module.training`` with the capture's at every call, and
    walks ``module.modules()`` for its hooks and state. For a function that runs several models
    (an encoder and a head), this group stands for them: its ``training`` is the tuple of
    theirs, so the one comparison sees any of them switched between train and eval; each is
    a submodule, named by its class, so the walks and their messages cover them all.
    """

    def __init__(self, roots: Sequence[torch.nn.Module]) -> None:
        super().__init__()
        for i, m in enumerate(roots):
            name = type(m).__name__
            self.add_module(name if name not in self._modules else f"{name}_{i}", m)
        object.__setattr__(self, "_roots", tuple(roots))  # read per call: no module lookup

    @property  # type: ignore[override]
    def training(self) -> tuple[bool, ...]:  # type: ignore[override]
        return tuple([m.training for m in self.__dict__["_roots"]])

    @training.setter
    def training(self, mode: Any) -> None:  # nn.Module.__init__ and .train() set it: theirs count
        pass


def called_module(called: Sequence[torch.nn.Module]) -> torch.nn.Module | None:
    """What a graph over a plain function watches: the one root module among those it ran
    (``called``, in order), a :class:`ModuleGroup` of several, ``None`` when it ran none."""
    roots = roots_of(called)
    if not roots:
        return None
    return roots[0] if len(roots) == 1 else ModuleGroup(roots)


def param_names(fn: Callable[..., Any]) -> list[str]:
    """Positional parameter names of ``fn`` (for naming ``args[0]`` as ``x`` in messages)."""
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def format_path(path: Sequence[Any], names: Sequence[str]) -> str:
    """Format a pytree key path of ``(args, kwargs)`` as ``args[0] 'x'`` or ``kwargs['mode']``."""
    head, rest = path[0], path[1:]
    if getattr(head, "idx", 0) == 1:
        return "kwargs" + _compat.keystr(rest)
    text = "args" + _compat.keystr(rest)
    idx = getattr(rest[0], "idx", None) if rest else None
    if isinstance(idx, int) and idx < len(names):
        text += f" '{names[idx]}'"
    return text


class CallArgs:
    """The arguments of one call of ``fn``, flattened into leaves in a fixed order.

    Attributes:
        args, kwargs: the call as given.
        leaves: every pytree leaf of ``(args, kwargs)``, in flattening order.
        spec: the pytree structure that :meth:`unflatten` rebuilds.
        keypaths: each leaf's raw pytree key path (``sizes/plan.py`` matches ``dim=`` specs on it).
        paths: each leaf's name in messages: ``args[0] 'x'``, ``kwargs['cache'][1]``.
        names: ``fn``'s positional parameter names.
        nargs, kw_keys: the number of positional arguments and the keyword names, in call order.
    """

    __slots__ = ("args", "kwargs", "leaves", "spec", "keypaths", "paths", "names", "nargs", "kw_keys")

    def __init__(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        self.args = tuple(args)
        self.kwargs = dict(kwargs)
        self.names = param_names(fn)
        flat, spec = _compat.tree_flatten_with_path((self.args, self.kwargs))
        self.spec = spec
        self.keypaths = [p for p, _ in flat]
        self.leaves = [leaf for _, leaf in flat]
        self.paths = [format_path(p, self.names) for p in self.keypaths]
        self.nargs = len(self.args)
        self.kw_keys = tuple(self.kwargs)

    def unflatten(self, leaves: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Rebuild ``(args, kwargs)`` of this structure from ``leaves``."""
        return _compat.tree_unflatten(list(leaves), self.spec)

    def with_leaves(self, leaves: Sequence[Any]) -> CallArgs:
        """A :class:`CallArgs` of the same structure and names whose leaves are ``leaves``."""
        assert len(leaves) == len(self.leaves), "with_leaves needs one leaf per leaf"
        new = object.__new__(CallArgs)
        new.leaves = list(leaves)
        new.args, new.kwargs = self.unflatten(new.leaves)
        for name in ("spec", "keypaths", "paths", "names", "nargs", "kw_keys"):
            setattr(new, name, getattr(self, name))
        return new

    @property
    def tensor_indices(self) -> list[int]:
        """Positions in :attr:`leaves` of the tensor leaves."""
        return [i for i, leaf in enumerate(self.leaves) if isinstance(leaf, _Tensor)]

    def cuda_device(self) -> torch.device | None:
        """The device of the first CUDA tensor leaf, or None."""
        for leaf in self.leaves:
            if isinstance(leaf, _Tensor) and leaf.is_cuda:
                return leaf.device
        return None


def infer_device(
    fn: Callable[..., Any], call: CallArgs, device: torch.device | int | str | None = None
) -> torch.device:
    """Return the CUDA device a graph of ``fn`` runs on.

    ``device`` when given; else the device of the first CUDA tensor argument; else of the
    module's parameters and buffers.
    """
    if not torch.cuda.is_available():
        raise UnsupportedError(
            "CUDA is not available: torchreplay captures CUDA graphs and needs a CUDA device; "
            "on this machine use torchreplay.check(fn, *args) to see what would break capture"
        )
    if device is not None:
        d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if d.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {device!r}")
        return torch.device("cuda", d.index if d.index is not None else torch.cuda.current_device())
    found = call.cuda_device()
    if found is not None:
        return found
    module = owning_module(fn)
    if module is not None:
        for t in [*module.parameters(), *module.buffers()]:
            if t.is_cuda:
                return t.device
    raise CaptureError(
        f"'{fn_name(fn)}' gets no CUDA tensor (arguments and module state are all on the CPU); "
        "a graph of it would be empty. Move the module and its inputs to a CUDA device first, "
        "or pass device='cuda' for a function that creates its tensors itself"
    )
