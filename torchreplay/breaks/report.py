"""``tr.explain`` of a breakable graph: what was graphed and what runs eagerly."""

from __future__ import annotations

from typing import Any

__all__ = ["report"]


def report(graph: Any) -> str:
    """Each break call of ``graph`` (a :class:`~torchreplay.breaks.graph.BreakableGraph`) with the
    model's line, why it breaks (named, or the op ``breaks="auto"`` found), where its
    arguments come from at replay and how the next segment takes its tensors in; segments;
    sizes; captures, replays, fallbacks with reasons; pool memory; the padding check."""
    rt = graph.runtime
    why = {id(b.module): f"auto: {b.op} ({b.kind}) at {b.where}" for b in graph.auto}
    lines = [repr(graph)]
    for k, rec in enumerate(graph.breaks):
        reason = why.get(id(rec.brk.target), "named in breaks=")
        lines.append(f"  break {k}: {rec.brk.name} at {rec.where} ({reason})")
        reads = [
            f"{r.path} {r.kind}" + (f" from {r.source}" if r.source else "")
            for r in rec.rules if r.kind != "constant"
        ]
        if reads:
            lines.append("    reads: " + "; ".join(reads))
        taken = _taken(rt, k)
        if taken:
            lines.append(taken)
    empty = sum(
        1 for e in rt._entries.values() for g in e.graphs[::2] if g is not None and g.graph is None
    )
    sizes = rt.captured_sizes()
    lines.append(
        f"  segments: {len(graph.breaks) + 1} per size, {len(sizes)} size(s) "
        f"{[s for s in sizes if s is not None] or ''} ({empty} empty segment(s) replay nothing)"
    )
    lines.append(f"  {graph.stats.explain()}")
    for reason, n in rt.fallback_reasons.items():
        lines.append(f"  ran ungraphed {n}x: {reason}")
    return "\n".join(lines)


def _taken(rt: Any, k: int) -> str | None:
    """How segment ``k + 1`` takes break ``k``'s tensor outputs in (the first size captured):
    by its own copy nodes, or one launch for the rest (none for a view of what the break got,
    where it stays)."""
    entry = next(iter(rt._entries.values()), None)
    graphs = entry.graphs if entry is not None else ()
    seg = graphs[2 * k + 2] if 2 * k + 2 < len(graphs) else None
    copies = getattr(seg, "copies", None)
    if not copies:
        return None
    nodes = len(getattr(seg, "nodes", None) or {})
    return (f"    its {len(copies)} tensor output(s) go into segment {k + 1}: {nodes} by its own copy "
            f"nodes, {len(copies) - nodes} by one launch (none if in place)")
