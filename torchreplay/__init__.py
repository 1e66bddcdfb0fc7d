"""torchreplay: run any PyTorch callable as CUDA graphs, as fast as a hand-written graph and safe by
default.

Not public: every module and name that starts with ``_``, and the modules of ``core/``,
``sizes/`` and ``training/`` beyond the names below (the README's architecture section says what
each holds). ``torchreplay.bench`` is the benchmark suite of the command line, not the library.
Importing torchreplay initialises no CUDA, writes no global torch config and patches nothing.
"""

from __future__ import annotations

from torchreplay import config
from torchreplay.check import Finding, Report, check
from torchreplay.errors import (
    CacheError,
    CaptureError,
    ReplayInputError,
    StaleOutputError,
    TorchReplayError,
    UnsupportedError,
    VerifyError,
)
from torchreplay.compile import Compiled, compile, explain
from torchreplay.breaks.graph import BreakableGraph
from torchreplay.core.capture import capture_stream
from torchreplay.core.graphed import Graphed
from torchreplay.core.pool import Pool
from torchreplay.api import graph, make_graphed_callables
from torchreplay.sizes.bucketed import BucketedGraph
from torchreplay.sizes.plan import default_sizes
from torchreplay.stats import GraphStats, TrainingStats
from torchreplay.training.callables import GraphedCallable
from torchreplay.training.step import GraphedStep, graph_step
from torchreplay._version import __version__ as __version__

__all__ = [
    # capture and replay
    "graph",
    "Graphed",
    "Pool",
    # many sizes, breakable graphs
    "BucketedGraph",
    "BreakableGraph",
    "default_sizes",
    # torch.compile backend (backend="torchreplay")
    "compile",
    "Compiled",
    "explain",
    # training
    "make_graphed_callables",
    "GraphedCallable",
    "graph_step",
    "GraphedStep",
    "capture_stream",
    # diagnosis
    "check",
    "Report",
    "Finding",
    "GraphStats",
    "TrainingStats",
    # options
    "config",
    # errors
    "TorchReplayError",
    "CaptureError",
    "ReplayInputError",
    "StaleOutputError",
    "UnsupportedError",
    "CacheError",
    "VerifyError",
]
