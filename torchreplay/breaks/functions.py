"""The ``torch.autograd.Function``s a model calls between breaks, recorded as calls of the
Function, and the Python code that launches GPU work torch never sees.

Training with breaks records the model's run below autograd (:mod:`.program`). A Function's
``forward`` runs with autograd off, so the recorder sees the ops it launches and nothing of its
``backward``: ops run again would give autograd's derivative of them (zero for a rounding, where
a straight-through estimator's backward passes the gradient on) or none at all, and a Triton
kernel it launches is not an op. So, while the model is recorded, a ``sys.setprofile`` hook
(:class:`FunctionWatch`) brackets each outermost call of a Function's ``forward`` between
breaks, drops the ops recorded inside it and records one op in their place: ``Fn.apply`` on the
same arguments. A segment then calls the Function again, and its forward graph holds what the
Function's forward launches, its backward graph what the Function's backward launches (both must
be capturable, as for any graph). Its non-tensor arguments are constants, like an op's.

Two kinds are left alone: the Function ``torch.library`` makes for a custom op's
``register_autograd`` (the op itself is recorded; called with autograd on, it runs the same
Function), and activation checkpointing's ``CheckpointFunction`` (refused by
:func:`check_differentiable`, with the fix). A Triton kernel launched between breaks outside a
Function or a custom op is refused: the recorder cannot see what it writes.

The hook sees only the Functions defined when the record starts; with a C-level profiler active
(cProfile before Python 3.12) it cannot be set, and every Function's result that needs a
gradient is then refused by :func:`check_differentiable`, as before this module.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import torch

from torchreplay import _compat
from torchreplay.breaks.recorded import Op, Segment
from torchreplay.check import user_line

__all__ = ["FunctionWatch", "check_differentiable", "function_calls"]

_CO_VARARGS = 0x04
_BREAK_IT = "Name the module or function around it in breaks=, or use breaks='auto'"


class FunctionWatch:
    """While the model is recorded by ``rec`` (the recorder of :mod:`.program`): each
    outermost call of a Function's forward between breaks becomes one op (see the module)."""

    def __init__(self, rec: Any) -> None:
        self.rec = rec
        self.codes = _compat.function_forwards()
        self.launches = _compat.triton_launches()
        self.frame: FrameType | None = None  # the forward being recorded
        self.call: tuple[Any, ...] = ()  # ... its class, arguments, segment, first op, values then, line
        self.applied: list[Op] = []  # their ops, whose grad mode is known after the run
        self.previous: Any = None
        self.on = False

    def __enter__(self) -> FunctionWatch:
        self.previous = sys.getprofile()
        self.on = self.previous is None or callable(self.previous)  # (not a C-level profiler)
        if self.on:
            sys.setprofile(self.profile)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.on:
            sys.setprofile(self.previous)
        # A Function's ops ran with autograd on when the run gave its results a history.
        keep = self.rec.keep
        for op in self.applied:
            op.grad = any(v is not None and keep[v].grad_fn is not None for v in op.outs)

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            if (code in self.codes or code in self.launches) and self.frame is None:
                rec = self.rec
                if not rec.inside and not rec.running:  # (a break's, or an op's own Python)
                    try:
                        self._enter(frame) if code in self.codes else self._launch(frame)
                    except Exception as exc:  # (a profile hook that raises is removed)
                        self._fail(f"the call at {code.co_filename}:{frame.f_lineno} could not be recorded ({exc})")
        elif event == "return" and frame is self.frame:
            try:
                self._exit(arg)
            except Exception as exc:
                self._fail(f"the torch.autograd.Function call could not be recorded ({exc})")
        if self.previous is not None:
            self.previous(frame, event, arg)

    def _enter(self, frame: FrameType) -> None:
        code = frame.f_code
        names, n = code.co_varnames, code.co_argcount
        loc = frame.f_locals
        args = [loc[k] for k in names[:n]]
        if code.co_flags & _CO_VARARGS:
            args += list(loc[names[n + code.co_kwonlyargcount]])
        cls = _compat.function_of_ctx(args[0]) if args else None
        if cls is not None:
            args = args[1:]  # (the ctx apply made)
        else:  # a Function with a setup_context: its forward gets no ctx
            cls = _compat.function_of_call(frame)
        if cls is None:  # a forward called as a plain function: its ops are plain ops
            return
        segment = self.rec.steps[-1]
        self.frame = frame
        self.call = (cls, args, segment, len(segment.ops), len(self.rec.keep), user_line())

    def _exit(self, result: Any) -> None:
        cls, args, segment, first, n_values, where = self.call
        self.frame, self.call = None, ()
        rec = self.rec
        name = f"torch.autograd.Function {cls.__qualname__}"
        if result is None:  # (a forward returns its outputs: None is an exception unwinding)
            self._fail(f"{name}'s forward raised", where)
            return
        if _compat.is_custom_op_function(cls):  # the custom op itself (see the module)
            if rec.steps[-1] is segment and len(segment.ops) == first + 1:
                self.applied.append(segment.ops[first])
            return  # (else it was a break, named as an op)
        if rec.steps[-1] is not segment:
            self._fail(
                f"a break ran inside {name}'s forward: a Function's forward and backward are one "
                "call, which a segment cannot split around a break", where,
                "Name the module that calls the Function in breaks=, or graph without breaks=",
            )
            return
        inner = segment.ops[first:]
        del segment.ops[first:]
        flat, spec = _compat.tree_flatten((tuple(args), {}))
        refs = rec.refs(name, flat)
        outs: list[int | None] = []
        for o in _compat.tree_flatten(result)[0]:
            if not isinstance(o, torch.Tensor):
                outs.append(None)
                continue
            if any(o is x for x in flat):
                self._fail(
                    f"{name} returns one of its arguments as it is (apply hands back another "
                    "tensor for it, in place or as a view, which the record cannot follow)",
                    where, "Return a new tensor from its forward, or name it in breaks=",
                )
                return
            known = rec.ids.get(id(o))
            outs.append(known if known is not None else rec.value(o, len(rec.steps) - 1))
        writes = tuple(sorted({w for op in inner for w in op.writes if w < n_values}))
        # (its ops draw random numbers or write: kept even if nothing reads it; so is one whose
        # work the recorder did not see at all, a Triton kernel's)
        effect = not inner or any(op.effect for op in inner)
        op = Op(cls.apply, refs, spec, True, outs, where, effect, writes)
        segment.ops.append(op)
        self.applied.append(op)

    def _launch(self, frame: FrameType) -> None:
        kernel = frame.f_locals.get("self")
        name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", "?")
        caller: FrameType | None = frame
        while caller is not None and str(caller.f_globals.get("__name__", "")).split(".")[0] == "triton":
            caller = caller.f_back  # (Triton's own launch code)
        self._fail(
            f"the Triton kernel {name} was launched: the recorder sees no op of it and would "
            "leave out what it writes",
            user_line(caller),
            "Launch it from a torch.autograd.Function or a torch.library.triton_op (custom op), "
            "or name the module or function around it in breaks=",
        )

    def _fail(self, problem: str, where: str = "", fix: str = "") -> None:
        rec = self.rec
        if rec.problem is None:
            rec.fail(f"between two breaks, {problem}", fix or _BREAK_IT)
            rec.where = where or user_line()


