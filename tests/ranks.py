"""Run a function on N ranks in spawned processes: the helper the benchmarks use too."""

from torchreplay.bench.ranks import free_port, run_ranks

__all__ = ["free_port", "run_ranks"]
