"""Frozen option dataclasses and their presets.

Options are never mutated; derive variants with :func:`dataclasses.replace`::

    cfg = dataclasses.replace(tr.config.SAFE, outputs="clone")
"""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

__all__ = [
    "GraphConfig", "OutputPolicy", "SAFE", "FAST", "DEBUG", "BucketConfig", "CompileConfig",
    "DEFAULT_CACHE_DIR", "RankConfig", "RANKS",
]

OutputPolicy = Literal["checked", "clone", "static"]
CaptureErrorMode = Literal["global", "thread_local", "relaxed"]

_OUTPUT_POLICIES = ("checked", "clone", "static")
_CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")
_CAPTURE_MODES = ("ahead", "lazy")
_FALLBACKS = ("eager", "error")


class _DefaultCacheDir:
    """The default of ``cache_dir``: resolved when a backend is made (compile/cache.py)."""

    def __repr__(self) -> str:
        return "<$TORCHREPLAY_CACHE_DIR, else ~/.cache/torchreplay>"


#: ``cache_dir``'s default: ``$TORCHREPLAY_CACHE_DIR``, else ``torchreplay`` in the user's cache.
DEFAULT_CACHE_DIR = _DefaultCacheDir()


@dataclasses.dataclass(frozen=True)
class GraphConfig:
    """How a graph is captured and how it hands out outputs.

    Args:
        num_warmup_iters: eager runs on the side stream before capture. They create per-stream
            library handles (cuBLAS, cuDNN) and let lazy initialisation happen outside capture.
        outputs: the output policy.
            ``"checked"`` (default): outputs share the graph's memory (zero-copy); once a later
            replay overwrites them, reading them raises an error that says so.
            ``"clone"``: every call returns fresh tensors (one device copy per output).
            ``"static"``: every call returns the graph's own output buffers, which the next replay
            overwrites without any check. Fastest; you keep the rule yourself.
        capture_error_mode: passed to ``torch.cuda.graph`` (``"global"``, ``"thread_local"`` or
            ``"relaxed"``); see its documentation.
        restore_state: snapshot a module's buffers and the RNG state before warm-up and put them
            back after capture, so that building a graph leaves the model as it found it.
            ``False``: nothing is put back; a breakable graph (``breaks=``) still puts back its
            buffers up to 1 MiB (each size's capture starts from them) but neither copies nor
            puts back larger ones (a KV cache that fills the device, which it would otherwise
            copy whole).
        diagnose: on a failed capture, run :func:`torchreplay.check` on the failing call to name
            the op and the user's line.
    """

    num_warmup_iters: int = 3
    outputs: OutputPolicy = "checked"
    capture_error_mode: CaptureErrorMode = "global"
    restore_state: bool = True
    diagnose: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.num_warmup_iters, int) or self.num_warmup_iters < 0:
            raise ValueError(
                f"num_warmup_iters must be an int >= 0, got {self.num_warmup_iters!r}; "
                "use at least 1 for models that call cuBLAS or cuDNN"
            )
        if self.outputs not in _OUTPUT_POLICIES:
            raise ValueError(
                f"outputs must be one of {_OUTPUT_POLICIES}, got {self.outputs!r}"
            )
        if self.capture_error_mode not in _CAPTURE_ERROR_MODES:
            raise ValueError(
                f"capture_error_mode must be one of {_CAPTURE_ERROR_MODES}, "
                f"got {self.capture_error_mode!r}"
            )


#: Safe by default: checked outputs, state restored, failures diagnosed.
SAFE = GraphConfig()
#: As fast as a hand-written graph: outputs are the static buffers, no checks on them.
FAST = GraphConfig(outputs="static", diagnose=False)
#: Fresh tensors every call; the simplest contract, one copy per output.
DEBUG = GraphConfig(outputs="clone")