def function_calls(ops: list[Op]) -> str:
    """The Function calls among a segment's ops, for ``explain()``: ``"; Functions: A x2, B"``,
    or ``""``."""
    counts: dict[str, int] = {}
    for op in ops:
        owner = getattr(op.func, "__self__", None)
        if isinstance(owner, type) and issubclass(owner, torch.autograd.Function):
            counts[owner.__name__] = counts.get(owner.__name__, 0) + 1
    listed = ", ".join(name if n == 1 else f"{name} x{n}" for name, n in counts.items())
    return f"; Functions: {listed}" if listed else ""


def check_differentiable(rec: Any) -> None:
    """A value made with autograd off that requires grad after the run got its history from
    something the program does not run again: a ``torch.autograd.Function`` the watch did not
    see (activation checkpointing's; one defined during the run; any, under a C-level
    profiler), whose forward ran with autograd off and whose backward the program would not
    run; or a ``requires_grad_()`` on a tensor made inside the model."""
    for step in rec.steps:
        if not isinstance(step, Segment):
            continue
        for op in step.ops:
            if op.grad:
                continue
            for v in op.outs:
                t = rec.keep[v] if v is not None else None
                # (a view of a parameter made under no_grad requires grad with no history, and
                # eager's autograd ends at it as the program's does)
                if t is None or not t.requires_grad or t.grad_fn is None and t._is_view():
                    continue
                node = type(t.grad_fn).__name__.removesuffix("Backward") if t.grad_fn is not None else ""
                what = f"torch.autograd.Function {node}" if node else (
                    "requires_grad_() on a tensor made inside the model")
                rec.fail(
                    f"{op.func} ran with autograd off but its result requires grad: a {what}, "
                    "whose backward a segment would not run",
                    _CHECKPOINT_FIX if node.startswith("CheckpointFunction") else "",
                )
                rec.where = op.where
                return


_CHECKPOINT_FIX = (
    "This is activation checkpointing with use_reentrant=True. Pass use_reentrant=False (HF: "
    "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})) "
    "or turn it off: a graphed segment keeps the activations its backward needs either way"
)
