"""The padding check (core/padcheck.py) at the first call of a piecewise runtime with ``sizes=``
(the ``torch.compile`` backend; a breakable graph checks at its first capture instead).

The first call captures every size. Still inside that capture's put-back (module buffers, values
read in place, the RNG), the call's rows run once without graphs, unpadded, and once through the
largest size's graphs, padded, each from the module state the call found; the real rows of their
outputs are compared, and what the two runs leave in the tensors the graphs read in place
(buffers, a static cache: :class:`~torchreplay.core.padcheck.StateCheck`, a warning where the
real rows' state differs, a note for the padding rows' own writes). What both runs wrote is put
back with the capture's writes, so the call
then runs as if the check had not been made. A first call whose rows fill the largest size (a
warm-up at the largest batch) is checked on its leading rows, as many as the next size down.

Not checked (a debug line says why): a call that needs gradients (a training graph, an argument
that requires grad), one that writes an argument (the unpadded run writes the caller's own
tensors; a module buffer it writes is put back), one that draws random numbers, and one with
``torch.distributed`` set up (a run one rank made and another skipped would hang a collective).

Also here: :func:`rows_differ`, why a call cannot be padded at all (inputs padded together with
other rows than each other).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch

from torchreplay.core.padcheck import (
    DISTRIBUTED, StateCheck, distributed, first_difference, not_checked, rng_state, same_rng, with_state,
)

__all__ = ["check_first_call", "rows_differ"]

log = logging.getLogger(__name__)

_Tensor = torch.Tensor


def check_first_call(runtime: Any, args: tuple[Any, ...], reset: Callable[[], None],
                     state: Sequence[tuple[str, _Tensor]] = ()) -> None:
    """Compare the first call's rows unpadded with the same rows padded to the largest size
    (``runtime``: a :class:`~torchreplay.pieces.runtime.PiecewiseRuntime` inside its first
    capture; ``reset``: puts back the module state the capture found, before each run); log a
    warning naming the output when padding changes them. ``state``: the tensors the graphs read
    in place (buffers, a cache), by name: what the two runs leave in them is compared too
    (core/padcheck.py :class:`StateCheck`; all of them, since a replay moves no version
    counter)."""
    n, sizes, inputs, stats = runtime.rows(args), runtime.sizes, runtime.program.inputs, runtime.stats
    if n is None or not sizes:
        return
    if n >= sizes[-1] and len(sizes) > 1:  # (a warm-up at the largest batch: its first rows)
        n, args = sizes[-2], _leading(runtime, args, sizes[-2])
    why = (
        "the first call fills the largest size" if n >= sizes[-1]
        else "the call needs gradients" if runtime.saved is not None or torch.is_grad_enabled() and any(
            x.kind == "tensor" and a.requires_grad for x, a in zip(inputs, args))
        else "it writes an argument" if any(x.written and x.kind == "tensor" for x in inputs)
        else DISTRIBUTED if distributed() else None
    )
    check = StateCheck(runtime.device)
    if why is None:
        reset()
        rng = rng_state(runtime.device)
        try:
            with torch.no_grad():
                unpadded = runtime._run_ungraphed(args)
            why = "it draws random numbers" if not same_rng(rng, rng_state(runtime.device)) else None
        except Exception as exc:  # (a run only the check makes: no error of the call)
            why = f"its run at {n} rows raised {type(exc).__name__}"
        if why is None:
            check.after_first(state)
    if why is not None:
        log.debug("torchreplay: '%s': padding not checked: %s", runtime.name, why)
        stats.padding_check = not_checked(why).summary
        return
    route = runtime._route(args, sizes[-1])
    if route is None:
        return
    # (the check's replay is no call of the caller's: not counted)
    counts = stats.replays, dict(stats.size_hits), stats.real_rows, stats.padded_rows
    reset()
    check.after_reset()
    with torch.no_grad():
        padded = runtime._replay(route, args)
    stats.replays, stats.size_hits, stats.real_rows, stats.padded_rows = counts
    differences = check.compare_first()
    pairs = [(f"output {j}", a, b) for j, (a, b) in enumerate(zip(padded, unpadded))
             if isinstance(a, _Tensor) and isinstance(b, _Tensor)]
    lead = inputs[(runtime._sized or runtime._size_ints)[0]]
    where = f"{lead.name} along dim {lead.dim}" if lead.kind == "tensor" else f"the size {lead.name}"
    fills = ", ".join(f"{x.name}: {x.fill!r}" for x in inputs if x.kind == "tensor" and x.dim is not None)
    checked = first_difference(runtime.name, pairs, n, sizes[-1], where, fills)
    checked = with_state(checked, runtime.name, differences, check.too_large, False, n, sizes[-1], where, fills)
    stats.padding_check = checked.summary
    if checked.report is not None:
        log.warning("torchreplay: %s", checked.report)


def _leading(runtime: Any, args: tuple[Any, ...], m: int) -> tuple[Any, ...]:
    """``args`` cut to their leading ``m`` rows: views of the varying tensors, and ``m`` for the
    size itself."""
    inputs, out = runtime.program.inputs, list(args)
    for i in runtime._sized:
        out[i] = args[i].narrow(inputs[i].dim, 0, m)
    for i in runtime._size_ints:
        out[i] = m
    return tuple(out)


def rows_differ(runtime: Any, n: int | None, args: tuple[Any, ...]) -> str | None:
    """Why a call of ``n`` rows cannot be padded, where an input padded with the first one (an
    attention mask along its ids) has other rows than it: eagerly such a call reads as it says;
    padded, every size would index one input by the other's rows."""
    if n is None or runtime.sizes is None:
        return None
    inputs = runtime._inputs
    for i in runtime._sized[1:]:
        x = inputs[i]
        if args[i].shape[x.dim] != n:
            return f"{x.name} has {args[i].shape[x.dim]} rows along dim {x.dim}, the call {n}"
    for i in runtime._size_ints if runtime._sized else runtime._size_ints[1:]:  # (the first: n)
        if int(args[i]) != n:
            return f"{inputs[i].name} is {int(args[i])}, the call's rows {n}"
    return None
