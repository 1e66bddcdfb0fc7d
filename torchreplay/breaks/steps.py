"""The eager step of one break at replay: call it, and check what it returned against what the
graph after it was captured reading (:class:`BreakStep`). That graph copies the tensors in
itself (``PieceGraph.copy_in``: by its own first nodes where it can)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from torchreplay import _compat
from torchreplay.breaks.plan import BreakCall
from torchreplay.errors import ReplayInputError
from torchreplay.pieces.direct import direct_call

__all__ = ["BreakStep", "returns_nothing"]

_Tensor = torch.Tensor
_LEAF = _compat.tree_flatten(0)[1]


def returns_nothing(rec: BreakCall) -> bool:
    """Did the break return nothing a later segment could read (``None`` is a pytree leaf)?"""
    return all(o is None for o in rec.outputs)


class BreakStep:
    """The eager step of one break: calls it, and checks what it returned against what the
    graph after it was captured reading (which copies the tensors in: ``PieceGraph.copy_in``).

    Called with the break's argument leaves, then the tensors (and values) it returned at capture.
    """

    def __init__(self, rec: BreakCall, name: str) -> None:
        args, kwargs = _compat.tree_unflatten(list(rec.values), rec.spec)
        # A custom op named in breaks= is called without the dispatcher (pieces/direct.py).
        self.call = direct_call(rec.call, args, kwargs) or rec.call
        self.name = name
        self.where = rec.where
        self.n = len(rec.rules)
        self.spec = rec.spec
        self.out_spec = rec.out_spec
        # Returned nothing to read (None, nothing, Nones: a break that writes an argument): its
        # return is not read at replay (the graphs after it never saw one), nor compared.
        self.none = returns_nothing(rec)
        self.m = 0 if self.none else len(rec.outputs)
        plain = _compat.tree_flatten((tuple(range(len(args))), dict.fromkeys(kwargs, 0)))[1]
        # Fast paths: every argument is itself a leaf; the output is one leaf or a flat tuple.
        self.flat = plain == rec.spec
        self.na = len(args)
        self.kw = tuple(kwargs)
        self.single = self.m == 1 and rec.out_spec == _LEAF
        self.tuple = rec.out_spec == _compat.tree_flatten(tuple(range(self.m)))[1]

    def __call__(self, *vals: Any) -> Sequence[Any]:
        n = self.n
        if self.flat and not self.kw:
            out = self.call(*vals[:n])
        elif self.flat:
            out = self.call(*vals[: self.na], **dict(zip(self.kw, vals[self.na : n])))
        else:
            args, kwargs = _compat.tree_unflatten(list(vals[:n]), self.spec)
            out = self.call(*args, **kwargs)
        if self.none:
            return ()
        if self.single:
            outs: Sequence[Any] = (out,)
        elif self.tuple and type(out) is tuple and len(out) == self.m:
            outs = out
        else:
            outs, spec = _compat.tree_flatten(out)
            if spec != self.out_spec:
                raise ReplayInputError(
                    f"break {self.name} (called at {self.where}) returned {spec}, but the graph "
                    f"after it was captured with {self.out_spec}: a break must return the same "
                    "structure every call"
                )
        bufs = vals[n:]
        for j in range(self.m):
            o, b = outs[j], bufs[j]
            if type(b) is _Tensor and b.is_cuda:
                if o is not b and (
                    not isinstance(o, _Tensor)
                    or o.shape != b.shape
                    or o.dtype != b.dtype
                    or o.device != b.device
                ):
                    raise self._changed(j, o, b)
            elif not _same(o, b):
                raise self._changed(j, o, b)
        return outs

    def _changed(self, j: int, o: Any, b: Any) -> ReplayInputError:
        which = "its output" if self.single else f"its output {j}"
        return ReplayInputError(
            f"break {self.name} (called at {self.where}): {which} is {_describe(o)} now, but the "
            f"graph after it was captured reading {_describe(b)}. A break's outputs must keep "
            "their shape, dtype and device (the next segment reads them where they were at "
            "capture): pad them to a fixed shape, or move the code that uses them into the break"
        )


def _describe(v: Any) -> str:
    if isinstance(v, _Tensor):
        return f"a tensor of shape {tuple(v.shape)} {v.dtype} on {v.device}"
    return f"{type(v).__name__} {v!r}"


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, _Tensor) or isinstance(b, _Tensor):
        return (
            isinstance(a, _Tensor) and isinstance(b, _Tensor) and a.shape == b.shape
            and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b))
        )
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False
