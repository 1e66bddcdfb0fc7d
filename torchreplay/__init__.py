"""torchreplay: run any PyTorch callable as CUDA graphs, as fast as a hand-written graph and safe by
default.

Not public: every module and name that starts with ``_``, and ``torchreplay.io``,
``torchreplay.capture``, ``torchreplay.pool``'s internals beyond :class:`Pool`. Importing
torchreplay initialises no CUDA, writes no global torch config and patches nothing.
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
from torchreplay.buckets import BucketedGraph, default_sizes, graph
from torchreplay.graphed import Graphed
from torchreplay.pool import Pool
from torchreplay.stats import GraphStats
from torchreplay.step import GraphedStep, graph_step
from torchreplay.training import GraphedCallable, make_graphed_callables

__version__ = "0.1.0"

__all__ = [
    # capture and replay
    "graph",
    "Graphed",
    "Pool",
    # many sizes
    "BucketedGraph",
    "default_sizes",
    # training
    "make_graphed_callables",
    "GraphedCallable",
    "graph_step",
    "GraphedStep",
    # diagnosis
    "check",
    "Report",
    "Finding",
    "GraphStats",
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
