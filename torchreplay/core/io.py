"""Arguments in, outputs out: static buffers, guards, copy-in, writes copied back, output policy.

Data flows one way through this module: the caller's ``(args, kwargs)`` are flattened and checked
against what the graph was captured with, tensors are copied into the graph's static input
buffers (by the graph's own first nodes, pointed at the caller's tensors: _compat/copy_nodes.py;
else one launch for many), the graph replays, the static buffers the callable writes are
copied back into the caller's tensors (eager semantics for in-place writes to arguments), and
:class:`~torchreplay.core.outputs.Outputs` hands the results back under the output policy.

A tensor of the captured shape but another dtype is refused, except for a lossless widening
(``float16``/``bfloat16`` -> ``float32``, a smaller integer -> a larger one), which is copied in
with one warning per argument: the graph computes in the captured dtype, as torch's
``make_graphed_callables`` does when it copies an autocast output into its static input.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, Iterator, Sequence

import torch

from torchreplay import _compat
from torchreplay._compat import copy_nodes
from torchreplay.core.args import CallArgs
from torchreplay.core.generators import bind, check_pairs, hand_back, not_fitting, pairs, per_call, stand_ins
from torchreplay.core.rewind import Rewind
from torchreplay.core.values import copy_widening, conversion_fix, describe_tensor, same_constant, warn_widening, widens
from torchreplay.errors import CaptureError, ReplayInputError

__all__ = [
    "Inputs",
    "MAX_COPY_NODES",
    "TransformedInput",
    "byte_span",
    "describe_tensor",
    "same_constant",
    "conversion_fix",
    "graph_copyable",
    "point_or_off",
    "warn_widening",
    "widens",
    "write_back",
]

log = logging.getLogger(__name__)

_Tensor = torch.Tensor
# An argument this large passed again as the same tensor (a KV cache): its copies are named once.
_LARGE_BYTES = 64 << 20
_foreach_copy = _compat.foreach_copy_
_copy_untracked = _compat.foreach_copy_untracked
_grad_enabled = torch.is_grad_enabled
_dual_level = _compat.dual_level
#: At most this many tensor arguments are copied by the graph's own nodes: each one whose tensor
#: changes costs a driver call (1.5 us on the H200), four cost what one copy launch does.
MAX_COPY_NODES = 3


def write_back(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """Copy each static buffer in ``srcs`` into the caller's tensor in ``dsts`` (one launch for
    many; one copy each where a widened argument's dtype differs), outside autograd: it is what
    the callable's write did to the caller's tensor, not a step of its history."""
    if not dsts:
        return
    with torch.no_grad():
        if len(dsts) == 1 or any(d.dtype != s.dtype for d, s in zip(dsts, srcs)):
            for d, s in zip(dsts, srcs):
                d.copy_(s)
        else:
            _compat.foreach_copy_(dsts, srcs)


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last + 1)`` byte addresses of the elements ``t`` covers (two views of one
    storage that cover disjoint ranges do not overlap)."""
    start = t.data_ptr()
    if t.numel() == 0:
        return start, start
    last = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def _device_index(device: torch.device) -> int:
    """``Tensor.get_device()``'s number for ``device``: -1 for the CPU, else the index."""
    return -1 if device.type == "cpu" else (device.index or 0)


def _matches(leaf: Any, shape: torch.Size, dtype: torch.dtype, device: int) -> bool:
    """Is ``leaf`` a tensor of exactly this shape, dtype and device (``get_device()`` number)?"""
    try:
        return leaf.shape == shape and leaf.dtype is dtype and leaf.get_device() == device
    except AttributeError:  # not a tensor
        return False


def graph_copyable(statics: Sequence[torch.Tensor]) -> bool:
    """Can a graph copy these static buffers in itself, by nodes a call points at its tensors
    (_compat/copy_nodes.py)? Each dense, real and under 64 MiB, at most three (one copy launch
    left for the rest costs what the nodes save), and the driver has the calls."""
    return (
        0 < len(statics) <= MAX_COPY_NODES and copy_nodes.available()
        and all(t.is_contiguous() and 0 < t.nbytes < _LARGE_BYTES and not t.is_complex() for t in statics)
    )


