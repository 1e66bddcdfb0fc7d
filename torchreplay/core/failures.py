"""What a failed warm-up or capture says: the op and the user's line that broke it (from the
eager check, matched against the capture's own traceback), and the user's frame of an error.

Split from ``capture.py``, which raises these; nothing here touches the device.
"""

from __future__ import annotations

import os
import traceback
from typing import Any, Callable

import torch

from torchreplay import _compat
from torchreplay.config import GraphConfig
from torchreplay.core.args import fn_name
from torchreplay.core.snapshot import StateSnapshot
from torchreplay.errors import CaptureError

__all__ = [
    "capture_error", "empty_message", "failed_lines", "launches_nothing", "returns_arguments", "user_frame",
    "warmup_error",
]

# (with the separator: torchvision's and torchaudio's files are the user's, not torch's)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
# The package root (this file is in torchreplay/core/): frames of ours are not the user's line.
_OUR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_OUR_MODELS = _OUR_DIR + "models" + os.sep


def user_frame(tb: Any) -> tuple[str, int, str] | None:
    """Return ``(filename, lineno, line)`` of the innermost traceback frame outside torch and us."""
    found = None
    for frame in traceback.extract_tb(tb):
        if _library(frame.filename):
            continue
        found = (frame.filename, frame.lineno or 0, (frame.line or "").strip())
    return found


def warmup_error(fn: Callable[..., Any], i: int, exc: Exception) -> CaptureError:
    where = user_frame(exc.__traceback__)
    at = f" at {where[0]}:{where[1]} ({where[2]})" if where else ""
    return CaptureError(
        f"warm-up call {i + 1} of '{fn_name(fn)}' raised {type(exc).__name__}: "
        f"{_first_line(exc)}{at}; it fails eagerly too: fix the call before graphing it"
    )


