"""The counts of `train.compile` (models.build.compile_layers): graphs Inductor compiled for the
layers, which of them dynamo compiled as recompiles, and dynamo's graph breaks.

- `count_graphs` is the compiled regions' backend: Inductor, counting every graph it is
  given (`graphs`) and noting the compile's id.
- A recompile is what dynamo itself calls one: a frame of a region compiled again because the
  guards of every graph it already had failed (a new shape, grad mode, or a guarded Python
  value), which dynamo records as the compile's `recompile_reason` (its "Recompiling function"
  log line). The first compile of another region, even one that shares a code object (every
  layer's norm runs the same `forward`), is not a recompile. The reasons are read from dynamo's
  own records of its compiles (`torch._dynamo.utils.get_compilation_metrics`, the last 64) when
  the next graph is counted and when the counts are read, by compile id, so each of the
  layers' compiles is looked up once; a compile whose record left that window before it was
  read (64 other compiles in between) counts as a first compile.
- Graph breaks: dynamo's own counter (`counters["graph_break"]`, any compiled code of the
  process).

All counts are this process's since it started (every compiled model of the process together).
"""
from __future__ import annotations

import sys
import threading
from dataclasses import dataclass

import torch
from torch._guards import CompileContext

_LOCK = threading.Lock()


@dataclass
class CompileStats:
    """Counts of this process since it started (all compiled layers together)."""

    graphs: int = 0        # graphs Inductor compiled for the layers (forward graphs)
    recompiles: int = 0    # of these, dynamo's recompiles (module docstring)
    graph_breaks: int = 0  # dynamo graph breaks met while tracing (any compiled code)


_STATS = CompileStats()
_PENDING: set[str] = set()   # compile ids counted whose dynamo record was not read yet


def _read_records() -> None:
    """Move the pending compiles whose dynamo record exists into the counts (caller holds
    _LOCK)."""
    if not _PENDING:
        return
    dynamo_utils = sys.modules.get("torch._dynamo.utils")   # loaded by any compile
    if dynamo_utils is None:
        return
    for record in dynamo_utils.get_compilation_metrics():
        if record.compile_id in _PENDING and record.is_forward is not False:
            _PENDING.discard(record.compile_id)
            _STATS.recompiles += bool(record.recompile_reason)


def count_graphs(gm: torch.fx.GraphModule, example_inputs):
    """Inductor, counting the graph it is given (the backend of every compiled region)."""
    # Inductor loads on the first compile only (seconds of imports a run without it skips)
    from torch._inductor.compile_fx import compile_fx

    note_graph()
    return compile_fx(gm, example_inputs)


def note_graph() -> None:
    """Count one graph of the compile dynamo is running now (called from a backend: its
    recompile status is read from dynamo's record of that compile later)."""
    compile_id = CompileContext.current_compile_id()
    with _LOCK:
        _read_records()   # the compiles before this one have their records now
        _STATS.graphs += 1
        if compile_id is not None:
            _PENDING.add(str(compile_id))


def compile_stats() -> CompileStats:
    """The graph, recompile and graph-break counts of this process so far."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")   # loaded by any compile
    breaks = 0 if dynamo_utils is None else sum(dynamo_utils.counters["graph_break"].values())
    with _LOCK:
        _read_records()
        return CompileStats(_STATS.graphs, _STATS.recompiles, int(breaks))


def describe_stats(stats: CompileStats) -> str:
    """e.g. "compile: 16 graphs, 4 recompiles, 0 graph breaks"."""
    return (f"compile: {stats.graphs} graphs, {stats.recompiles} recompiles, "
            f"{stats.graph_breaks} graph breaks")
