"""For the compile-cache tests' child processes: count Inductor compiles (``compile_fx`` calls) in
that process, to show that a warm start runs none. Tests only: it replaces a torch function."""

from __future__ import annotations

from typing import Any


def count_inductor_compiles() -> list[int]:
    """Wrap ``torch._inductor.compile_fx.compile_fx``; each call appends to the returned list."""
    import torch._inductor.compile_fx as cfx

    calls: list[int] = []
    inner = cfx.compile_fx

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return inner(*args, **kwargs)

    cfx.compile_fx = counting
    return calls
