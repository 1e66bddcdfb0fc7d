"""``tr.compile``: ``torch.compile`` with the torchreplay backend and its options, and the dynamic
dimension marked at the first call so that every size comes from one compile."""

from __future__ import annotations

import logging
import weakref
from typing import Any, Iterable, Sequence

import torch

from torchreplay import _compat
from torchreplay.compile.backend import Backend
from torchreplay.config import DEFAULT_CACHE_DIR, RANKS, CompileConfig, OutputPolicy, RankConfig

__all__ = ["Compiled", "compile"]

log = logging.getLogger(__name__)


class Compiled:
    """What :func:`compile` returns: call it like the model. ``.backend`` holds what was
    compiled (``tr.explain`` reads it); other attributes are the compiled module's."""

    def __init__(self, compiled: Any, backend: Backend) -> None:
        self.compiled = compiled
        self.backend = backend
        self._marked = backend.config.sizes is None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self._marked and self._mark(args, kwargs):
            with _compat.backed_size_oblivious():  # the first call is the one Dynamo traces
                return self.compiled(*args, **kwargs)
        return self.compiled(*args, **kwargs)

    def _mark(self, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
        """Make dimension ``dim`` of the tensor arguments dynamic from this first call; return
        whether the trace must not guard the size ``>= 2``.

        A size of 1 would be specialised by Dynamo (its 0/1 rule) and the next size would
        compile again; it is marked unbacked instead, which keeps it symbolic from the start.
        A first call of more rows is marked dynamic (backed), and when 1 is a size it is traced
        size-oblivious (:func:`~torchreplay._compat.backed_size_oblivious`): Dynamo would guard
        the size ``>= 2``, and a later 1-row call would compile again (on one rank of a
        tensor-parallel job: a second graph the other ranks never replay). Marking it unbacked
        there too was tried and reverted: on the built-in Llama the unbacked size does not reach
        the outputs, so padding is off and the model breaks into a second graph."""
        self._marked = True
        dim = self.backend.config.dim
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if not tensors or tensors[0].dim() <= dim:
            return False
        n = tensors[0].shape[dim]
        for t in tensors:
            if t.dim() > dim and t.shape[dim] == n:
                if n >= 2:
                    _compat.mark_dynamic(t, dim)
                else:
                    _compat.mark_unbacked(t, dim)
        return n >= 2 and 1 in (self.backend.config.sizes or ())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["compiled"], name)

    def __repr__(self) -> str:
        return f"torchreplay.Compiled({self.compiled!r})"


def compile(
    model: Any,
    *,
    sizes: Iterable[int] | None = None,
    dim: int = 0,
    splitting_ops: Sequence[Any] = (),
    inductor: bool = True,
    outputs: OutputPolicy = "checked",
    strict: bool = False,
    max_graphs: int = 16,
    num_warmup_iters: int = 3,
    fullgraph: bool = False,
    cache_dir: Any = DEFAULT_CACHE_DIR,
    cache_strict: bool = False,
    ranks: RankConfig | None = None,
    restore_state: bool = True,
) -> Compiled:
    """Compile ``model`` with ``torch.compile`` and run it as CUDA graphs, piece by piece.

    Args:
        model: an ``nn.Module`` or a function.
        sizes: sizes of dimension ``dim`` of the tensor arguments, all captured at the first call
            from one compile; a call pads to the next size and its outputs are sliced back.
        dim: the dynamic dimension (default 0, the batch).
        splitting_ops: ops run eagerly between graphs, e.g. ``["mylib.attention"]``.
        inductor: compile each piece with Inductor (``False``: the FX code as is).
        outputs: ``"checked"`` (default), ``"clone"`` or ``"static"``, as for ``tr.graph``.
        strict: a piece that fails to capture raises ``CaptureError``.
        max_graphs: without ``sizes``, the most shapes captured per graph.
        num_warmup_iters: eager runs of each piece before it is captured.
        fullgraph: passed to ``torch.compile``: a Dynamo graph break raises.
        cache_dir: the persistent compile cache: each piece's Inductor code is saved there and
            the next process loads it instead of compiling (the capture still runs). Default:
            ``$TORCHREPLAY_CACHE_DIR``, else ``~/.cache/torchreplay``; ``None`` turns it off.
            Manage it with ``torchreplay cache list|clear``.
        cache_strict: a bad cache entry raises ``CacheError`` instead of a warning and a
            compile as if there were no cache.
        ranks: a graph that holds ``torch.distributed`` collectives (a tensor-parallel model)
            makes its ranks agree before each replay, as ``tr.graph``'s do: with ``sizes``,
            every rank replays the size the largest call of any rank needs (its own rows
            padded), a call above the largest runs without graphs on every rank, and any other
            difference raises ``ReplayInputError`` on every rank instead of hanging in NCCL.
            A :class:`~torchreplay.config.RankConfig` changes how (``check=False``: no
            exchange; ``sync_sizes=True``: agree on sizes without a collective inside).
        restore_state: put back what the first call's warm-ups and captures write into the
            module's buffers (default; a buffer over 1 MiB the graph only reads is not copied).
            ``False``: written buffers over 1 MiB are not copied and keep those writes, for a
            KV cache too large to copy (each run writes what the call writes at its
            positions); wrong for a counter or a sum the call adds to.

    Returns:
        a :class:`Compiled` to call like ``model``.

    .. warning::
        Padding is correct only when rows are independent (see ``tr.graph(sizes=)``); the
        first call compares its rows padded and unpadded and logs a warning when they differ
        beyond rounding.
    """
    config = CompileConfig(
        sizes=tuple(sizes) if sizes is not None else None,
        dim=dim,
        splitting_ops=tuple(splitting_ops),
        inductor=inductor,
        outputs=outputs,
        strict=strict,
        max_graphs=max_graphs,
        num_warmup_iters=num_warmup_iters,
        cache_dir=cache_dir,
        cache_strict=cache_strict,
        ranks=ranks if ranks is not None else RANKS,
        restore_state=restore_state,
    )
    backend = _backend_for(model, config)
    return Compiled(torch.compile(model, backend=backend, fullgraph=fullgraph), backend)


# The backend of each module class (or function) and options that is still in use.
_BACKENDS: weakref.WeakValueDictionary[tuple[Any, CompileConfig], Backend] = weakref.WeakValueDictionary()


def _backend_for(model: Any, config: CompileConfig) -> Backend:
    """One backend per module class and options. Dynamo compiles the instances of one class
    once, their parameters passed as inputs, but only for one backend object: a backend each
    would compile each instance again, and past Dynamo's recompile limit (8) the rest of the
    blocks of a model compiled block by block would run eagerly. The runtimes keep graphs per
    instance (per set of parameter addresses), in training too (each forward graph's saved
    activations await their own backward)."""
    if not isinstance(model, torch.nn.Module):
        return Backend(config)
    owner = type(model)
    key = (owner, config)
    try:
        backend = _BACKENDS.get(key)
    except TypeError:  # an option that cannot be hashed: a backend of its own
        return Backend(config)
    if backend is None:
        backend = _BACKENDS[key] = Backend(config)
    return backend
