"""Find what in a callable would break CUDA graph capture, each with the user's file:line.

:func:`check` (and :func:`check_call`, its form for callers that pass the arguments as a tuple and
a dict) runs the callable eagerly once and watches it from two sides:

- a ``TorchDispatchMode`` sees every aten op with its arguments: values read on the host
  (``aten._local_scalar_dense``), data-dependent output sizes, copies between host and device,
  tensors on the CPU or on several devices, CPU generators (a CUDA one is registered with the
  graph: core/generators.py), numbers drawn on the host that the call then uses (LayerDrop's
  ``torch.rand([]) < p``: a graph keeps the capture's), pinned allocations;
- a ``sys.setprofile`` hook sees Python-level calls that never reach aten on CPU tensors
  (``.tolist()``, ``.cpu()`` on a CPU tensor, printing, ``torch.cuda.synchronize``, RNG state).

It works on CPU tensors, so CI can check code that is meant to run on CUDA. Findings that are a
problem only on CUDA (``.item()``, ``.cpu()``, printing, ``torch.tensor(list)``) are therefore
reported whatever device the tensor is on. Each finding is located at the first stack frame
outside torch and torchreplay (torchreplay's built-in ``models/`` count as user code), except the
one about the whole call, ``(no CUDA tensor)``: it points at the line that called :func:`check`,
or at the ``origin`` given to :func:`check_call` (the command line passes the factory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import linecache
import logging
import os
import sys
import weakref
from types import CodeType, FrameType
from typing import Any, Callable

import torch

from torchreplay._compat import LightDispatchMode, storage_key
from torchreplay._compat.rng import can_register_generators
from torchreplay._compat.schema import written_tensors
from torchreplay.findings import Finding, Report

__all__ = ["Finding", "Report", "check", "check_call", "diagnose", "user_line", "KINDS", "NO_CUDA_OP"]

logger = logging.getLogger(__name__)

KINDS = ("host-sync", "dynamic-shape", "host-to-device", "cpu-tensor", "multi-device", "rng",
         "pinned-memory")

# The op name of the one finding made when the whole call touched no CUDA tensor.
NO_CUDA_OP = "(no CUDA tensor)"

_UNKNOWN = ("<unknown>", 0)


@dataclasses.dataclass(frozen=True)
class _Rule:
    kind: str
    reason: str  # a verb phrase: core/capture.py prints it right after the op name
    fix: str


_HOST, _DYN, _H2D, _RNG = "host-sync", "dynamic-shape", "host-to-device", "rng"
_SYNC_VALUE = _Rule(_HOST, "copies a tensor value to the host, which waits for the GPU and is not "
                    "allowed while capturing", "keep the value on the device (torch.where, masked "
                    "ops) or move this line out of the graphed function")
_HOST_VALUE = _Rule(_HOST, "reads a CPU tensor's value on the host in a call that runs on CUDA: "
                    "nothing waits, but a graph keeps the value it read at capture (and the branch "
                    "it took) at every replay", "fine if the value never changes between calls; "
                    "else pass it as a Python number (a graph guards those) or read it outside "
                    "the graphed call")
_SYNC_COPY = _Rule(_HOST, "copies a CUDA tensor to host memory, which waits for the GPU",
                   "return the tensor and copy it to the host after the graph has replayed")
_SYNC_PRINT = _Rule(_HOST, "formats a tensor, which reads its values on the host and waits for "
                    "the GPU", "print outside the graphed function, or drop the print")
_SYNC_WAIT = _Rule(_HOST, "makes the host wait for the GPU, which is not allowed while a stream is "
                   "capturing", "remove it and synchronize before or after calling the graph")
_DYN_SIZE = _Rule(_DYN, "has an output size that depends on the data, so the host waits for the "
                  "GPU to learn it", "use a fixed-size form: torch.nonzero_static(x, size=n), or "
                  "a mask with torch.where(cond, a, b)")
_DYN_DATA = _Rule(_DYN, _DYN_SIZE.reason, "compute it outside the graphed function, or replace it "
                  "with a fixed-size computation")
_DYN_MASK = _Rule(_DYN, "selects with a boolean mask, whose output size depends on the data",
                  "keep the shape fixed: torch.where(mask, x, 0) or x.masked_fill(~mask, 0)")
_DYN_MASK_SET = _Rule(_DYN, "assigns a tensor through a boolean mask, which runs a nonzero inside "
                      "and syncs", "use torch.where(mask, value, x), or x.masked_fill_(mask, v)")
_DYN_REPEAT = _Rule(_DYN, "repeats by a tensor without output_size, so its output size depends on "
                    "the data", "pass output_size= (a Python int known ahead of time)")
_H2D_DATA = _Rule(_H2D, "builds a tensor from Python data on every call: a host-to-device copy "
                  "on CUDA, whose value a graph would freeze at capture", "build the tensor once "
                  "outside the function and pass it in (or register it as a buffer)")
_H2D_COPY = _Rule(_H2D, "copies a CPU tensor to the GPU on every call, which a graph would replay "
                  "from host memory read once at capture", "move the tensor to the GPU once, "
                  "before the graphed function, and pass the CUDA tensor in")
_CPU_MIX = _Rule("cpu-tensor", "mixes a CPU tensor with CUDA tensors, which copies it to the GPU "
                 "on every call", "move the tensor to the GPU once, outside the function (0-dim "
                 "CPU scalars are fine)")
_HOST_WRITE = _Rule("cpu-tensor", "writes a CPU tensor the call did not make (a counter kept on the "
                    "CPU) in a call that runs on CUDA: a graph replays only the device's work, so "
                    "it would be written at capture only", "keep the tensor on the GPU (a buffer "
                    "moves with the module: register_buffer), or move the write out of the "
                    "graphed call")
_NO_CUDA = _Rule("cpu-tensor", "the call touched no CUDA tensor, so a CUDA graph would capture "
                 "nothing", "pass CUDA tensors and move the module to the GPU before graphing")
_MULTI = _Rule("multi-device", "uses tensors on several CUDA devices, but a graph is captured on "
               "one device", "keep the graphed function on one device, or graph each device's "
               "part separately")
_ELSEWHERE = _Rule("multi-device", "runs on another CUDA device than the call's (the device of its "
                   "CUDA arguments, or of its module): a graph is captured on one device and does not "
                   "record the other's kernels, so a replay would skip them", "keep the graphed "
                   "function on one device, or graph each device's part separately")
_RNG_STATE = _Rule(_RNG, "reads or writes the RNG state on the host, which a graph does not "
                   "replay", "seed outside the graphed call (before a call): a graph reads the "
                   "generator's seed and offset at every replay and draws on from there")
_RNG_GENERATOR = _Rule(_RNG, "draws from an explicit torch.Generator, which this torch cannot "
                       "register with a CUDA graph (torch >= 2.4 can)", "use the default generator "
                       "inside the graphed function and seed it outside, or upgrade torch")
_RNG_HOST_GENERATOR = _Rule(_RNG, "draws from a CPU torch.Generator on the host, which a graph does "
                            "not replay: the numbers drawn at capture are used at every replay",
                            "draw on the device from a CUDA generator (torch.Generator(device='cuda'))")
_RNG_HOST_DRAW = _Rule(_RNG, "uses a random number drawn on the host (torch's CPU generator) in a "
                      "call that runs on CUDA: a graph does not draw it again, so every replay uses "
                      "the number drawn at capture (Hugging Face's LayerDrop would skip the same "
                      "layers at every call)", "draw on the device (torch.rand((), device=x.device)) "
                      "and keep the choice there (torch.where), or make the choice outside the "
                      "graphed call; for LayerDrop, set config.layerdrop = 0 or graph in eval mode")
_PINNED = _Rule("pinned-memory", "allocates pinned host memory, which calls into the CUDA driver "
                "while capturing", "allocate pinned buffers once outside the graphed function")

# aten ops that are a finding whatever their arguments (keyed by "aten.<name>").
_ATEN_RULES: dict[str, _Rule] = {
    **dict.fromkeys(("aten._local_scalar_dense", "aten.is_nonzero", "aten.equal"), _SYNC_VALUE),
    "aten.nonzero": _DYN_SIZE,
    "aten.masked_select": _DYN_MASK,
    **dict.fromkeys(("aten._unique", "aten._unique2", "aten.unique_dim", "aten.bincount",
                     "aten.unique_consecutive", "aten.unique_dim_consecutive"), _DYN_DATA),
    "aten._pin_memory": _PINNED,
}
# aten ops that draw random numbers: on the CPU in a call that runs on CUDA, drawn on the host.
_RANDOM_OPS = frozenset(f"aten.{name}" for name in (
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "normal",
    "normal_", "uniform_", "random_", "bernoulli", "bernoulli_", "exponential_", "cauchy_",
    "log_normal_", "geometric_", "multinomial", "poisson", "native_dropout"))
_COMPARES = frozenset({"aten.lt", "aten.le", "aten.gt", "aten.ge"})
# What reads a tensor's value on the host: where a number drawn there decides.
_HOST_READS = frozenset({"aten._local_scalar_dense", "aten.is_nonzero", "aten.equal"})
_INDEX_PUT_OPS = frozenset({"aten.index_put", "aten.index_put_", "aten._index_put_impl_"})
_LIFT_OPS = frozenset({"aten.lift_fresh", "aten.lift_fresh_copy"})
# Copies are judged by direction, not by the generic device-mixing rule.
_COPY_OPS = frozenset({"aten._to_copy", "aten.copy_"}) | _LIFT_OPS

# Python functions, matched by code object identity at 'call' events (names can be shadowed).
_PY_FUNCTIONS: dict[str, _Rule] = {
    "torch.cuda.synchronize": _SYNC_WAIT,
    "torch.cuda.Stream.synchronize": _SYNC_WAIT,
    "torch.cuda.Event.synchronize": _SYNC_WAIT,
    "torch.accelerator.synchronize": _SYNC_WAIT,
    "Tensor.__repr__": _SYNC_PRINT,
    "Tensor.__format__": _SYNC_PRINT,
    "Tensor.__array__": _SYNC_COPY,
    **dict.fromkeys(("torch.get_rng_state", "torch.set_rng_state", "torch.manual_seed",
                     "torch.seed", "torch.cuda.get_rng_state", "torch.cuda.get_rng_state_all",
                     "torch.cuda.set_rng_state", "torch.cuda.set_rng_state_all",
                     "torch.cuda.manual_seed", "torch.cuda.manual_seed_all", "torch.cuda.seed",
                     "torch.cuda.seed_all"), _RNG_STATE),
}
# Builtin methods, matched at 'c_call' events by the type of their bound ``self`` and their name.
_TENSOR_METHODS = {"item": _SYNC_VALUE, "tolist": _SYNC_VALUE, "cpu": _SYNC_COPY,
                   "numpy": _SYNC_COPY, "pin_memory": _PINNED}
_GENERATOR_METHODS = dict.fromkeys(("manual_seed", "seed", "get_state", "set_state"), _RNG_STATE)


def _code_of(name: str) -> CodeType | None:
    obj: Any = torch.Tensor if name.startswith("Tensor.") else torch
    for part in name.split(".")[1:]:
        obj = getattr(obj, part, None)
    # A torch without the function (torch.accelerator is recent), or a C implementation, is simply
    # not matched here; C methods are still seen as 'c_call' events or aten ops.
    return getattr(obj, "__code__", None)


_CODE_RULES: dict[CodeType, tuple[str, _Rule]] = {
    code: (name, rule) for name, rule in _PY_FUNCTIONS.items() if (code := _code_of(name))}

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep  # the package root
# Built-in benchmark models are what `torchreplay check` runs on: point at their lines.
_OWN_USER_DIR = _OWN_DIR + "models" + os.sep
_STDLIB_WRAPPERS = frozenset(os.path.abspath(m.__file__) for m in (contextlib, functools))


@functools.lru_cache(maxsize=4096)
def _is_library_file(filename: str) -> bool:
    if filename.startswith("<"):
        return filename.startswith("<frozen")
    path = os.path.abspath(filename)
    if path.startswith(_OWN_DIR):
        return not path.startswith(_OWN_USER_DIR)
    return path.startswith(_TORCH_DIR) or path in _STDLIB_WRAPPERS


def _user_location(frame: FrameType | None) -> tuple[str, int] | None:
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _is_library_file(filename):
            return filename, frame.f_lineno
        frame = frame.f_back
    return None


def user_line(frame: FrameType | None = None) -> str:
    """``file:line`` of the first frame of the caller's stack (or of ``frame``'s) outside torch
    and torchreplay (the user's code that got there), or ``""``."""
    loc = _user_location(frame or sys._getframe(1))
    return f"{loc[0]}:{loc[1]}" if loc is not None else ""


def _definition_location(fn: Any) -> tuple[str, int] | None:
    """Where ``fn`` (or a module's class) is defined: the place to point at when no frame of the
    call is user code (``torchreplay check`` calling a built-in model from the command line)."""
    target = type(fn) if isinstance(fn, torch.nn.Module) else inspect.unwrap(fn)
    try:
        filename = inspect.getsourcefile(target)
        return (filename, inspect.getsourcelines(target)[1]) if filename else None
    except (TypeError, OSError):
        return None


@functools.lru_cache(maxsize=None)
def _op_name(func: Any) -> str:
    return str(getattr(func, "overloadpacket", func))


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """Return the tensor arguments of an aten op (TensorList arguments are one level deep)."""
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(t for t in a if isinstance(t, torch.Tensor))
    return out


def _has_bool_index(indices: Any) -> bool:
    return isinstance(indices, (list, tuple)) and any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
    )


