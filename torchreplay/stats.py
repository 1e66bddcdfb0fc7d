"""Counters of a graphed callable, and the report that explains them.

Counters are plain attributes incremented on the replay path; anything that costs more than an
increment (memory held by a pool) is computed when it is read.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["GraphStats", "TrainingStats"]


class GraphStats:
    """What a graphed callable did: captures, replays, fallbacks, padding, memory.

    Attributes:
        captures: graphs captured.
        replays: calls answered by replaying a graph.
        fallbacks: calls that ran eagerly instead (e.g. ``module.training`` changed, a size above
            the largest captured one).
        capture_seconds: wall time spent in warm-up and capture, all graphs together.
        size_hits: for graphs with ``sizes=``, replays per captured size.
        real_rows / padded_rows: rows the callers asked for, and rows added as padding.
        written_inputs: the arguments the callable writes in place (``["args[1] 'cache'"]``),
            copied back into the caller's tensors after each replay.
        padding_check: with ``sizes=``, whether padding changes what a call returns, checked
            once at the build or the first call (``"rows independent: ..."``, ``"CHANGES the
            result: ..."`` with a warning, ``"not checked: <why>"``); ``""`` without padding.
        graph_copies: tensor arguments the graph copies in by itself (its first nodes, pointed
            at the caller's tensors at each call, which launches no copy); 0 where each call
            launches the copy.
    """

    __slots__ = (
        "captures",
        "replays",
        "fallbacks",
        "capture_seconds",
        "size_hits",
        "real_rows",
        "padded_rows",
        "written_inputs",
        "padding_check",
        "graph_copies",
        "_pool_bytes",
    )

    def __init__(self, pool_bytes: Callable[[], int] | None = None) -> None:
        self.captures = 0
        self.replays = 0
        self.fallbacks = 0
        self.capture_seconds = 0.0
        self.size_hits: dict[int, int] = {}
        self.real_rows = 0
        self.padded_rows = 0
        self.written_inputs: list[str] = []
        self.padding_check = ""
        self.graph_copies = 0
        self._pool_bytes = pool_bytes

    @property
    def pool_bytes(self) -> int:
        """Bytes of device memory reserved by the graphs' memory pool (0 before any capture)."""
        return self._pool_bytes() if self._pool_bytes is not None else 0

    @property
    def pad_waste(self) -> float:
        """Fraction of replayed rows that were padding (0.0 when nothing was padded)."""
        total = self.real_rows + self.padded_rows
        return self.padded_rows / total if total else 0.0

    def as_dict(self) -> dict[str, object]:
        """Return every counter as a plain dict (for logging and JSON)."""
        return {
            "captures": self.captures,
            "replays": self.replays,
            "fallbacks": self.fallbacks,
            "capture_seconds": round(self.capture_seconds, 6),
            "size_hits": dict(self.size_hits),
            "real_rows": self.real_rows,
            "padded_rows": self.padded_rows,
            "pad_waste": round(self.pad_waste, 4),
            "pool_bytes": self.pool_bytes,
            "written_inputs": list(self.written_inputs),
            "padding_check": self.padding_check,
            "graph_copies": self.graph_copies,
        }

    def explain(self) -> str:
        """Return a short human-readable summary of the counters."""
        d = self.as_dict()
        lines = [
            f"captures={d['captures']} ({d['capture_seconds']:.3f} s)",
            f"replays={d['replays']} fallbacks={d['fallbacks']}",
            f"pool={d['pool_bytes'] / 2**20:.1f} MiB",
        ]
        if self.written_inputs:
            lines.append(f"writes {', '.join(self.written_inputs)} (copied back)")
        if self.graph_copies:
            lines.append(f"copies {self.graph_copies} input(s) in by itself (no copy launch per call)")
        if self.size_hits:
            hits = ", ".join(f"{k}:{v}" for k, v in sorted(self.size_hits.items()))
            lines.append(f"size hits {{{hits}}}; padding {self.pad_waste:.1%} of rows")
        if self.padding_check:
            lines.append(f"padding check: {self.padding_check}")
        return "; ".join(lines)

    def __repr__(self) -> str:
        return f"GraphStats({self.explain()})"


class TrainingStats(GraphStats):
    """:class:`~torchreplay.GraphStats` plus training counters.

    Attributes:
        backward_replays: backward graph replays.
        verified: calls compared against eager (``verify=K``).
        recomputed: backwards the backward graph cannot compute (``create_graph=True``, a
            second backward of one forward, activations overwritten), each computed through an
            eager run of the forward (training/recompute.py).
        grad_copies: incoming gradients the backward graph copies in by itself (its first
            nodes, pointed at autograd's tensors at each backward); 0 where each backward
            launches the copy.
    """

    __slots__ = ("backward_replays", "verified", "recomputed", "grad_copies")

    def __init__(self, pool_bytes: Callable[[], int] | None = None) -> None:
        super().__init__(pool_bytes)
        self.backward_replays = 0
        self.verified = 0
        self.recomputed = 0
        self.grad_copies = 0

    def as_dict(self) -> dict[str, object]:
        d = super().as_dict()
        d["backward_replays"] = self.backward_replays
        d["verified"] = self.verified
        d["recomputed"] = self.recomputed
        d["grad_copies"] = self.grad_copies
        return d

    def explain(self) -> str:
        text = super().explain()
        extra = f"backward_replays={self.backward_replays}"
        if self.grad_copies:
            extra += f" (copies {self.grad_copies} gradient(s) in by itself)"
        if self.verified:
            extra += f" verified={self.verified}"
        if self.recomputed:
            extra += f" recomputed={self.recomputed}"
        return f"{text}; {extra}"

    def __repr__(self) -> str:
        return f"TrainingStats({self.explain()})"