def returns_arguments(args: Any, kwargs: Any, out: Any, device: torch.device) -> bool:
    """Whether every tensor ``out`` holds is one of the call's tensor arguments on ``device`` or
    a view of one (``nn.Flatten``, ``nn.Identity``, ``Dropout(p=0)``): a call that launches no
    kernel, eagerly too."""
    given = {
        t.untyped_storage().data_ptr() for t in _compat.tree_flatten((args, kwargs))[0]
        if isinstance(t, torch.Tensor) and t.device == device
    }
    outs = [t for t in _compat.tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    return bool(given and outs) and all(t.untyped_storage().data_ptr() in given for t in outs)


def launches_nothing(out: Any, device: torch.device) -> bool:
    """Whether a call that recorded no CUDA work returned tensors, all of them on ``device``:
    tensors it did not compute (its arguments, its parameters or buffers, views of them, a new
    uninitialised tensor), so eagerly too it launches nothing. (Work done on the CPU leaves its
    results there: a copy to the device would have been recorded.)"""
    outs = [t for t in _compat.tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    return bool(outs) and all(
        t.device.type == device.type and (device.index is None or t.device.index == device.index) for t in outs
    )


def empty_message(
    fn: Callable[..., Any], args: Any, kwargs: Any, out: Any, device: torch.device, breaks: bool = False
) -> str:
    """Why a capture recorded nothing: the work ran elsewhere, or there was none (the callable
    returns its arguments or views of them: eagerly too it launches nothing); with ``breaks``
    (a breakable graph's segments), or everything ran inside its breaks."""
    if breaks and not returns_arguments(args, kwargs, out, device):
        return (
            f"capturing '{fn_name(fn)}' recorded no CUDA work outside its breaks (an empty "
            "graph): every op ran inside a break (breaks run eagerly at every call) or on the "
            "CPU, so there is nothing for a graph to replay. Break at smaller modules (the "
            "attention, not the decoder layer), or call the model as it is; with "
            "breaks=\"auto\", the log (INFO) names each module it chose and the op that made it "
            "a break, and tr.check(model, *args) says how to change that op"
        )
    if returns_arguments(args, kwargs, out, device):
        return (
            f"capturing '{fn_name(fn)}' recorded no CUDA work (an empty graph): it returns its "
            f"arguments or views of them, which launches no kernel on {device}, eagerly too. "
            "Call it as it is: there is nothing for a graph to replay"
        )
    if not breaks and launches_nothing(out, device):
        return (
            f"capturing '{fn_name(fn)}' recorded no CUDA work (an empty graph): it returns tensors "
            "it did not compute (its parameters or buffers, views of them, or new uninitialised "
            f"tensors), which launches no kernel on {device}, eagerly too. Call it as it is: "
            "there is nothing for a graph to replay"
        )
    return (
        f"capturing '{fn_name(fn)}' recorded no CUDA work (an empty graph): it ran on the CPU or "
        f"on another device; move the module and its tensor arguments to {device} before graphing"
    )


def capture_error(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    exc: Exception,
    config: GraphConfig,
    snapshot: StateSnapshot | None,
    diagnose_fn: Callable[..., Any] | None = None,
) -> CaptureError:
    name = fn_name(fn)
    if isinstance(exc, torch.OutOfMemoryError):
        return CaptureError(
            f"out of memory while capturing '{name}': {_first_line(exc)}; the capture was undone "
            "and its memory released. Free memory, capture a smaller size, or share a pool "
            "between graphs (pool=)"
        )
    # capture_end's "operation failed due to a previous error during capture" is a consequence;
    # the error the call itself raised is its context.
    root = exc
    while _CONSEQUENCE in str(root) and isinstance(root.__context__, Exception):
        root = root.__context__
    if _LEGACY_STREAM in str(root):
        return CaptureError(
            f"capture of '{name}' failed: an operation made the default (legacy) stream wait for "
            "the capturing stream. In a backward this is autograd accumulating a gradient into a "
            "leaf tensor (a parameter) whose AccumulateGrad node was made on the default stream "
            "by an earlier eager call whose autograd graph is still alive, e.g. the `loss` or the "
            "outputs of the last eager step kept in a variable; fix: `del` them (or keep "
            "`.detach()`ed copies) before graphing, or run the eager steps on a side stream "
            f"(`with torch.cuda.stream(s):`). CUDA said: {_first_line(root)}"
        )
    finding = None
    if config.diagnose:
        from torchreplay.check import NO_CUDA_OP, diagnose  # check.py imports nothing of core/

        try:
            report = diagnose(diagnose_fn or fn, args, kwargs)
            finding = report.first()
        finally:
            if snapshot is not None:
                snapshot.restore()
        # A backward runs its kernels on autograd's threads, which the check does not see: a
        # "touched no CUDA tensor" finding there says nothing about why CUDA failed.
        if finding is not None and finding.op == NO_CUDA_OP and _is_cuda_error(root):
            finding = None
        if finding is not None and _CONSEQUENCE not in str(root):
            finding = _where_it_failed(report, root, finding)
    if finding is not None:
        return CaptureError(
            f"capture of '{name}' failed at {finding.location} ({finding.code}): {finding.op} "
            f"{finding.reason}; fix: {finding.fix}. CUDA said: {_first_line(root)}"
        )
    where = user_frame(root.__traceback__) or user_frame(exc.__traceback__)
    at = f" at {where[0]}:{where[1]} ({where[2]})" if where else ""
    return CaptureError(
        f"capture of '{name}' failed{at}: {type(root).__name__}: {_first_line(root)}; run "
        "torchreplay.check(fn, *args) to list what breaks capture"
    )


_CONSEQUENCE = "previous error during capture"


def failed_lines(exc: CaptureError) -> tuple[list[str], str]:
    """``file:line`` of each of the user's frames the error that failed a capture was raised in
    (innermost first; empty when not known: raised by an earlier op, at the end of the capture),
    and the error's first line."""
    root = exc.__cause__
    while root is not None and _CONSEQUENCE in str(root) and isinstance(root.__context__, Exception):
        root = root.__context__
    if root is None or _CONSEQUENCE in str(root):
        return [], _first_line(exc)
    frames = reversed(traceback.extract_tb(root.__traceback__))
    return [f"{f.filename}:{f.lineno}" for f in frames if not _library(f.filename)], \
        f"{type(root).__name__}: {_first_line(root)}"


def _where_it_failed(report: Any, root: BaseException, first: Any) -> Any:
    """The finding of the eager check at a line where the capture itself failed, innermost
    frame first; ``first`` when the error was raised outside the call (no frame of the user's);
    None when no finding is at any of its lines. The check runs eagerly, and code that asks
    whether a capture is running (transformers' ``is_tracing``: a data-dependent test skipped
    under capture) has findings there that the capture never met: the first of them is not
    what failed."""
    frames = traceback.extract_tb(root.__traceback__)
    for frame in reversed(frames):
        found = next((f for f in report if (f.filename, f.lineno) == (frame.filename, frame.lineno)), None)
        if found is not None:
            return found
    return None if any(not _library(f.filename) for f in frames) else first


def _library(filename: str) -> bool:
    """torch's and ours (the built-in models are the user's, as for the check)."""
    path = os.path.abspath(filename)
    ours = path.startswith(_OUR_DIR) and not path.startswith(_OUR_MODELS)
    return ours or path.startswith(_TORCH_DIR) or filename.startswith("<")


_LEGACY_STREAM = "legacy stream depend on a capturing"


def _is_cuda_error(exc: BaseException) -> bool:
    return "CUDA error" in str(exc) or type(exc).__name__ == "AcceleratorError"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def refused_pool(exc: BaseException) -> bool:
    """Did torch refuse to begin a capture because of the pool id alone? Its allocators never
    take an id back once its every graph is gone (an internal assertion on the use count), and
    a failed capture can leave the id marked as being recorded to (seen on torch 2.11, after a
    capture CUDA invalidated). A new id captures."""
    text = str(exc)
    return "use_count > 0" in text or "already recording to mempool_id" in text
