"""The ``torch.compile`` backend (``backend="torchreplay"``), ``tr.compile`` and ``tr.explain``."""

from torchreplay.compile.api import Compiled, compile
from torchreplay.compile.backend import Backend, torchreplay_backend
from torchreplay.compile.explain import explain

__all__ = ["Backend", "Compiled", "compile", "explain", "torchreplay_backend"]