def _classify(name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
              tensors: list[torch.Tensor]) -> list[_Rule]:
    """Return the rules that one aten op breaks, most specific first."""
    rules = []
    rule = _ATEN_RULES.get(name)
    if rule is not None:
        rules.append(rule)
    elif name == "aten.index" and len(args) > 1 and _has_bool_index(args[1]):
        rules.append(_DYN_MASK)
    # A single bool mask with a one-element value becomes masked_fill_ inside ATen: no sync.
    elif (name in _INDEX_PUT_OPS and len(args) > 2 and _has_bool_index(args[1])
          and isinstance(args[2], torch.Tensor) and args[2].numel() != 1):
        rules.append(_DYN_MASK_SET)
    elif name == "aten.repeat_interleave" and kwargs.get("output_size") is None:
        rules.append(_DYN_REPEAT)
    elif name in _LIFT_OPS and args and isinstance(args[0], torch.Tensor):
        # A 0-dim CPU tensor (torch.tensor(0.5)) is a constant torch passes by value: fine.
        if args[0].dim() > 0 or args[0].device.type != "cpu":
            rules.append(_H2D_DATA)
    elif name in _COPY_OPS and args and isinstance(args[0], torch.Tensor):
        if name == "aten._to_copy":
            src, dst = args[0].device, torch.device(kwargs.get("device") or args[0].device)
        elif len(args) > 1 and isinstance(args[1], torch.Tensor):  # copy_(dst, src)
            src, dst = args[1].device, args[0].device
        else:
            src = dst = args[0].device
        if src.type == "cpu" and dst.type == "cuda":
            rules.append(_H2D_COPY)
        elif src.type == "cuda" and dst.type == "cpu":
            rules.append(_SYNC_COPY)
        elif src.type == dst.type == "cuda" and src.index != dst.index:
            rules.append(_MULTI)
    gen = kwargs.get("generator")
    if gen is not None and gen.device.type != "cuda":
        rules.append(_RNG_HOST_GENERATOR)
    elif gen is not None and not can_register_generators():  # (else registered: core/generators.py)
        rules.append(_RNG_GENERATOR)
    if kwargs.get("pin_memory"):
        rules.append(_PINNED)
    if name not in _COPY_OPS:
        cuda_devices = {t.device.index for t in tensors if t.device.type == "cuda"}
        if len(cuda_devices) > 1:
            rules.append(_MULTI)
        if cuda_devices and any(t.device.type == "cpu" and t.dim() > 0 for t in tensors):
            rules.append(_CPU_MIX)
    return rules


