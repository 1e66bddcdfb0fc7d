"""The only package that touches private torch APIs, and the version checks.

``distributed.py`` holds the ``torch.distributed`` ones (re-exported here). Each private name is
imported here, with a comment saying why it is needed and what happens on a
torch version that lacks it. Everything else in torchreplay imports from here, never from
``torch._C`` or ``torch.utils._*`` directly. Importing this module initialises no CUDA.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Sequence

import torch

__all__ = [
    "TORCH_VERSION",
    "TorchDispatchMode",
    "TreeSpec",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_unflatten",
    "call_unflattener",
    "keystr",
    "register_pytree_node",
    "is_leaf_treespec",
    "unflattener",
    "foreach_copy_",
    "foreach_zero_",
    "HAS_CHECKED_OUTPUTS",
    "alias_storage",
    "tensor_from_storage",
    "invalidate_storage",
    "HAS_USE_COUNTS",
    "tensor_use_count",
    "storage_use_count",
    "storage_handle",
    "abandon_pool",
    "end_rng_capture",
    "clear_cublas_workspaces",
    "LightDispatchMode",
    "foreach_clone",
    "autocast_cache_disabled",
    "GradScalerState",
    "grad_scaler_state",
    "set_grad_scaler_state",
    "supports_amp_scaling",
    "module_hooks",
    "written_tensors",
    "written_arguments",
    "returns_view",
    "returns_fresh",
]


def _version_tuple(v: str) -> tuple[int, int]:
    major, minor = v.split("+")[0].split(".")[:2]
    return int(major), int(minor)


TORCH_VERSION: tuple[int, int] = _version_tuple(torch.__version__)

# Pytrees: torch's own pytree is the one users register dataclasses with
# (torch.utils._pytree.register_pytree_node / register_dataclass), so we must use the same registry.
# It has been stable since torch 2.2; we require >= 2.6.
from torch.utils import _pytree as _pytree  # noqa: E402

TreeSpec = _pytree.TreeSpec
tree_flatten = _pytree.tree_flatten
tree_flatten_with_path = _pytree.tree_flatten_with_path
tree_unflatten = _pytree.tree_unflatten
keystr = _pytree.keystr
register_pytree_node = _pytree.register_pytree_node


def is_leaf_treespec(spec: TreeSpec) -> bool:
    """Return True when ``spec`` describes a single leaf."""
    # TreeSpec.is_leaf() exists on every supported version; LeafSpec was folded into it in 2.8.
    return spec.is_leaf()


def _children(spec: TreeSpec) -> list[TreeSpec]:
    return list(spec.children() if hasattr(spec, "children") else spec.children_specs)


def unflattener(spec: TreeSpec) -> Callable[[list[Any]], Any]:
    """``tree_unflatten(leaves, spec)`` as one callable, made once per spec: for a list, tuple
    or dict of leaves (what a model or a piece most often returns) the container is built
    directly, a tenth of the cost of the general walk; anything else takes the walk."""
    children = _children(spec)
    if spec.type in (list, tuple, dict) and all(c.is_leaf() for c in children):
        if spec.type is list:
            return list
        if spec.type is tuple:
            return tuple
        keys = list(spec.context)
        return lambda leaves: dict(zip(keys, leaves))
    return lambda leaves: _pytree.tree_unflatten(leaves, spec)


def call_unflattener(spec: TreeSpec) -> Callable[[list[Any]], Any]:
    """``tree_unflatten(flat, spec)`` for the spec of a call's ``(args, kwargs)``, made once:
    where each argument is one leaf or ``None`` (an op's call), ``(args, kwargs)`` is built
    directly, without the general walk; anything else takes the walk."""
    walk = lambda flat: _pytree.tree_unflatten(flat, spec)  # noqa: E731
    kids = _children(spec)
    if spec.type is not tuple or len(kids) != 2 or kids[0].type is not tuple or kids[1].type is not dict:
        return walk
    slots: list[int] = []  # per argument: its index in flat, -1 for None
    leaves = 0
    for c in [*_children(kids[0]), *_children(kids[1])]:
        if c.is_leaf():
            slots.append(leaves)
            leaves += 1
        elif c.type is type(None):
            slots.append(-1)
        else:
            return walk
    keys = list(kids[1].context)
    pos, kw = slots[:len(slots) - len(keys)], slots[len(slots) - len(keys):]
    return lambda flat: (
        tuple([flat[j] if j >= 0 else None for j in pos]),
        {k: flat[j] if j >= 0 else None for k, j in zip(keys, kw)},
    )


# The dispatch mode that check.py uses to see every aten op. Private module, public in spirit:
# stable since 2.0 and used by every torch-based tracer.
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


# One kernel launch for many copies instead of one per input. torch._foreach_copy_ exists since
# 2.1; on a version without it we fall back to one copy_ per tensor (correct, slower).
_foreach_copy = getattr(torch, "_foreach_copy_", None)


def _copy_each(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:  # pragma: no cover - old torch
    for d, s in zip(dsts, srcs):
        d.copy_(s)


#: ``foreach_copy_(dsts, srcs)``: copy ``srcs[i]`` into ``dsts[i]`` for every i, in as few
#: launches as torch allows (torch's own function where it has one: no Python frame of ours,
#: as it runs on every replay; for one tensor it is also a microsecond cheaper than ``copy_``).
foreach_copy_: Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], None] = (
    _foreach_copy if _foreach_copy is not None else _copy_each
)

_foreach_zero = getattr(torch, "_foreach_zero_", None)


def _zero_each(tensors: Sequence[torch.Tensor]) -> None:  # pragma: no cover - old torch
    for t in tensors:
        t.zero_()


#: ``foreach_zero_(tensors)``: zero every tensor, in as few launches as torch allows.
foreach_zero_: Callable[[Sequence[torch.Tensor]], None] = (
    _foreach_zero if _foreach_zero is not None else _zero_each
)


# Checked outputs (the default output policy) hand out tensors that have their own, non-owning
# StorageImpl over the graph's output memory; when a later replay overwrites that memory we set an
# access-error message on that storage, so any later read raises instead of returning stale data.
# These are the bindings torch's own cudagraph trees use for the same purpose. They exist only in
# CUDA builds; without them, HAS_CHECKED_OUTPUTS is False and core/io.py uses outputs="clone".
_construct_storage = getattr(torch._C, "_construct_storage_from_data_pointer", None)
_construct_tensor = getattr(torch._C, "_construct_CUDA_Tensor_From_Storage_And_Metadata", None)
_set_storage_error = getattr(torch._C, "_set_storage_data_ptr_access_error_msg", None)

HAS_CHECKED_OUTPUTS: bool = _construct_storage is not None and _set_storage_error is not None


def _alias_storage(data_ptr: int, device: torch.device, nbytes: int) -> torch.UntypedStorage:
    """Return a new storage that views ``nbytes`` at ``data_ptr`` without owning them."""
    assert _construct_storage is not None
    return _construct_storage(data_ptr, device, nbytes)


def _tensor_from_storage(meta: dict[str, Any], storage: torch.UntypedStorage) -> torch.Tensor:
    """Build a tensor with ``meta``'s size, stride, offset and dtype over ``storage``."""
    if _construct_tensor is not None and meta["device"].type == "cuda":
        return _construct_tensor(meta, storage)
    t = torch.empty((0,), dtype=meta["dtype"], device=meta["device"])
    return t.set_(storage, meta["storage_offset"], meta["size"], meta["stride"])


# On the replay path of every checked call: the bindings themselves where they exist (a Python
# wrapper costs a few hundred nanoseconds per output).
alias_storage: Callable[[int, torch.device, int], torch.UntypedStorage] = (
    _construct_storage if _construct_storage is not None else _alias_storage
)
tensor_from_storage: Callable[[dict[str, Any], torch.UntypedStorage], torch.Tensor] = (
    _construct_tensor if _construct_tensor is not None else _tensor_from_storage
)


def weak_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory that does not keep that memory allocated (``t`` itself where
    this torch cannot build one). For values in a graph pool whose graphs keep the pool: once the
    last owner is gone, later captures in the pool may use the memory as well."""
    if _construct_storage is None:
        return t
    st = t.untyped_storage()
    storage = _construct_storage(st.data_ptr(), t.device, st.nbytes())
    with torch.inference_mode(False):  # a normal tensor: a buffer of ours, written in either mode
        return torch.empty((0,), dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.shape, t.stride())


def invalidate_storage(storage: torch.UntypedStorage, message: str) -> None:
    """Make every later read of ``storage`` (and of every view of it) raise ``message``."""
    assert _set_storage_error is not None
    _set_storage_error(storage._cdata, message)


# How many C++ owners a tensor's TensorImpl and a storage's StorageImpl have: outputs="checked"
# hands the last call's output tensors out again when nobody else can reach them (core/outputs.py,
# _unheld). ``Tensor._use_count`` and ``torch._C._storage_Use_Count`` (the latter is what
# cudagraph trees use to see whether an output is still alive) exist in torch >= 2.5; without
# them every call makes new tensors, which is correct, only slower. Both are on the checked
# replay path, so they are the bindings themselves, not wrappers (a wrapper costs ~0.1 us).
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)
HAS_USE_COUNTS: bool = _storage_use_count is not None and hasattr(torch.Tensor, "_use_count")
#: ``tensor_use_count(t)``: the use count of ``t``'s TensorImpl (1: only its Python object).
tensor_use_count: Callable[[torch.Tensor], int] | None = getattr(torch.Tensor, "_use_count", None)
#: ``storage_use_count(storage_handle(s))``: the use count of ``s``'s StorageImpl (its Python
#: object and each tensor over it). The handle is valid while ``s`` is alive.
storage_use_count: Callable[[int], int] | None = _storage_use_count


def storage_handle(storage: torch.UntypedStorage) -> int:
    """The address of ``storage``'s StorageImpl (``_cdata``, private), for :data:`storage_use_count`."""
    return storage._cdata


def storage_key(t: torch.Tensor) -> int:
    """A number equal for tensors on one storage (views of each other), fake tensors too (whose
    data pointers are all 0): the storage object's C++ address, ``UntypedStorage._cdata``
    (private, stable since torch 2.0); a tensor without storage (sparse, nested): its own id."""
    try:
        return t.untyped_storage()._cdata
    except Exception:
        return id(t)


# Fresh copies of many tensors in one multi-tensor launch instead of one clone per tensor:
# training hands these to autograd as parameter gradients that AccumulateGrad may keep as
# ``.grad`` (x * 1.0 is exact for every floating value). torch._foreach_mul exists since 1.7; on a
# torch without it, one clone per tensor (correct, more launches).
_foreach_mul = getattr(torch, "_foreach_mul", None)


def foreach_clone(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Return new tensors equal to ``tensors`` (same dtype, device and strides)."""
    if _foreach_mul is not None and tensors:
        return list(_foreach_mul(list(tensors), 1.0))
    return [t.clone() for t in tensors]  # pragma: no cover - old torch


@contextlib.contextmanager
def autocast_cache_disabled() -> Iterator[None]:
    """Turn autocast's cache of cast weights off for the block, then restore the setting.

    With the cache on, a weight cast during capture is cached: the graph reads that cached
    copy (allocated in the graph's pool, or before capture by warm-up) and the cast is not part
    of the graph, so replays after an optimizer step read stale or freed weights. Without the
    cache every cast is recorded. ``torch.is_autocast_cache_enabled`` and
    ``torch.set_autocast_cache_enabled`` are re-exports of ``torch._C`` bindings that exist since
    torch 1.10; on a torch without them the block runs unchanged.
    """
    getter = getattr(torch, "is_autocast_cache_enabled", None)
    setter = getattr(torch, "set_autocast_cache_enabled", None)
    if getter is None or setter is None:  # pragma: no cover - old torch
        yield
        return
    before = getter()
    setter(False)
    try:
        yield
    finally:
        setter(before)


# A GradScaler's state lives in private attributes (there is no public getter that avoids a sync
# or a setter for the growth tracker): the scale and growth-tracker tensors, created lazily on
# the first scale(), and the per-optimizer stage dicts. Names unchanged since torch 1.6; on a
# torch that renamed them, the getter returns Nones and graph_step restores nothing (the scale
# then starts where warm-up left it, which is still correct training).
@dataclasses.dataclass
class GradScalerState:
    """What a training warm-up changes in a ``GradScaler``."""

    scale: torch.Tensor | None
    growth_tracker: torch.Tensor | None
    init_scale: float
    init_growth_tracker: int
    per_optimizer: dict[Any, dict[str, Any]] | None


def grad_scaler_state(scaler: Any) -> GradScalerState:
    """Return ``scaler``'s tensors (the objects themselves) and a copy of its per-optimizer state."""
    per_opt = getattr(scaler, "_per_optimizer_states", None)
    return GradScalerState(
        scale=getattr(scaler, "_scale", None),
        growth_tracker=getattr(scaler, "_growth_tracker", None),
        init_scale=float(getattr(scaler, "_init_scale", 2.0**16)),
        init_growth_tracker=int(getattr(scaler, "_init_growth_tracker", 0)),
        per_optimizer=None if per_opt is None else {k: dict(v) for k, v in per_opt.items()},
    )


def set_grad_scaler_state(scaler: Any, per_optimizer: dict[Any, dict[str, Any]] | None) -> None:
    """Put back a per-optimizer state saved by :func:`grad_scaler_state` (a stage that warm-up
    left as "unscaled" would make the next real ``scaler.step`` skip its unscale)."""
    current = getattr(scaler, "_per_optimizer_states", None)
    if per_optimizer is None or not isinstance(current, dict):
        return
    current.clear()
    current.update({k: dict(v) for k, v in per_optimizer.items()})


def supports_amp_scaling(opt: Any) -> bool:
    """Does ``GradScaler.step(opt)`` hand the scale to the optimizer (fused kernels) instead of
    checking for infs with ``.item()``? torch marks such optimizers with the private flag
    ``_step_supports_amp_scaling`` (since 1.10); without it, False (graph_step then refuses a
    GradScaler, which is the safe answer)."""
    return bool(getattr(opt, "_step_supports_amp_scaling", False))


def abandon_pool(device: int, pool: tuple[int, int]) -> None:
    """Undo what ``capture_begin`` did to the allocator when ``capture_end`` failed.

    When CUDA invalidates a capture, torch's ``CUDAGraph.capture_end`` raises before it stops
    routing allocations into the graph's pool and before the graph would give its reference on
    the pool back (that only happens for a capture that ended). Doing both here lets the pool's
    memory be freed by ``torch.cuda.empty_cache()``. Both bindings exist since torch 2.1; on a
    torch without them the pool stays reserved (a leak, never a crash).
    """
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    release = getattr(torch._C, "_cuda_releasePool", None)
    if end is not None:
        try:
            end(device, pool)
        except RuntimeError:  # torch already ended it (newer versions do on failure)
            return
    if release is not None:
        release(device, pool)


def end_rng_capture(generators: Sequence[torch.Generator] = ()) -> None:
    """Clear the "capturing" mark a failed capture leaves on the device's default generator and
    on the explicit ``generators`` registered with its graph.

    torch <= 2.12 marks the default CUDA generator of the capturing device as capturing in
    ``capture_begin`` and clears the mark in ``capture_end`` only after ``cudaStreamEndCapture``
    succeeded. When CUDA invalidated the capture, ``capture_end`` raises first, and every later
    random op in the process fails with "Offset increment outside graph capture encountered
    unexpectedly". An empty capture on the current (side) stream runs torch's prologue and
    epilogue once more, which clears the mark on the same generator state (graphs captured
    earlier keep sharing that state, so their RNG stays in step with eager). Newer torch keeps
    per-capture state and needs nothing; the empty capture is harmless there. Public API only;
    it is here because it works around a torch version's behaviour.

    A generator registered with the failed graph (``register_generator_state``) carries the
    same mark, set by the same prologue; registered with the empty graph too, its mark is
    cleared alike (seen on torch 2.11: a trial capture that failed at an ``.item()`` left the
    module's own generator unusable).
    """
    import warnings

    graph = torch.cuda.CUDAGraph()
    for gen in generators:
        with contextlib.suppress(Exception):
            graph.register_generator_state(gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the CUDA graph is empty"
        with contextlib.suppress(Exception):
            graph.capture_begin()
            graph.capture_end()
    with contextlib.suppress(Exception):
        graph.reset()


_clear_cublas = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)


def clear_cublas_workspaces() -> None:
    """Drop torch's cached cuBLAS workspaces (one per cuBLAS handle and stream).

    A captured matmul bakes the address of its stream's workspace into the graph. When the
    workspace was allocated before the capture (a warm-up on the same stream), it is ordinary
    memory that the graph does not own, and whoever clears the workspaces afterwards frees it
    under the graph: ``torch.compile(mode="reduce-overhead")`` does so around each of its own
    recordings, and the next replay read freed memory ("an illegal memory access", seen on an
    H200 with a reduce-overhead model next to ours). Cleared right before ``capture_begin``, the
    capture allocates a fresh workspace in the graph's own pool; cleared again after
    ``capture_end``, that workspace becomes free memory of the pool (scratch, like any
    intermediate of the capture) and no later capture into another pool reuses it. cudagraph
    trees do the same. ``torch._C._cuda_clearCublasWorkspaces`` exists since torch 2.0; without
    it nothing is done.
    """
    if _clear_cublas is not None:
        _clear_cublas()


class LightDispatchMode(TorchDispatchMode):
    """A TorchDispatchMode whose ``__torch_dispatch__`` torch does not wrap for torch.compile.

    TorchDispatchMode wraps each subclass's ``__torch_dispatch__`` in ``torch._disable_dynamo``,
    whose first call imports torch._dynamo (1-3 s) only so that compile will not trace into the
    mode. check.py's mode is never run under compile, so it opts out through the documented
    ``_should_skip_dynamo`` class hook. A torch without that hook ignores the override and pays
    the import, nothing else changes.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


def inductor_compile(
    gm: Any, example_inputs: Sequence[Any], inner_compile: Callable[..., Any] | None = None
) -> Callable[..., Any]:
    """Compile an FX graph with Inductor and return ``fn(*args) -> tuple``.

    ``torch._inductor.compile_fx.compile_fx`` is what ``backend="inductor"`` runs; it is called
    directly (no patching) for each piece the split made. ``inner_compile`` is its documented
    hook for the compiler of each forward and backward graph after AOT autograd (cudagraph trees
    sit at the same place). With one, AOT autograd's cache is off for the call (a hit would not
    call the hook), and so are donated buffers: with them, the backward's code may write a
    gradient into the memory of a saved activation it read last (``buf5 = buf0``, Inductor's
    ``can_reuse`` of a ``DonatedBuffer``). Our backward graph reads the saved activations where
    the forward graph left them, in the forward's pool: that gradient would lie in memory the
    next forward replay overwrites (HF Gemma2 and BART trained through the backend raised
    StaleOutputError in the backward). Private module, stable since 2.0; an option this torch
    lacks is left alone."""
    from torch._inductor.compile_fx import compile_fx

    if inner_compile is None:
        with safe_aot_cache():
            return compile_fx(gm, list(example_inputs))
    import torch._functorch.config as functorch_config

    off = {
        k: False for k in ("enable_autograd_cache", "donated_buffer") if hasattr(functorch_config, k)
    }
    with functorch_config.patch(**off):
        return compile_fx(gm, list(example_inputs), inner_compile=inner_compile)


def compile_fx_inner(gm: Any, example_inputs: Sequence[Any], *, donate: bool = True, **kwargs: Any) -> Any:
    """Inductor's compiler of one forward or backward graph (the default ``inner_compile``).
    ``donate=False``: the backward may not write into its saved activations (the donated
    buffers AOT autograd chose are dropped from the tracing context's metadata, which Inductor
    reads them from; :func:`inductor_compile` turns their choice off too, this covers a backward
    compiled later under other settings)."""
    from torch._inductor.compile_fx import compile_fx_inner as inner

    if not donate:
        context = torch._guards.TracingContext.try_get()
        meta = getattr(context, "fw_metadata", None)
        if getattr(meta, "bw_donated_idxs", None):
            meta.bw_donated_idxs = []  # type: ignore[union-attr]
    return inner(gm, example_inputs, **kwargs)


def saved_outputs_start() -> int | None:
    """In a forward graph being compiled under AOT autograd: the index of its first output that
    is saved for the backward (the ones before are the user's outputs and mutated inputs), from
    the tracing context's ``fw_metadata`` (``num_forward``: with the RNG offset output, if any).
    None where torch does not say (then no output is treated as saved)."""
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
    n = getattr(meta, "num_forward", None)
    if n is None:
        n = getattr(meta, "num_forward_returns", None)
    return n if isinstance(n, int) else None


_ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


def data_ptrs_equal(values: Sequence[Any], ptrs: Sequence[int | None], idxs: Sequence[int]) -> bool:
    """Does ``values[i].data_ptr() == ptrs[i]`` hold for every i in ``idxs``? One C++ call where
    torch has it (``torch._C._tensors_data_ptrs_at_indices_equal``, what cudagraph trees use to
    see that parameters stayed put; CUDA builds), a Python loop elsewhere."""
    if _ptrs_equal is not None:
        return _ptrs_equal(values, ptrs, idxs)
    return all(values[i].data_ptr() == ptrs[i] for i in idxs)


_GraphBase = getattr(torch._C, "_CUDAGraph", None)
_base_replay = getattr(_GraphBase, "replay", None)  # a CPU build has the class without it


def direct_replay(graph: Any) -> Callable[[], None]:
    """``graph.replay`` without ``torch.cuda.CUDAGraph``'s Python override where that override
    has nothing to do for this graph: no input-liveness tracker (``check_input_liveness``, which
    we never ask for) and its executable graph made at ``capture_end`` (no ``keep_graph``). The
    C++ replay bound directly, one Python frame less per replay; else ``graph.replay``."""
    if (
        _base_replay is None
        or not isinstance(graph, _GraphBase)  # type: ignore[arg-type]
        or getattr(graph, "_tracker", None) is not None
        or getattr(graph, "_has_graph_exec", True) is False
    ):
        return graph.replay
    return _base_replay.__get__(graph, type(graph))


@contextlib.contextmanager
def dispatch_modes_off() -> Iterator[None]:
    """No ``TorchDispatchMode`` sees the ops run inside (a break's own ops, while the check
    looks at the rest of a model)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


from torchreplay._compat.cache import (  # noqa: E402  (the compile cache's names)
    ambient,
    artifact_saveable,
    has_standalone_compile,
    inductor_config_hash,
    load_artifact,
    save_artifact,
    shape_ranges,
    standalone_compile,
)

__all__ += ["direct_replay"]
__all__ += [
    "ambient", "standalone_compile", "has_standalone_compile", "artifact_saveable", "save_artifact",
    "load_artifact", "inductor_config_hash", "shape_ranges",
]
from torchreplay._compat.distributed import (  # noqa: E402  (the torch.distributed names)
    default_store, dist_ready, group_named, group_of_arg, group_ranks,
)

__all__ += ["default_store", "dist_ready", "group_named", "group_of_arg", "group_ranks"]
from torchreplay._compat.ops import (  # noqa: E402  (a custom op's kernel and schema, what compile made)
    OP_TYPES, OpOverload, OpOverloadPacket, argument_kinds, call_untraced, compiled_module, compiled_target, custom_op_kernel, dynamo_tracing, eval_frame_callback,
    higher_order, modes_active, plain_value, static_address, without_dynamo_guard,
)

__all__ += ["OP_TYPES", "OpOverload", "OpOverloadPacket", "argument_kinds", "call_untraced", "dynamo_tracing", "compiled_module", "compiled_target", "custom_op_kernel", "eval_frame_callback",
            "higher_order", "modes_active", "plain_value", "static_address", "without_dynamo_guard"]
from torchreplay._compat.shapes import (  # noqa: E402  (Dynamo's symbolic shapes and graph inputs)
    adopt_scalar_fakes, backed_size_oblivious, dynamo_restart, dynamo_source_name, fake_mode_of, fresh_unbacked_ignored,
    is_static_input, mark_dynamic, mark_unbacked, maybe_mark_dynamic, new_unbacked_symbols, symbol_of,
)

__all__ += ["adopt_scalar_fakes", "backed_size_oblivious", "dynamo_restart", "dynamo_source_name", "fake_mode_of", "fresh_unbacked_ignored",
            "is_static_input", "mark_dynamic", "mark_unbacked", "maybe_mark_dynamic", "new_unbacked_symbols", "symbol_of"]
from torchreplay._compat.schema import (  # noqa: E402  (what an aten op writes, per its schema)
    returns_fresh,
    returns_view,
    written_arguments,
    written_tensors,
)
from torchreplay._compat.streams import current_stream  # noqa: E402
from torchreplay._compat.mempool import PrivateAllocations, private_allocations  # noqa: E402  (a private pool)
from torchreplay._compat.hooks import (  # noqa: E402
    backward_hooks, forward_hooks, global_backward_hooks, global_forward_hooks, global_optimizer_hooks,
    hook_handles_made, module_hooks, optimizer_hooks, tensor_hooks,
)
__all__ += ["forward_hooks", "global_forward_hooks", "hook_handles_made", "backward_hooks",
            "global_backward_hooks", "tensor_hooks", "optimizer_hooks", "global_optimizer_hooks", "PrivateAllocations",
            "private_allocations"]
from torchreplay._compat.amp import any_autocast, cuda_autocast, dispatch_modes, safe_aot_cache  # noqa: E402
from torchreplay._compat.autograd import (  # noqa: E402  (autograd's node order and version counters)
    direct_apply, foreach_copy_untracked, function_forwards, function_of_call, function_of_ctx, in_backward,
    is_accumulate_grad, is_custom_op_function, is_view, normal_tensors, restore_unversioned, copy_back, unexpanded,
    expanded_dims, clone_strided, dense,
    saved_tensor_hooks, sequence_nr, set_sequence_nr, transform_active, transformed, triton_launches, version_of, versions_of,
    watch_saved, dual_level,
)
__all__ += ["safe_aot_cache", "any_autocast", "cuda_autocast", "dispatch_modes", "current_stream", "direct_apply",
            "transform_active", "transformed", "dual_level",
            "foreach_copy_untracked", "in_backward", "is_accumulate_grad", "is_view", "normal_tensors",
            "restore_unversioned", "copy_back", "unexpanded", "expanded_dims", "clone_strided", "dense",
            "saved_tensor_hooks", "sequence_nr", "set_sequence_nr", "version_of",
            "versions_of", "function_forwards", "function_of_call", "function_of_ctx", "is_custom_op_function",
            "triton_launches", "watch_saved"]
from torchreplay._compat.rng import register_generator  # noqa: E402  (a graph drawing from a generator of the user's)
__all__ += ["register_generator"]
from torchreplay._compat.replicas import replica_calling  # noqa: E402  (an nn.DataParallel replica, from its frame)
__all__ += ["replica_calling"]
