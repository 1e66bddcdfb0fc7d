"""The private torch names of the compile cache (``compile/cache.py``): Inductor's saveable
artifacts and its configuration hash, the value ranges of a graph's dynamic sizes, and the
settings a compile bakes in from its context."""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch

from torchreplay._compat.amp import any_autocast, safe_aot_cache

__all__ = [
    "ambient", "standalone_compile", "has_standalone_compile", "artifact_saveable", "save_artifact",
    "load_artifact", "inductor_config_hash", "shape_ranges",
]


def ambient() -> dict[str, Any]:
    """What a compile bakes into its code from the context of the compile, not from the graph
    (part of any key of compiled code; Inductor's own FX graph cache keys the same settings):
    grad mode; the dtype each device's autocast casts to (Dynamo's graph of a model called under
    ``torch.autocast`` holds no casts, the code does); the float32 matmul precision (TF32 or not
    in Inductor's matmul templates) and reduced-precision reductions; deterministic algorithms.
    Public getters; one a torch lacks reads as missing."""
    devices = getattr(torch._C, "_autocast_supported_devices", lambda: ["cpu", "cuda"])()
    casts: dict[str, str] = {}
    if any_autocast():
        for device in devices:
            with contextlib.suppress(Exception):  # (a device this build cannot ask about)
                if torch.is_autocast_enabled(device):
                    casts[device] = str(torch.get_autocast_dtype(device))
    matmul = torch.backends.cuda.matmul
    return {
        "grad": torch.is_grad_enabled(),
        "autocast": casts,
        "matmul": [
            _fp32_matmul(),
            matmul.allow_fp16_reduced_precision_reduction,
            matmul.allow_bf16_reduced_precision_reduction,
        ],
        "deterministic": [
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ],
    }


def _fp32_matmul() -> str:
    """The float32 matmul precision: ``highest``, ``high`` (TF32) or ``medium``. (Not the newer
    per-backend ``fp32_precision``, which reads ``none`` or ``ieee`` for the same setting; torch
    refuses the old getter once both APIs were used: then that one's value.)"""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return f"fp32_precision={getattr(torch.backends.cuda.matmul, 'fp32_precision', None)}"


def standalone_compile(gm: Any, example_inputs: Sequence[Any]) -> Any:
    """Compile an FX graph with Inductor into a ``CompiledArtifact`` that can be saved to disk
    (``torch._inductor.standalone_compile``, public since torch 2.8; what vLLM compiles its
    pieces with). Inside a ``torch.compile`` backend the dynamic shapes come from Dynamo's
    tracing context; elsewhere from the graph. Raises ``UnsupportedError``-worthy
    ``AttributeError`` on a torch without it (the caller runs without the cache)."""
    import torch._inductor

    fn = torch._inductor.standalone_compile
    in_context = torch._guards.TracingContext.try_get() is not None
    dynamic = "from_tracing_context" if in_context else "from_graph"
    with safe_aot_cache():
        return fn(gm, list(example_inputs), dynamic_shapes=dynamic, options={})


def has_standalone_compile() -> bool:
    import torch._inductor

    return hasattr(torch._inductor, "standalone_compile") and hasattr(torch._inductor, "CompiledArtifact")


def artifact_saveable(artifact: Any) -> bool:
    """Did the compile leave something to save (a graph torch cannot serialise leaves none)?"""
    check = getattr(artifact, "is_saveable", None)
    if callable(check):
        return bool(check())
    return getattr(artifact, "_artifacts", True) is not None


def save_artifact(artifact: Any, path: str) -> None:
    artifact.save(path=path, format="binary")


def load_artifact(path: str) -> Any:
    """``CompiledArtifact.load``: it puts the compiled code into Inductor's own caches and loads
    it from there, without compiling. It checks no dynamic-shape guards: the cache key does."""
    import torch._inductor

    return torch._inductor.CompiledArtifact.load(path=path, format="binary")


def inductor_config_hash() -> str:
    """A hash of Inductor's configuration (what its own FX graph cache keys on), so that a
    changed setting (``max_autotune``, say) is a cache miss."""
    import hashlib

    from torch._inductor import config

    get_hash = getattr(config, "get_hash", None)
    if callable(get_hash):
        return hashlib.sha256(get_hash()).hexdigest()
    return hashlib.sha256(repr(sorted(config.get_config_copy().items())).encode()).hexdigest()


def shape_ranges(values: Sequence[Any]) -> list[str]:
    """The value range of every free symbol in the shapes of ``values`` (fake tensors, SymInts),
    sorted: what a compiled piece assumes about its dynamic sizes."""
    from torchreplay._compat import fake_mode_of, symbol_of

    mode = fake_mode_of(values)
    env = getattr(mode, "shape_env", None)
    if env is None:
        return []
    symbols: set[Any] = set()
    for v in values:
        dims = list(v.shape) + list(v.stride()) if isinstance(v, torch.Tensor) else [v]
        for d in dims:
            expr = symbol_of(d)
            if expr is not None:
                symbols |= set(getattr(expr, "free_symbols", ()))
    ranges = getattr(env, "var_to_range", {})
    return sorted(f"{s}: {ranges.get(s)}" for s in symbols)
