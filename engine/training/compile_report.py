"""Graph, recompile and graph-break counts of the compiled layers (train.compile) as step
metrics, and a run-log line whenever they change.

Metrics, for a model built with compiled layers (models.build.compile_layers marks its chunks;
the counts are this rank's process-wide counts since it started, models.build.compile_counts):
`compile/graphs` (graphs Inductor compiled for the layers), `compile/recompiles` (of these, the
ones dynamo compiled as recompiles: a region's frame compiled again because its guards failed,
on a new shape, grad mode or guarded value), `compile/graph_breaks` (dynamo graph breaks met
while tracing). Every objective's step metrics carry them: SFT (engine.sft.training.train_step),
DPO, KTO and reward models (engine.preference.step_metrics) and the RL step (the counts after
its last policy update, engine.rl.policy.train_step).
Rank 0's values reach metrics.jsonl and the trackers; rank 0 also prints "[compile] after step
N: G graphs, R recompiles, B graph breaks" when a count changed during step N (so the run log
shows the first compiles and any later recompile). An eager model gets no compile/* metrics.
"""
from __future__ import annotations

import torch.distributed as dist

from models.build.compile_counts import compile_stats, describe_stats
from models.build.compile_layers import has_compiled_layers, release_compile_threads

__all__ = ["compile_metrics", "release_compile_threads"]

_LAST = {"stats": None}   # the counts last reported (process-wide, like the counts)


def compile_metrics(chunks: list, step: int) -> dict[str, float]:
    """The compile/* metrics after optimizer step `step` ({} when `chunks` hold no compiled
    layer); prints the run-log line when a count changed. Also ends Inductor's idle compile
    threads (models.build.compile_layers.release_compile_threads: a process must be able to
    exit after any step)."""
    if not has_compiled_layers(chunks):
        return {}
    release_compile_threads()
    stats = compile_stats()
    if stats != _LAST["stats"] and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"[compile] after step {step}: "
              f"{describe_stats(stats).removeprefix('compile: ')}", flush=True)
    _LAST["stats"] = stats
    return {"compile/graphs": float(stats.graphs),
            "compile/recompiles": float(stats.recompiles),
            "compile/graph_breaks": float(stats.graph_breaks)}