@dataclasses.dataclass(frozen=True)
class BucketConfig:
    """Which sizes a many-size graph captures, when, and what happens to the other sizes.

    Args:
        sizes: the captured sizes of the varying dimension; stored sorted and without
            duplicates (``[8, 1, 4, 4]`` becomes ``(1, 4, 8)``).
        capture: ``"ahead"`` (default): every size at construction, largest first.
            ``"lazy"``: the largest size at construction, each other size the first time a call
            needs it. The largest comes first in both: the pool then grows to the largest size's
            blocks once and every smaller graph fits in them; captured smallest first, each
            larger size would add blocks that the smaller ones cannot reuse.
        fallback: what a call whose size no graph can hold does (above the largest size, or
            size 0): ``"eager"`` (default) runs it eagerly with one warning per new size,
            ``"error"`` raises :class:`~torchreplay.ReplayInputError`.
        max_graphs: at most this many graphs are held (``capture="lazy"`` only); a call that
            would need another one is handled by ``fallback``. ``None``: no cap.
    """

    sizes: tuple[int, ...]
    capture: Literal["ahead", "lazy"] = "ahead"
    fallback: Literal["eager", "error"] = "eager"
    max_graphs: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", _normalize_sizes(self.sizes))
        if self.capture not in _CAPTURE_MODES:
            raise ValueError(f"capture must be one of {_CAPTURE_MODES}, got {self.capture!r}")
        if self.fallback not in _FALLBACKS:
            raise ValueError(f"fallback must be one of {_FALLBACKS}, got {self.fallback!r}")
        if self.max_graphs is not None:
            if isinstance(self.max_graphs, bool) or not isinstance(self.max_graphs, int) or (
                self.max_graphs < 1
            ):
                raise ValueError(f"max_graphs must be an int >= 1 or None, got {self.max_graphs!r}")
            if self.capture == "ahead" and self.max_graphs < len(self.sizes):
                raise ValueError(
                    f"max_graphs={self.max_graphs} but capture='ahead' captures all "
                    f"{len(self.sizes)} sizes at once; pass fewer sizes, a larger max_graphs, "
                    "or capture='lazy'"
                )


def _normalize_sizes(sizes: object) -> tuple[int, ...]:
    """Return ``sizes`` as a sorted tuple of distinct ints >= 1; raise ``ValueError`` otherwise."""
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise ValueError(
            f"sizes must be a list of ints >= 1 (e.g. [1, 2, 4, 8]), got {sizes!r}; "
            "torchreplay.default_sizes(max_size) gives the usual ones"
        )
    items = list(sizes)  # type: ignore[call-overload]
    out: set[int] = set()
    for s in items:
        if isinstance(s, bool) or not hasattr(s, "__index__"):
            raise ValueError(f"sizes must be ints, got {s!r} in {items!r}")
        value = s.__index__()
        if value < 1:
            raise ValueError(
                f"sizes must be >= 1, got {value} in {items!r}; "
                "a call with 0 rows has nothing to replay"
            )
        out.add(value)
    if not out:
        raise ValueError(
            "sizes is empty: give at least one size to capture, e.g. "
            "sizes=torchreplay.default_sizes(512), or sizes=None for one shape"
        )
    return tuple(sorted(out))


@dataclasses.dataclass(frozen=True)
class RankConfig:
    """How the ranks of a process group agree before they replay graphs that hold collectives.

    NCCL needs every rank to launch the same collectives in the same order: one rank that
    replays another size, runs eagerly or skips a call makes the others wait forever. When a
    graph holds a ``torch.distributed`` collective (or ``sync_sizes``/``group`` is given), each
    call first exchanges a few numbers with the other ranks of ``group``, on the host, outside
    the graph: through shared memory when the ranks share a host (a few us), else through the
    process group's store.

    Args:
        group: the process group to agree in. ``None``: the group of the graph's collectives
            (the default group when they use several).
        sync_sizes: with ``sizes=``: every rank replays the size that holds the largest call of
            any rank (its own rows padded up to it), and a call above the largest size runs
            eagerly on every rank or on none. ``None`` (default): on when the graph holds a
            collective.
        check: compare before every replay what each rank is about to run (a fingerprint of the
            captured collectives and sizes, the size, graph or eager) and raise
            :class:`~torchreplay.ReplayInputError` on every rank when they differ. ``False``:
            no exchange at all (and no ``sync_sizes``) once a job is trusted; a rank that
            then replays something else hangs in NCCL.
        timeout: seconds one rank waits at the exchange for the others before it raises
            (naming the graph, the call and the ranks that did not come); and, for graphs
            that hold collectives, the longest the GPU work up to an agreed call may stay
            unfinished (a rank died after the agreement) before ``on_hang`` applies.
        on_hang: a replay still unfinished after ``timeout`` seconds is reported (graph, call,
            what each rank posted last) by a watcher thread, which then ends the process
            (``"exit"``, default, exit code 3: as NCCL's watchdog ends a process whose
            collective timed out; a collective replayed from a graph is invisible to it, and
            would hang forever) or only logs it (``"warn"``).
    """

    group: object = None
    sync_sizes: bool | None = None
    check: bool = True
    timeout: float = 600.0
    on_hang: str = "exit"

    def __post_init__(self) -> None:
        if self.sync_sizes not in (None, True, False):
            raise ValueError(f"sync_sizes must be None, True or False, got {self.sync_sizes!r}")
        if not isinstance(self.timeout, (int, float)) or isinstance(self.timeout, bool) or (
            self.timeout <= 0
        ):
            raise ValueError(f"timeout must be a number of seconds > 0, got {self.timeout!r}")
        if self.sync_sizes and not self.check:
            raise ValueError(
                "sync_sizes=True needs check=True: the sizes are agreed in the same exchange"
            )
        if self.on_hang not in ("exit", "warn"):
            raise ValueError(f"on_hang must be 'exit' or 'warn', got {self.on_hang!r}")


