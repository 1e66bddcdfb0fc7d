"""What :func:`torchreplay.check.check` reports: :class:`Finding` (one thing the callable did
that would break or silently freeze in a CUDA graph, at the user's file:line) and
:class:`Report` (the findings of one run, in order, printed as a table or by ``rich``).

Split from ``check.py``, which makes them; pure data, nothing here runs the callable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Iterator, overload

__all__ = ["Finding", "Report"]


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing the callable did that would break (or silently freeze in) a CUDA graph."""

    op: str
    kind: str
    reason: str
    fix: str
    filename: str
    lineno: int
    code: str

    @property
    def location(self) -> str:
        """Return ``"path/to/file.py:123"``."""
        return f"{self.filename}:{self.lineno}"


class Report(Sequence[Finding]):
    """The findings of one check run, in the order they happened; prints as a table."""

    def __init__(self, findings: Sequence[Finding] = ()) -> None:
        self.findings: list[Finding] = list(findings)

    def __len__(self) -> int:
        return len(self.findings)

    def __iter__(self) -> Iterator[Finding]:
        return iter(self.findings)

    @overload
    def __getitem__(self, index: int) -> Finding: ...

    @overload
    def __getitem__(self, index: slice) -> Report: ...

    def __getitem__(self, index: int | slice) -> Finding | Report:
        if isinstance(index, slice):
            return Report(self.findings[index])
        return self.findings[index]

    def __bool__(self) -> bool:
        return bool(self.findings)

    def __repr__(self) -> str:
        return f"Report({self.findings!r})"

    def first(self) -> Finding | None:
        """Return the earliest finding, or None when there are none."""
        return self.findings[0] if self.findings else None

    def __str__(self) -> str:
        if not self.findings:
            return "torchreplay.check: no findings"
        head = ("#", "op", "kind", "location")
        rows = [(str(i), f.op, f.kind, f.location) for i, f in enumerate(self.findings, 1)]
        widths = [max(len(row[c]) for row in (head, *rows)) for c in range(len(head))]

        def line(row: tuple[str, ...]) -> str:
            return "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()

        n = len(self.findings)
        out = [f"torchreplay.check: {n} finding{'s' if n != 1 else ''} that would break CUDA "
               "graph capture", line(head)]
        indent = " " * (widths[0] + 2)
        for finding, row in zip(self.findings, rows):
            out.append(line(row))
            if finding.code:
                out.append(f"{indent}code: {finding.code}")
            out.append(f"{indent}why:  {finding.reason}")
            out.append(f"{indent}fix:  {finding.fix}")
        return "\n".join(out)

    def __rich__(self) -> Any:
        """Return a rich Table of the findings (rich is imported only here)."""
        from rich.table import Table
        from rich.text import Text

        if not self.findings:
            return Text("torchreplay.check: no findings")
        table = Table(title="torchreplay.check: what would break CUDA graph capture",
                      show_lines=True)
        for column in ("#", "op", "kind", "location", "why / fix"):
            table.add_column(column)
        for i, f in enumerate(self.findings, 1):
            # Text, not str: rich would read "x[mask]" in a line of code as markup.
            where = f.location + (f"\n{f.code}" if f.code else "")
            why = Text(f"{f.reason}\nfix: {f.fix}")
            table.add_row(str(i), Text(f.op), f.kind, Text(where), why)
        return table