def point_or_off(node: copy_nodes.CopyNode, leaf: torch.Tensor, nbytes: int = 0) -> bool:
    """Point the graph's copy ``node`` at ``leaf`` (``nbytes`` of it; default: the recorded
    size) and return True, or turn it off to copy ``leaf`` with a launch (False: a tensor
    subclass, a layout or a flag a byte copy would not keep, a forward-AD dual level, no
    storage, or the driver refused). The launch then raises what the copy-in always raised for
    a tensor of a torch.func transform or a stale output, which the caller turns into its error."""
    try:
        if (
            type(leaf) is _Tensor and leaf.is_contiguous() and not leaf.is_neg() and not _dual_level()
            and node.point(leaf.data_ptr(), nbytes)
        ):
            return True
    except RuntimeError:  # no storage: a torch.func wrapper, a stale output
        pass
    node.off()
    return False


class _Slot:
    """One flattened input leaf: a tensor with its static buffer, or a constant."""

    __slots__ = ("path", "static", "value", "shape", "dtype", "device", "adopted", "rebound")

    def __init__(
        self, path: str, leaf: Any, device: torch.device, adopt: bool = False, own: Any = None
    ) -> None:
        self.path = path
        #: a CUDA generator: the graph draws from a stand-in, put where the call's one stands
        self.rebound = per_call(leaf)
        #: the caller's tensor itself is the buffer (marked with mark_static_address; adopt)
        self.adopted = adopt and _compat.static_address(leaf)
        if isinstance(leaf, _Tensor):
            if leaf.device != device:
                raise CaptureError(
                    f"{path}: {describe_tensor(leaf)} but the graph runs on {device}; "
                    f"move every tensor argument to {device} before graphing"
                )
            if leaf.layout is not torch.strided:
                raise CaptureError(
                    f"{path}: layout {leaf.layout} is not supported; pass a dense tensor "
                    "(e.g. .to_dense())"
                )
            # Our own buffer, not the caller's sample: replays must not write into a tensor the
            # caller still owns. Unless the caller marked it as one whose address stays the same
            # at every call (torch._dynamo.mark_static_address, as for torch.compile's graphs):
            # then it is the buffer, read and written where it is, and every call must pass it.
            if self.adopted:
                self.static: torch.Tensor | None = leaf
            else:
                self._copy(leaf, path)
            self.value = None
            self.shape = leaf.shape
            self.dtype = leaf.dtype
            self.device = leaf.device
        else:
            self.static = None
            self.value = own if self.rebound else leaf  # (own: the generator's stand-in)
            self.shape = self.dtype = self.device = None

    def _copy(self, leaf: torch.Tensor, path: str) -> None:
        """Make :attr:`static` a copy of the caller's sample (a normal tensor under
        torch.inference_mode too, so that calls in either mode can copy into it)."""
        with _compat.normal_tensors():
            try:
                self.static = torch.empty_like(leaf, memory_format=torch.preserve_format).copy_(leaf.detach())
            except torch.OutOfMemoryError as exc:
                raise CaptureError(
                    f"{path} ({leaf.nbytes >> 20} MiB, {describe_tensor(leaf)}) does not fit "
                    "twice: a tensor argument is copied into a buffer of the graph's own, and "
                    "there is no memory for the copy. Mark a tensor the graph should read and "
                    "write where it is (a KV cache) with torch._dynamo.mark_static_address, or "
                    "keep it in the model as a registered buffer or in an object passed as the "
                    "argument (a cache object): those are read in place, not copied"
                ) from exc


class TransformedInput(ReplayInputError):
    """A tensor argument of a ``torch.func`` transform or a forward-AD dual: the graphs that can
    run a call eagerly do (``tr.graph`` of one shape, ``tr.make_graphed_callables``), as eager
    code runs inside the transform; the others raise it."""