#: Ranks agree through the group of the graph's collectives, sizes synced, 600 s timeout (NCCL's own default watchdog timeout).
RANKS = RankConfig()


@dataclasses.dataclass(frozen=True)
class CompileConfig:
    """Options of the ``torch.compile`` backend (``tr.compile``, or ``options=`` of
    ``torch.compile(model, backend="torchreplay", options={...})``).

    Args:
        sizes: padded sizes of the dynamic dimension, all captured at the first call (largest
            first); a call pads to the next one. ``None``: each new shape is captured on its first
            call, up to ``max_graphs``.
        dim: the dimension of the first tensor argument that ``sizes`` counts (default 0).
        splitting_ops: ops that run eagerly between graphs (``"mylib.attention"``, an op object).
        inductor: compile each piece with Inductor; ``False``: the FX code as is.
        outputs: the output policy (see :class:`GraphConfig`).
        strict: a piece that fails to capture raises ``CaptureError`` instead of running
            ungraphed with a warning.
        max_graphs: without ``sizes``, the most shapes captured per compiled graph.
        num_warmup_iters: eager runs of each piece before its capture.
        cache_dir: the folder of the persistent compile cache (each piece's Inductor code,
            loaded by the next process instead of compiled). Default: ``$TORCHREPLAY_CACHE_DIR``,
            else ``torchreplay`` under ``$XDG_CACHE_HOME`` or ``~/.cache``; ``None``: no cache.
        ranks: how the ranks of a process group agree before replays of graphs that hold
            collectives (:class:`RankConfig`; with ``sizes``, ``sync_sizes`` pads every rank to
            the largest call of any rank).
        cache_strict: a bad cache entry or an unusable folder raises ``CacheError`` instead of
            one warning and a compile as if there were no cache.
        restore_state: put back, after the first call's warm-ups and captures, what they wrote
            into the module's buffers (copies made before them; a buffer over 1 MiB the graph
            only reads is not copied). ``False``: written buffers over 1 MiB
            are not copied and keep those writes: right for a KV cache that the call writes at
            its positions (each run writes what the call writes) and too large to copy, wrong
            for a counter or a sum the call adds to.
    """

    sizes: tuple[int, ...] | None = None
    dim: int = 0
    splitting_ops: tuple[object, ...] = ()
    inductor: bool = True
    outputs: OutputPolicy = "checked"
    strict: bool = False
    max_graphs: int = 16
    num_warmup_iters: int = 3
    cache_dir: str | os.PathLike[str] | _DefaultCacheDir | None = DEFAULT_CACHE_DIR
    cache_strict: bool = False
    ranks: RankConfig = RANKS
    restore_state: bool = True

    def __post_init__(self) -> None:
        if self.sizes is not None:
            object.__setattr__(self, "sizes", _normalize_sizes(self.sizes))
        if not (self.cache_dir is None or isinstance(self.cache_dir, (str, os.PathLike, _DefaultCacheDir))):
            raise ValueError(f"cache_dir must be a path or None, got {self.cache_dir!r}")
        ops = self.splitting_ops
        object.__setattr__(self, "splitting_ops", (ops,) if isinstance(ops, str) else tuple(ops))
        if not isinstance(self.ranks, RankConfig):
            raise ValueError(f"ranks must be a RankConfig, got {self.ranks!r}")
        if self.outputs not in _OUTPUT_POLICIES:
            raise ValueError(f"outputs must be one of {_OUTPUT_POLICIES}, got {self.outputs!r}")
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 0:
            raise ValueError(f"dim must be an int >= 0, got {self.dim!r}")
        if isinstance(self.max_graphs, bool) or not isinstance(self.max_graphs, int) or self.max_graphs < 1:
            raise ValueError(f"max_graphs must be an int >= 1, got {self.max_graphs!r}")
        if not isinstance(self.num_warmup_iters, int) or self.num_warmup_iters < 0:
            raise ValueError(f"num_warmup_iters must be an int >= 0, got {self.num_warmup_iters!r}")
        if not isinstance(self.restore_state, bool):
            raise ValueError(f"restore_state must be True or False, got {self.restore_state!r}")

    def graph_config(self) -> GraphConfig:
        """The per-piece capture options."""
        return GraphConfig(num_warmup_iters=self.num_warmup_iters, outputs=self.outputs,
                           restore_state=self.restore_state)
