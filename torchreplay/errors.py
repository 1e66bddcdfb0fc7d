"""The one exception hierarchy of torchreplay.

Every user-facing error says what was seen, where, and the fix. Each class also derives from the
builtin exception a PyTorch user would expect for that kind of mistake, so existing
``except RuntimeError`` / ``except ValueError`` handlers keep working.
"""

from __future__ import annotations

__all__ = [
    "TorchReplayError",
    "CaptureError",
    "ReplayInputError",
    "StaleOutputError",
    "UnsupportedError",
    "CacheError",
    "VerifyError",
]


class TorchReplayError(Exception):
    """Base class of every error torchreplay raises on purpose."""


class CaptureError(TorchReplayError, RuntimeError):
    """Warm-up or capture of a graph failed; the capture was undone and the process is usable."""


class ReplayInputError(TorchReplayError, ValueError):
    """An argument at replay does not match what the graph was captured with."""


class StaleOutputError(TorchReplayError, RuntimeError):
    """An output was read after a later replay overwrote its memory."""


class UnsupportedError(TorchReplayError, RuntimeError):
    """The callable or its arguments need something torchreplay does not (or cannot) support."""


class CacheError(TorchReplayError, RuntimeError):
    """A compiled-graph cache entry is missing, corrupt or from an incompatible version."""


class VerifyError(TorchReplayError, RuntimeError):
    """With ``verify=K``: a graphed call's result differs from the same call run eagerly.

    Attributes:
        what: the tensor that differs (``"output[0]"``, ``"grad of parameter '0.weight'"``).
        call: the 1-based number of the verified call.
        max_error: the largest absolute difference.
    """

    def __init__(self, message: str, *, what: str = "", call: int = 0, max_error: float = 0.0):
        super().__init__(message)
        self.what = what
        self.call = call
        self.max_error = max_error
