"""``tr.explain``: what a graphed callable or a compiled model did, as text.

For a compiled model: each graph Dynamo handed over, its pieces (graphed, or eager with the op,
the reason and the user's file:line), the sizes captured, hits and padding per size, captures,
fallbacks with their reasons, compile and capture seconds, pool memory. Compiled graphs that
hold no CUDA graph (their inputs were on the CPU, say) are counted and said so.
"""

from __future__ import annotations

from typing import Any

import torch

from torchreplay import _compat
from torchreplay.compile.api import Compiled
from torchreplay.compile.backend import Backend, runtimes_by_name
from torchreplay.distributed import describe
from torchreplay.pieces.entries import ways_in
from torchreplay.pieces.runtime import PiecewiseRuntime
from torchreplay.training.callables import Launchless
from torchreplay.training.graphed_callable import GraphedCallable

__all__ = ["explain", "piece_line"]


def explain(obj: Any) -> str:
    """Return a report of what ``obj`` (a ``tr.compile`` result, a backend, a graph) did.

    Args:
        obj: what ``tr.compile`` returned, or its ``.backend`` (a
            :class:`~torchreplay.compile.backend.Backend`), one of its compiled graphs, or what
            ``tr.graph`` (breakable graphs included), ``tr.graph_step`` or
            ``tr.make_graphed_callables`` returned.

    Raises:
        TypeError: ``obj`` is none of those.
    """
    if isinstance(obj, Compiled):
        obj = obj.backend
    if isinstance(obj, Backend):
        return _backend(obj)
    target = _compat.compiled_target(obj)
    if target is not None:  # torch.compile(model, backend="torchreplay")
        return _by_name(target)
    if isinstance(obj, PiecewiseRuntime):
        return _runtime(obj)
    own = getattr(obj, "explain", None)
    if callable(own):  # a breakable graph (tr.graph(..., breaks=)) reports itself
        return str(own()) + _ranks(obj) + _values(obj)
    stats = getattr(obj, "stats", None)
    if stats is not None and hasattr(stats, "explain"):
        return f"{obj!r}\n  {stats.explain()}{_ranks(obj)}{_values(obj)}"
    if isinstance(obj, torch.nn.Module):  # tr.make_graphed_callables(model, ...), breaks= or not
        forward = obj.__dict__.get("forward")
        if callable(getattr(forward, "explain", None)):  # graphed around its breaks
            return str(forward.explain()) + _values(forward)
        graphed = [
            (path, m.__dict__["forward"]) for path, m in obj.named_modules()
            if isinstance(m.__dict__.get("forward"), (GraphedCallable, Launchless))
        ]
        if graphed:
            return _graphed_modules(obj, graphed)
    raise TypeError(
        f"tr.explain takes what tr.compile, tr.graph, tr.graph_step or "
        f"tr.make_graphed_callables returned (or torch.compile(..., backend='torchreplay')), "
        f"got {type(obj).__name__}"
    )


def _by_name(target: Any) -> str:
    """The graphs ``torch.compile(target, backend="torchreplay")`` made: for a module, those
    that read its parameters or buffers; for a function, every one of the process."""
    runtimes = runtimes_by_name()
    if isinstance(target, torch.nn.Module):
        mine = {t.data_ptr() for t in (*target.parameters(), *target.buffers())}
        runtimes = [r for r in runtimes if mine.intersection(r.static_ptrs())]
        whose = f"{type(target).__name__}"
    else:
        whose = f"{getattr(target, '__name__', 'the function')} (a function: every graph of the process)"
    head = (
        f"torch.compile(backend='torchreplay') of {whose}: {len(runtimes)} graph(s) with CUDA "
        "graphs, each with a pool of its own (tr.compile shares one, and keeps the compile "
        "cache's report)"
    )
    if not runtimes:
        head += (
            "\n  none yet: call it once on CUDA inputs (graphs without CUDA inputs run "
            "without CUDA graphs)"
        )
    return "\n".join([head, *(_runtime(r) for r in runtimes)])


def _graphed_modules(model: torch.nn.Module, graphed: list[tuple[str, GraphedCallable | Launchless]]) -> str:
    """A module whose forward, or whose submodules' forwards, ``tr.make_graphed_callables``
    replaced: each graphed one with its counters; the rest runs eagerly."""
    if graphed[0][0] == "":
        return f"{graphed[0][1]!r}\n  {graphed[0][1].stats.explain()}{_ranks(graphed[0][1])}"
    head = (
        f"{type(model).__name__}: {len(graphed)} submodule(s) graphed for training (forward and "
        "backward, one pool); its own code and the rest run eagerly"
    )
    lines = [
        f"  {path} ({type(r.fn).__name__}): "
        + (Launchless.WHY if isinstance(r, Launchless) else r.stats.explain())
        for path, r in graphed
    ]
    return "\n".join([head, *lines])


def _values(obj: Any, most: int = 8) -> str:
    """The plain Python values the graph's code read at capture, watched at each call
    (core/frozen.py; "" when none)."""
    reads = getattr(obj, "_reads", None)
    values = getattr(reads, "values", None)
    if not values:
        return ""
    paths = values.paths()
    more = f", and {len(paths) - most} more" if len(paths) > most else ""
    return (
        f"\n  watches {len(paths)} plain Python value(s) its code read at capture (a call while "
        f"one differs runs eagerly): {', '.join(paths[:most])}{more}"
    )