def _touches_cuda(tensors: list[torch.Tensor], kwargs: dict[str, Any], out: Any) -> bool:
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "cuda":
        return True
    outs = out if isinstance(out, (list, tuple)) else (out,)
    return any(t.device.type == "cuda" for t in (*tensors, *_tensors(tuple(outs), {})))


class _HostDraws:
    """The CPU tensors that hold numbers drawn on the host, or values computed from them, in a
    call that runs on CUDA (``torch.rand([]) < p``: LayerDrop). Drawn and never used (Wav2Vec2
    draws in eval mode too, and skips only in training) is no finding; read on the host (an
    ``if``) or used by a CUDA op is: the graph keeps the capture's number. So is no finding a
    comparison whose answer no draw changes: ``torch.rand([]) < 0.0``, LayerDrop off (Hugging
    Face's default), compares a number of [0, 1) with a bound outside it. By identity: a
    tensor's ``==`` compares values."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[torch.Tensor]] = {}
        self._unit: set[int] = set()  # the ids of those drawn by torch.rand: in [0, 1)

    def __contains__(self, t: torch.Tensor) -> bool:
        ref = self._refs.get(id(t))
        return ref is not None and ref() is t

    def any_of(self, tensors: list[torch.Tensor]) -> bool:
        return bool(self._refs) and any(t in self for t in tensors)

    def after(self, name: str, args: tuple[Any, ...], tensors: list[torch.Tensor], out: Any) -> None:
        """Follow one op that ran: a draw on the CPU, or an op of a drawn value, makes its CPU
        outputs drawn."""
        if name in _RANDOM_OPS or self.any_of(tensors) and not self._decided(name, args):
            outs = out if isinstance(out, (list, tuple)) else (out,)
            for t in outs:
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    self._refs[id(t)] = weakref.ref(t)
                    if name == "aten.rand":
                        self._unit.add(id(t))
                    else:
                        self._unit.discard(id(t))

    def _decided(self, name: str, args: tuple[Any, ...]) -> bool:
        """Whether this op compares a number of [0, 1) with a bound its answer does not depend on."""
        if name not in _COMPARES or len(args) < 2 or id(args[0]) not in self._unit or args[0] not in self:
            return False
        bound = args[1]
        if not isinstance(bound, (int, float)) or isinstance(bound, bool):
            return False
        return bound < 0 or bound >= 1 or (bound == 0 and name in ("aten.lt", "aten.ge"))


class _HostWrites:
    """The CPU storages the call made (its own temporaries), and its writes into CPU tensors
    it did not make (a counter kept on the CPU), in a call that runs on CUDA. A write of the
    values the tensor held already (a scratch buffer refilled alike) is eager-equal: none."""

    _SMALL = 1 << 20  # bytes: compared with a copy; larger ones count at any write

    def __init__(self) -> None:
        self._made: set[int] = set()

    def made(self, out: Any) -> None:
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._made.add(storage_key(t))

    def before(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """The CPU tensors ``func`` is about to write that the call did not make, each with a
        copy where small."""
        found = []
        for t in written_tensors(func, args, kwargs):
            if t.device.type != "cpu" or storage_key(t) in self._made:
                continue
            size = t.untyped_storage().nbytes()
            if size:
                found.append((t, t.detach().clone() if size <= self._SMALL else None))
        return found

    @staticmethod
    def changed(pending: list[Any]) -> bool:
        try:
            return any(copy is None or not torch.equal(t, copy) for t, copy in pending)
        except Exception:  # (a fake tensor has no values to compare: count it)
            return True


class _Recorder:
    """Collect findings from both hooks, deduplicated, in the order they happen."""

    def __init__(self, fallback: tuple[str, int], previous: Callable[..., Any] | None,
                 on_finding: Callable[[str, str, str, int], None] | None = None) -> None:
        self.findings: list[Finding] = []
        self._seen: set[tuple[str, str, int]] = set()
        self.fallback = fallback
        self.previous = previous  # the profiler that was set before check, chained to
        self.saw_cuda = False
        self.on_finding = on_finding
        self.drawn = _HostDraws()  # (followed once the call has touched CUDA)
        self.host = _HostWrites()
        self.device: int | None = None  # the call's CUDA device, where its arguments tell

    def add(self, op: str, rule: _Rule, at: tuple[str, int] | None, code: str | None = None) -> None:
        filename, lineno = at or self.fallback
        if self.on_finding is not None:  # every occurrence, before the de-duplication
            self.on_finding(op, rule.kind, filename, lineno)
        # One line is reported once per kind: `.item()` is both a Python call and an aten op.
        key = (rule.kind, filename, lineno)
        if key in self._seen:
            return
        self._seen.add(key)
        if code is None:
            code = linecache.getline(filename, lineno).strip()
        self.findings.append(Finding(op, rule.kind, rule.reason, rule.fix, filename, lineno, code))

    def on_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
              tensors: list[torch.Tensor]) -> None:
        name = _op_name(func)
        rules = _classify(name, args, kwargs, tensors)
        if self.device is not None and name not in _COPY_OPS:
            devices = {t.device.index for t in tensors if t.device.type == "cuda"}
            if devices and self.device not in devices:
                rules.append(_ELSEWHERE)
        if self.drawn.any_of(tensors) and (name in _HOST_READS or _touches_cuda(tensors, kwargs, None)):
            rules = [r for r in rules if r is not _SYNC_VALUE] + [_RNG_HOST_DRAW]  # (a CPU value)
        elif self.saw_cuda and _SYNC_VALUE in rules and all(t.device.type == "cpu" for t in tensors):
            rules = [_HOST_VALUE if r is _SYNC_VALUE else r for r in rules]
        if rules:
            at = _user_location(sys._getframe())
            for rule in rules:
                op = "torch.Generator" if rule in (_RNG_GENERATOR, _RNG_HOST_GENERATOR) else name
                self.add(op, rule, at)

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        """Watch Python-level calls (a ``sys.setprofile`` hook), then pass them on."""
        try:
            self._on_python_event(frame, event, arg)
        except Exception:  # a profile hook that raises is removed and aborts the user's call
            logger.debug("check: profile hook failed on %s event", event, exc_info=True)
        if self.previous is not None:
            self.previous(frame, event, arg)

    def _on_python_event(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            hit = _CODE_RULES.get(frame.f_code)
            if hit is not None:
                self.add(hit[0], hit[1], _user_location(frame))
        elif event == "c_call":
            owner = getattr(arg, "__self__", None)
            if isinstance(owner, torch.Tensor):
                method = arg.__name__
                rule = _TENSOR_METHODS.get(method)
                if rule is _SYNC_VALUE and owner in self.drawn:
                    rule = None  # (its aten op says what it is: a number drawn on the host)
                elif rule is _SYNC_VALUE and self.saw_cuda and owner.device.type == "cpu":
                    rule = _HOST_VALUE
                if rule is None and method == "cuda" and owner.device.type == "cpu":
                    rule = _H2D_COPY
                if rule is not None:
                    self.add(f"Tensor.{method}", rule, _user_location(frame))
            elif isinstance(owner, torch.Generator) and arg.__name__ in _GENERATOR_METHODS:
                self.add(f"Generator.{arg.__name__}", _RNG_STATE, _user_location(frame))

    def report(self, whole_call: tuple[str, int], name: str) -> Report:
        if not self.saw_cuda:
            # A property of the whole call, not of a line inside it: reported once, last, at
            # the place that made the call.
            self.add(NO_CUDA_OP, _NO_CUDA, whole_call, code=f"the whole call of {name}(...)")
        return Report(self.findings)


class _CheckMode(LightDispatchMode):
    """Show every aten op to a recorder, then run it unchanged."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self._recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        tensors = _tensors(args, kwargs)
        # Record before running, so an op that raises (pin_memory without CUDA) is still seen.
        recorder = self._recorder
        recorder.on_op(func, args, kwargs, tensors)
        recorder.saw_cuda = recorder.saw_cuda or _touches_cuda(tensors, kwargs, None)
        pending = recorder.host.before(func, args, kwargs) if recorder.saw_cuda else []
        out = func(*args, **kwargs)
        recorder.saw_cuda = recorder.saw_cuda or _touches_cuda((), {}, out)
        recorder.host.made(out)
        if pending and recorder.host.changed(pending):
            recorder.add(_op_name(func), _HOST_WRITE, _user_location(sys._getframe()))
        if recorder.saw_cuda:
            recorder.drawn.after(_op_name(func), args, tensors, out)
        return out


