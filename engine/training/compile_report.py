"""Graph, recompile and graph-break counts of the compiled layers (train.compile) as step
metrics, and a run-log line whenever they change.

Metrics (this rank's process-wide counts since it started, models.build.compile_layers):
`compile/graphs` (graphs inductor compiled for the layers), `compile/recompiles` (of these, a
frame compiled again: a new shape, grad mode or guard), `compile/graph_breaks` (dynamo graph
breaks met while tracing). Rank 0's values reach metrics.jsonl and the trackers; rank 0 also
prints "[compile] after step N: G graphs, R recompiles, B graph breaks" when a count changed
during step N (so the run log shows the first compiles and any later recompile).
"""
from __future__ import annotations

import torch.distributed as dist

from models.build.compile_layers import compile_stats, describe_stats, release_compile_threads

__all__ = ["CompileReport", "release_compile_threads"]


class CompileReport:
    """Reads the compile counters after each step (cheap: three integers)."""

    def __init__(self) -> None:
        self._last = None
        self._steps = 0

    def metrics(self) -> dict[str, float]:
        """This step's compile/* metrics; prints the run-log line when a count changed. Also
        ends inductor's idle compile threads (models.build.compile_layers
        .release_compile_threads: a process must be able to exit after any step)."""
        release_compile_threads()
        self._steps += 1
        stats = compile_stats()
        if stats != self._last and (not dist.is_initialized() or dist.get_rank() == 0):
            print(f"[compile] after step {self._steps}: "
                  f"{describe_stats(stats).removeprefix('compile: ')}", flush=True)
        self._last = stats
        return {"compile/graphs": float(stats.graphs),
                "compile/recompiles": float(stats.recompiles),
                "compile/graph_breaks": float(stats.graph_breaks)}