class Inputs:
    """The captured arguments of one graph: their structure, static buffers and constants.

    Args:
        call: the sample call, flattened (:class:`~torchreplay.core.args.CallArgs`); its tensors
            must be on ``device``.
        device: the graph's CUDA device.
    """

    def __init__(self, call: CallArgs, device: torch.device, adopt: bool = False) -> None:
        # Not the CallArgs itself: it holds the caller's sample tensors, which must not be kept
        # (but those it adopts: marked with mark_static_address, they are the buffers).
        self.spec = call.spec
        owns = stand_ins(call.leaves)
        self.slots = [
            _Slot(path, leaf, device, adopt, owns.get(i)) for i, (path, leaf) in enumerate(zip(call.paths, call.leaves))
        ]
        #: with two or more generator arguments: which the sample passed as one (check_pairs)
        self.generator_pairs = pairs(owns)
        self.paths = call.paths
        self.device = device
        self.nargs = call.nargs
        self.kw_keys = call.kw_keys
        # Fast path: every positional and keyword argument is itself a leaf (no containers), so
        # flattening is a list build instead of a pytree walk.
        self.flat = len(call.leaves) == call.nargs + len(call.kw_keys)
        self.static_args, self.static_kwargs = call.unflatten(
            [s.static if s.static is not None else s.value for s in self.slots]
        )
        self.tensor_slots = [s for s in self.slots if s.static is not None]
        #: An inference graph's (tr.graph): :meth:`copy_in` copies nothing and returns None for a
        #: call with autograd on and a tensor that requires grad (core/modes.py: run eagerly).
        self.eager_if_tracked = False
        # What copy_in checks, precomputed as tuples: attribute lookups on the hot path cost
        # as much as the checks themselves.
        self._tensor_checks: list[tuple[Any, ...]] = [
            (i, s.static, s.shape, s.dtype, _device_index(s.device), s, None)
            for i, s in enumerate(self.slots)
            if s.static is not None and not s.adopted
        ]
        #: the caller's tensors that are their own buffers: each call must pass the same one
        self.adopted = [(i, s.static, s) for i, s in enumerate(self.slots) if s.adopted]
        self._constant_checks = [
            (i, s.value, s) for i, s in enumerate(self.slots) if s.static is None and not s.rebound
        ]
        #: the generator arguments, each with the graph's stand-in (core/generators.py)
        self.rebound = [(i, s.value, s) for i, s in enumerate(self.slots) if s.rebound]
        self._only_args = self.flat and not self.kw_keys
        #: Slot positions whose static buffer the graph writes (set after capture: set_written).
        self.written: tuple[int, ...] = ()
        self._write_backs: list[tuple[int, torch.Tensor]] = []
        self._widened: set[tuple[int, torch.dtype]] = set()
        self._set_one()
        #: The tensor slots of at least 64 MiB, once known the written ones (:meth:`note_same_large`;
        #: emptied once it told)
        self.large = [
            i for i, s in enumerate(self.slots)
            if s.static is not None and not s.adopted and s.static.nbytes >= _LARGE_BYTES
        ]
        self._last_large: dict[int, weakref.ref[torch.Tensor]] = {}

    def _set_one(self) -> None:
        self._one = (
            self._tensor_checks[0]
            if len(self._tensor_checks) == 1 and not self._constant_checks and not self.adopted and not self.rebound
            else None
        )

    def copied_by_graph(self) -> list[torch.Tensor]:
        """The static buffers of the tensor arguments, for a graph that copies them in itself
        (core/capture.py ``copy_in``; _compat/copy_nodes.py): none unless all can be (one
        left to copy costs the launch they save): dense, real, under 64 MiB, at most three."""
        statics = [static for _, static, *_ in self._tensor_checks]
        return statics if graph_copyable(statics) else []

    def attach(self, copies: Sequence[copy_nodes.CopyNode]) -> None:
        """Copy the tensor arguments with the graph's own nodes (:meth:`copied_by_graph`'s order)."""
        if copies:
            self._tensor_checks = [(*c[:-1], node) for c, node in zip(self._tensor_checks, copies, strict=True)]
            self._set_one()

    # -- replay path -------------------------------------------------------------------------

    def flatten(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Sequence[Any]:
        """Return the call's leaves in capture order; raise on a different structure."""
        if self._only_args and not kwargs and len(args) == self.nargs:
            return args
        if self.flat and len(args) == self.nargs and len(kwargs) == len(self.kw_keys):
            try:
                return [*args, *[kwargs[k] for k in self.kw_keys]]
            except KeyError:
                pass  # a different keyword: the slow path names it
        return self._flatten_slow(args, kwargs)

    def copy_in(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Sequence[Any] | None:
        """Check every argument against the capture and copy tensors into the static buffers.

        Shape, dtype and device are checked here, before anything is written: those are the
        mismatches ``copy_`` would silently broadcast or convert. Anything else ``copy_`` refuses
        (a sparse tensor) is turned into the same error when it raises.

        Returns the call's leaves in capture order (training passes the caller's tensors on to
        autograd, so that gradients reach them); ``None``, having copied nothing, for a call
        autograd must record when :attr:`eager_if_tracked`.
        """
        # flatten's and _matches' common cases inline: this runs on every replay
        if self._only_args and not kwargs and len(args) == self.nargs:
            leaves: Sequence[Any] = args
        else:
            leaves = self.flatten(args, kwargs)
        one = self._one
        if one is not None:  # the common case: one tensor argument, no constants
            i, static, shape, dtype, device, slot, node = one
            leaf = leaves[i]
            if leaf is static:
                if node is not None:
                    node.off()
                return leaves
            plain = type(leaf) is _Tensor and leaf.shape == shape and leaf.dtype is dtype and leaf.get_device() == device
            if not plain and not _matches(leaf, shape, dtype, device):
                self._check_widening(i, slot, leaf)
                if leaf.requires_grad and self.eager_if_tracked and _grad_enabled():
                    return None
                if node is not None:
                    node.off()
                copy_widening([(static, leaf)])
                return leaves
            try:
                if leaf.requires_grad and self.eager_if_tracked and _grad_enabled():
                    return None
                if node is not None:  # the graph's first node copies it (point_or_off, inline)
                    if plain and leaf.is_contiguous() and not leaf.is_neg() and not _dual_level() and node.point(
                        leaf.data_ptr()  # (raises for a torch.func wrapper, which has no storage)
                    ):
                        return leaves
                    node.off()
                # one tensor through the multi-tensor copy: a microsecond less than copy_
                if leaf.requires_grad:  # (training) a copy autograd must not record
                    _copy_untracked([static], [leaf])
                else:
                    _foreach_copy([static], [leaf])
            except RuntimeError:
                raise self.tensor_error(slot, leaf) from None
            return leaves
        for i, value, slot in self._constant_checks:
            leaf = leaves[i]
            if leaf is not value and not same_constant(leaf, value):
                raise self.constant_error(slot, leaf)
        for i, own, slot in self.rebound:
            if not bind(own, leaves[i]):
                raise self.constant_error(slot, leaves[i])
        if self.generator_pairs:
            check_pairs(self.generator_pairs, leaves, self.paths)
        tracked = False
        for i, static, slot in self.adopted:
            if leaves[i] is not static:
                raise self.adopted_error(slot, leaves[i])
            tracked = tracked or static.requires_grad  # (autograd would record it: eagerly)
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        widened: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, static, shape, dtype, device, slot, node in self._tensor_checks:
            leaf = leaves[i]
            if leaf is static:
                if node is not None:
                    node.off()
                continue
            if not _matches(leaf, shape, dtype, device):
                self._check_widening(i, slot, leaf)  # a widening cast: copied on its own
                widened.append((static, leaf))
                if node is not None:
                    node.off()
            elif node is None or not point_or_off(node, leaf):
                dsts.append(static)
                srcs.append(leaf)
            tracked = tracked or leaf.requires_grad
        if tracked and self.eager_if_tracked and _grad_enabled():
            return None  # before anything is written
        if widened:
            copy_widening(widened)
        try:
            if dsts:
                (_copy_untracked if tracked else _foreach_copy)(dsts, srcs)
        except RuntimeError:
            for i, static, _, _, _, slot, _ in self._tensor_checks:
                leaf = leaves[i]
                if leaf is not static and (leaf.layout is not torch.strided or _compat.transformed(leaf)):
                    raise self.tensor_error(slot, leaf) from None
            raise
        return leaves

    def tracked_path(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The path of the first argument that requires grad (for a message)."""
        for slot, leaf in zip(self.slots, self.flatten(args, kwargs)):
            if isinstance(leaf, _Tensor) and leaf.requires_grad:
                return slot.path
        return "an argument"

    def _check_widening(self, i: int, slot: _Slot, leaf: Any) -> None:
        """Accept a tensor of the captured shape and device whose dtype widens losslessly into
        the captured one (warning once); raise the argument's error for anything else."""
        static = slot.static
        assert static is not None
        if not (
            isinstance(leaf, _Tensor)
            and leaf.shape == slot.shape
            and leaf.device == slot.device
            and leaf.layout is torch.strided
            and widens(leaf.dtype, slot.dtype)  # type: ignore[arg-type]
        ):
            raise self.tensor_error(slot, leaf)
        warn_widening(self._widened, i, slot.path, leaf.dtype, slot.dtype)  # type: ignore[arg-type]

    # -- input writes --------------------------------------------------------------------------

    def set_written(self, written: Sequence[int]) -> None:
        """Record which static buffers the graph writes, by position in :attr:`tensor_slots`
        (what :func:`~torchreplay.core.capture.capture` reports for ``watch=tensor buffers``)."""
        index = [i for i, s in enumerate(self.slots) if s.static is not None]
        self.written = tuple(index[k] for k in written)
        self.large = [i for i in self.large if i in self.written]  # (note_same_large's)
        self._write_backs = [(i, self.slots[i].static) for i in self.written]  # type: ignore[misc]

    def written_paths(self) -> list[str]:
        """The names of the arguments the graph writes (``["args[1] 'cache'"]``)."""
        return [self.slots[i].path for i in self.written]

    def note_same_large(self, leaves: Sequence[Any], name: str) -> None:
        """A large argument (:attr:`large`) the graph writes, passed as the same tensor as at
        the last call, not as its static buffer (a KV cache passed at every step): each call
        copies it in and back out, where eager copies nothing. Say so, once per graph, with the
        way around it. (Called after a replay that wrote its inputs: the replay path of a graph
        that writes none pays nothing.)"""
        for i in self.large:
            leaf, slot = leaves[i], self.slots[i]
            if leaf is slot.static or not isinstance(leaf, _Tensor):
                continue
            last = self._last_large.get(i)
            if last is None or last() is not leaf:
                self._last_large[i] = weakref.ref(leaf)
                continue
            self.large, self._last_large = [], {}
            static = slot.static
            assert static is not None
            log.warning(
                "torchreplay: '%s' gets the same %s (%s MiB) at every call, and each call copies "
                "it into the graph's input buffer and back out (the graph writes it): %s MiB of "
                "copies a call that eager does not make. Mark it with "
                "torch._dynamo.mark_static_address before graphing: the graph then reads and "
                "writes your tensor where it is, and nothing is copied (or use the graph's buffer, "
                "at the same place in g.static_args / g.static_kwargs, as that tensor)",
                name, slot.path, static.nbytes >> 20, 2 * (static.nbytes >> 20),
            )
            return

    def copy_back(self, leaves: Sequence[Any]) -> None:
        """After a replay: copy every written static buffer into the caller's tensor, as an
        eager call would have left it (nothing to do where the caller passed the buffer)."""
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for i, static in self._write_backs:
            leaf = leaves[i]
            if leaf is not static:
                dsts.append(leaf)
                srcs.append(static)
        write_back(dsts, srcs)
        for i, own, _ in self.rebound:  # (the call's generators move on as the replay drew)
            hand_back(own, leaves[i])

    def check_aliasing(self, leaves: Sequence[Any], where: str = "call") -> None:
        """Refuse a call whose written argument shares memory with another tensor argument.

        Eagerly, the callable's write through one would be seen through the other; the graph
        reads and writes two separate static buffers, so the result would silently differ.
        """
        if not self.written:
            return
        spans: dict[int, tuple[int, int]] = {}
        for i, static, *_ in self._tensor_checks:
            leaf = leaves[i]
            if isinstance(leaf, _Tensor) and leaf is not static:
                spans[i] = byte_span(leaf)
        for i in self.written:
            if i not in spans:
                continue
            lo, hi = spans[i]
            for j, (lo2, hi2) in spans.items():
                if j != i and lo < hi2 and lo2 < hi:
                    error = CaptureError if where == "capture" else ReplayInputError
                    raise error(
                        f"{self.slots[i].path} and {self.slots[j].path} share memory, and the "
                        f"callable writes {self.slots[i].path}: eagerly the write would show "
                        f"through {self.slots[j].path}, but a graph reads and writes separate "
                        "static buffers, so the result would differ. Pass tensors that do not "
                        "overlap (.clone() one of them)"
                    )

    # -- errors --------------------------------------------------------------------------------

    def tensor_error(self, slot: _Slot, leaf: Any) -> ReplayInputError:
        """Build the error for a tensor argument that does not match its capture."""
        if isinstance(leaf, _Tensor) and _compat.transformed(leaf):
            return TransformedInput(
                f"{slot.path} is a tensor of a torch.func transform (vmap, grad, jvp) or a "
                "forward-mode AD dual: a graph replays fixed kernels and can neither batch nor "
                "carry tangents. Call the eager function inside the transform"
            )
        assert slot.static is not None
        captured = describe_tensor(slot.static)
        if not isinstance(leaf, _Tensor):
            return ReplayInputError(
                f"{slot.path}: expected a tensor ({captured}) as at capture, "
                f"got {type(leaf).__name__}; pass a tensor of the captured shape and dtype"
            )
        seen = describe_tensor(leaf)
        if leaf.shape != slot.shape:
            fix = (
                "pass a tensor of the captured shape, or graph with sizes=[...] "
                "so that several sizes are captured"
            )
        else:
            fix = conversion_fix(leaf, slot)
        return ReplayInputError(
            f"{slot.path}: {seen}, but the graph was captured with {captured}; {fix} "
            "(a graph never broadcasts or converts its inputs)"
        )

    def adopted_error(self, slot: _Slot, leaf: Any) -> ReplayInputError:
        """Build the error for a call that passes another tensor where an adopted one was."""
        seen = describe_tensor(leaf) if isinstance(leaf, _Tensor) else type(leaf).__name__
        return ReplayInputError(
            f"{slot.path}: another tensor ({seen}) than the one the graph was captured with, "
            "which was marked with torch._dynamo.mark_static_address: the graph reads and "
            "writes that very tensor where it is, so every call must pass it. Pass it, or "
            "graph a tensor that is not marked (the graph then copies it in at every call)"
        )

    @contextlib.contextmanager
    def rewinding(self) -> Iterator[Rewind | None]:
        """Around the build's real calls: what they write into the adopted tensors (the
        caller's own) is put back after, as core/rewind.py does for Python state. Yields the
        :class:`Rewind` (None: nothing adopted), whose ``undo()`` puts them back sooner."""
        if not self.adopted:
            yield None
            return
        rewind = Rewind([t for _, t, _ in self.adopted], [s.path for _, _, s in self.adopted])
        try:
            with rewind:
                yield rewind
        finally:
            rewind.undo()
            rewind.warn_unseen()

    def constant_error(self, slot: _Slot, leaf: Any) -> ReplayInputError:
        """Build the error for a non-tensor argument that differs from the captured constant."""
        if slot.rebound:
            return not_fitting(slot.path, leaf, slot.value)
        return ReplayInputError(
            f"{slot.path}: {leaf!r} but the graph was captured with the constant "
            f"{slot.value!r}; non-tensor arguments are baked into the graph: pass "
            f"{slot.value!r}, graph again for this value, or pass it as a tensor so it can "
            "change between calls"
        )

    def _flatten_slow(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        if set(kwargs) == set(self.kw_keys):
            kwargs = {k: kwargs[k] for k in self.kw_keys}  # capture order, not call order
        leaves, spec = _compat.tree_flatten((tuple(args), dict(kwargs)))
        if spec == self.spec:
            return leaves
        raise ReplayInputError(self._structure_mismatch(args, kwargs))

    def _structure_mismatch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        if len(args) != self.nargs:
            return (
                f"{len(args)} positional arguments but the graph was captured with "
                f"{self.nargs}; call it with the same arguments as at capture"
            )
        missing = [k for k in self.kw_keys if k not in kwargs]
        extra = [k for k in kwargs if k not in self.kw_keys]
        if missing or extra:
            return (
                f"keyword arguments differ from the capture: missing {missing}, "
                f"unexpected {extra}; call it with the same keywords as at capture"
            )
        for i, (a, b) in enumerate(zip(args, self.static_args)):
            if _compat.tree_flatten(a)[1] != _compat.tree_flatten(b)[1]:
                return (
                    f"args[{i}]: its structure {_compat.tree_flatten(a)[1]} differs from the "
                    f"captured {_compat.tree_flatten(b)[1]}; pass the same nesting of "
                    "containers as at capture"
                )
        for k in self.kw_keys:
            a, b = kwargs[k], self.static_kwargs[k]
            if _compat.tree_flatten(a)[1] != _compat.tree_flatten(b)[1]:
                return (
                    f"kwargs['{k}']: its structure differs from the capture; pass the same "
                    "nesting of containers as at capture"
                )
        return "the arguments' structure differs from the capture"