def _ranks(obj: Any) -> str:
    """The collectives a graph holds and how its ranks agree ("" when it holds none)."""
    collectives = getattr(obj, "collectives", None)
    if not collectives:
        return ""
    agreement = getattr(obj, "_ranks", None)
    how = repr(agreement) if agreement is not None else (
        "no agreement (one rank, or RankConfig(check=False))"
    )
    return f"\n  collectives: {describe(collectives)}\n  ranks: {how}"


def _backend(backend: Backend) -> str:
    runtimes = backend.runtimes
    cfg = backend.config
    head = (
        f"torchreplay: {backend.compiles} graph(s) compiled in {backend.compile_seconds:.2f} s"
        f" (options: sizes={list(cfg.sizes) if cfg.sizes else None}, "
        f"splitting_ops={list(cfg.splitting_ops)}, inductor={cfg.inductor})"
    )
    lines = [head, *_cache(backend), *(_runtime(r) for r in runtimes)]
    if backend.compiles == 0:
        lines.append("  nothing compiled yet: call the compiled model once, then explain it")
    elif len(runtimes) < backend.compiles:
        # The backend keeps (weakly) only the graphs it runs as CUDA graphs.
        lines.append(
            f"  {backend.compiles - len(runtimes)} graph(s) without CUDA graphs: their inputs are "
            "on the CPU, or they run ungraphed for a reason the log gives (torchreplay -v, or "
            "logging at INFO), or they were freed"
        )
    return "\n".join(lines)


def _cache(backend: Backend) -> list[str]:
    """What the compile cache did: hits and what they saved, misses, bad entries."""
    cache = backend.cache
    if not backend.config.inductor:
        return []  # nothing compiled, nothing to cache
    if cache is None:
        return ["  compile cache: off (cache_dir=None, or this torch has no standalone_compile)"]
    outcomes = cache.outcomes
    hits = [o for o in outcomes if o.status == "hit"]
    head = f"  compile cache: {cache.directory}: {len(hits)} hit(s) of {len(outcomes)} piece(s)"
    if hits:
        loaded = sum(o.seconds for o in hits)
        saved = sum(o.saved_seconds for o in hits)
        head += f", loaded in {loaded:.2f} s instead of compiled in {saved:.2f} s"
    lines = [head]
    if backend.training_compiles:
        lines.append(
            f"    {backend.training_compiles} training graph(s): not in this cache (torch's own "
            "Inductor caches apply)"
        )
    lines.extend(f"    {o.line()}" for o in outcomes)
    return lines


def piece_line(name: str, nodes: int, what: str) -> str:
    """One piece of the report: ``"  piece 1  3 node(s)  eager: torch.nonzero at f.py:9: ..."``."""
    return f"  {name}  {nodes} node(s)  {what}"


#: How a graph takes in an eager step's value (pieces/entries.py ``ways_in``), as said.
_WAYS = {"node": "by the graph's own copy node", "handoff": "read where the step made it (handed off)",
         "launch": "copied by a launch"}


def _ways_in(rt: PiecewiseRuntime, slots: tuple[int, ...]) -> list[str]:
    """How the graphs after an eager step take its outputs in, over every size captured."""
    ways = ways_in(rt._entries.values(), [p.reads for p in rt.program.pieces], set(slots))
    said = [f"{n} {_WAYS[way]}" for way, n in ways.items() if n]
    return [f"    its outputs reach the graphs after it: {', '.join(said)}"] if said else []


def _runtime(rt: PiecewiseRuntime) -> str:
    pieces = rt.program.pieces
    graphed = sum(p.graphed and k not in rt.failures for k, p in enumerate(pieces))
    lines = [
        f"{rt.name}: {len(pieces)} piece(s), {graphed} graphed, "
        f"{len(pieces) - graphed} eager; compile {rt.compile_seconds:.2f} s"
    ]
    for k, p in enumerate(pieces):
        if k in rt.failures:
            what = f"ungraphed: capture failed: {rt.failures[k]}"
        elif p.graphed:
            what = "graphed"
        else:
            what = f"eager: {p.split}" if p.split else "eager"
        lines.append(piece_line(p.name, p.nodes, what))
        if not p.graphed or k in rt.failures:
            lines.extend(_ways_in(rt, p.writes))
    written = [x.name for x in rt.program.inputs if x.kind == "tensor" and x.written]
    if written:
        lines.append(f"  writes its input(s) {', '.join(written)} (copied back to the caller)")
    sizes = rt.captured_sizes()
    if sizes:
        lines.append(f"  captured: {sizes}")
    if rt.instances > 1 and rt.admit is not None:  # a backward: a set per forward graph
        lines.append(
            f"  graphs for {rt.instances} forward graphs (module instances and shapes: sets of "
            "parameters and saved activations)"
        )
    elif rt.instances > 1:
        lines.append(
            f"  graphs for {rt.instances} module instances (sets of parameters and buffers: "
            "Dynamo compiled their class once)"
        )
    if rt.copies:
        lines.append(
            f"  {rt.copies} graph(s) are copies of another of the same shape: for calls made "
            "while an earlier call's activations awaited their backward (model(a) + model(b))"
        )
    if getattr(rt, "agreement", None) is not None:
        lines.append(f"  collectives: {describe(rt.collectives)}\n  ranks: {rt.agreement!r}")
    lines.append(f"  {rt.stats.explain()}")
    for reason, n in rt.fallback_reasons.items():
        lines.append(f"  ungraphed {n}x: {reason}")
    return "\n".join(lines)