def _name(fn: Any) -> str:
    """``"MLP"`` for a module, ``"train_step"`` for a nested function, ``"Llama.decode_step"``."""
    if isinstance(fn, torch.nn.Module):
        return type(fn).__name__
    return getattr(fn, "__qualname__", type(fn).__name__).rpartition(".<locals>.")[2]


def check_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *,
               origin: tuple[str, int] | None = None, swallow: bool = False,
               on_finding: Callable[[str, str, str, int], None] | None = None) -> Report:
    """Run ``fn(*args, **kwargs)`` eagerly once and report what would break CUDA graph capture.

    What :func:`check` and :func:`diagnose` run; the command line calls it to say where the call
    came from.

    Args:
        fn, args, kwargs: the call.
        origin: ``(filename, lineno)`` that the finding about the whole call (``(no CUDA tensor)``)
            points at, e.g. the factory that built the call. Default: the first frame outside
            torch and torchreplay that led here (the line that called :func:`check`).
        swallow: return the findings seen before an exception of ``fn`` instead of raising it.
        on_finding: called with ``(op, kind, filename, lineno)`` at every occurrence of a
            finding, as it happens (breakable graphs find the module running it).

    Returns:
        A :class:`Report`, as :func:`check` does.
    """
    previous = sys.getprofile()
    caller = None if origin is not None else _user_location(sys._getframe())
    # A finding made where no frame is user code (inside torch) points at the caller, else at
    # where fn is defined: the command line's own frames mean nothing to its user.
    fallback = caller or _definition_location(fn) or origin or _UNKNOWN
    whole_call = origin or fallback
    recorder = _Recorder(fallback, previous, on_finding)
    recorder.device = _call_device(fn, args, kwargs)
    # A C-level profiler (cProfile before Python 3.12) is not callable and could not be restored
    # through sys.setprofile, so leave it alone and see aten ops only.
    hook_python = previous is None or callable(previous)
    if not hook_python:
        logger.warning("torchreplay.check: a C-level profiler is active, so Python-level calls "
                       "(.tolist(), printing, torch.cuda.synchronize, RNG state) are not checked; "
                       "run check without the profiler to see them")
    # Any lazy import on a mode's first op (torch._dynamo on a torch that ignores
    # LightDispatchMode's opt-out) happens here, not under the profile hook, which slows it 3x.
    with _CheckMode(_Recorder(recorder.fallback, None)):
        torch.empty(0)
    try:
        with _CheckMode(recorder):
            if hook_python:
                sys.setprofile(recorder.profile)
            try:
                fn(*args, **kwargs)
            finally:
                if hook_python:
                    sys.setprofile(previous)
    except Exception as exc:
        if not swallow:
            raise
        logger.debug("check: %s raised %s: %s; reporting the %d findings seen before it",
                     _name(fn), type(exc).__name__, exc, len(recorder.findings))
    report = recorder.report(whole_call, _name(fn))
    logger.debug("check: %s: %d findings", _name(fn), len(report))
    return report


