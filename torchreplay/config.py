"""Frozen option dataclasses and their presets.

Options are never mutated; derive variants with :func:`dataclasses.replace`::

    cfg = dataclasses.replace(tr.config.SAFE, outputs="clone")
"""

from __future__ import annotations

import dataclasses
from typing import Literal

__all__ = ["GraphConfig", "OutputPolicy", "SAFE", "FAST", "DEBUG"]

OutputPolicy = Literal["checked", "clone", "static"]
CaptureErrorMode = Literal["global", "thread_local", "relaxed"]

_OUTPUT_POLICIES = ("checked", "clone", "static")
_CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")


@dataclasses.dataclass(frozen=True)
class GraphConfig:
    """How a graph is captured and how it hands out outputs.

    Args:
        num_warmup_iters: eager runs on the side stream before capture. They create per-stream
            library handles (cuBLAS, cuDNN) and let lazy initialisation happen outside capture.
        outputs: the output policy.
            ``"checked"`` (default): outputs share the graph's memory (zero-copy); once a later
            replay overwrites them, reading them raises an error that says so.
            ``"clone"``: every call returns fresh tensors (one device copy per output).
            ``"static"``: every call returns the graph's own output buffers, which the next replay
            overwrites without any check. Fastest; you keep the rule yourself.
        capture_error_mode: passed to ``torch.cuda.graph`` (``"global"``, ``"thread_local"`` or
            ``"relaxed"``); see its documentation.
        restore_state: snapshot a module's buffers and the RNG state before warm-up and put them
            back after capture, so that building a graph leaves the model as it found it.
        diagnose: on a failed capture, run :func:`torchreplay.check` on the failing call to name
            the op and the user's line.
    """

    num_warmup_iters: int = 3
    outputs: OutputPolicy = "checked"
    capture_error_mode: CaptureErrorMode = "global"
    restore_state: bool = True
    diagnose: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.num_warmup_iters, int) or self.num_warmup_iters < 0:
            raise ValueError(
                f"num_warmup_iters must be an int >= 0, got {self.num_warmup_iters!r}; "
                "use at least 1 for models that call cuBLAS or cuDNN"
            )
        if self.outputs not in _OUTPUT_POLICIES:
            raise ValueError(
                f"outputs must be one of {_OUTPUT_POLICIES}, got {self.outputs!r}"
            )
        if self.capture_error_mode not in _CAPTURE_ERROR_MODES:
            raise ValueError(
                f"capture_error_mode must be one of {_CAPTURE_ERROR_MODES}, "
                f"got {self.capture_error_mode!r}"
            )


#: Safe by default: checked outputs, state restored, failures diagnosed.
SAFE = GraphConfig()
#: As fast as a hand-written graph: outputs are the static buffers, no checks on them.
FAST = GraphConfig(outputs="static", diagnose=False)
#: Fresh tensors every call; the simplest contract, one copy per output.
DEBUG = GraphConfig(outputs="clone")