def _call_device(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The CUDA device a graph of the call is captured on: its first CUDA argument's (one
    level deep), else its module's first CUDA parameter's or buffer's; None where none says."""
    held = _tensors(args, kwargs) + ([*fn.parameters(), *fn.buffers()] if isinstance(fn, torch.nn.Module) else [])
    return next((t.device.index for t in held if t.device.type == "cuda"), None)


def check(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Report:
    """Run ``fn(*args, **kwargs)`` eagerly once and report what would break CUDA graph capture.

    Args:
        fn: a function or ``nn.Module``, called exactly as it would be graphed.
        *args, **kwargs: its arguments; CPU tensors work too (findings that matter only on CUDA
            are reported anyway, plus one ``"cpu-tensor"`` finding, ``(no CUDA tensor)``, saying
            that the whole call touched no CUDA tensor, located at the line that called check).

    Returns:
        A :class:`Report`: the findings in the order they happened, each with the user's
        file:line. Empty when nothing was found.

    .. warning:: ``fn`` really runs, with all its side effects (in-place updates, RNG draws).
    .. warning:: An exception from ``fn`` propagates, after the hooks are removed; use
        :func:`diagnose` to get the findings seen before it instead.
    """
    return check_call(fn, args, kwargs)


def diagnose(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Report:
    """Run ``fn(*args, **kwargs)`` like :func:`check`, but return the findings if ``fn`` raises.

    Used after a failed capture to name the op and the line that broke it.
    """
    return check_call(fn, args, kwargs, swallow=True)
