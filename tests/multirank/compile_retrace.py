"""`engine.sft` with packed rows traced into the compiled core attention: the negative control
of tests/test_compile_stability.py (launched on the session's rank pool like `-m engine.sft`).

    compile_retrace.py KEY=VALUE ...        (engine.sft's own arguments)

The run is engine.sft's own, except that after models.build.compile_layers compiled the layers
the core attention's regions no longer send packed ("thd") rows to its eager forward
(`CompiledRegion.eager_when` cleared; recompile limit RETRACE_LIMIT): the packed path, whose
segment loop (CP1) or segment list and zigzag index (Ulysses, CP > 1) come from the host-known
boundaries, runs inside the traced frame, as before issue 83, so dynamo bakes the boundaries
into the graph and guards on them.
The re-traced attention's graphs are counted like any region's (models.build.compile_counts:
graphs, and recompiles from dynamo's own records) but run as dynamo captured them instead of
through Inductor (`count_traced`): a re-trace is dynamo's doing (its guards on the baked-in
boundaries fail), whatever the backend, and Inductor would compile each re-traced graph's C++
kernels cold (its shapes are new every step: 140 s of the test's 300 s with a cold cache, load
~7), which the check does not need. The layers' norms compile through Inductor as usual.
The patch is undone when the run ends (the pool's ranks run other cases afterwards), and so are
the graph breaks the traced rows add to dynamo's process-wide counter (a traced region that
reaches its recompile limit counts one per call), which later cases on the same rank read.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch._dynamo.utils  # noqa: E402

from engine.sft.__main__ import main  # noqa: E402
from models.build import compile_layers, factory  # noqa: E402
from models.build.compile_counts import note_graph  # noqa: E402

ORIGINAL = factory.compile_model_layers
# the traced attention's recompile limit: high, as the process-wide limit was before (8 graphs
# per layer of the process), so the re-traces go on through the run instead of stopping at the
# region's own limit within a few steps
RETRACE_LIMIT = 64


def count_traced(gm: torch.fx.GraphModule, example_inputs):
    """The traced attention's backend: the graph counted (compile_counts.note_graph), then run
    as dynamo captured it (no Inductor)."""
    note_graph()
    return gm.forward


def compile_tracing_packed_rows(chunks: list) -> int:
    regions = ORIGINAL(chunks)
    for chunk in chunks:
        for module in chunk.modules():
            region = module.__dict__.get("forward")
            if isinstance(region, compile_layers.CompiledRegion) and region.eager_when:
                region.eager_when = None
                region.compiled = torch.compile(region.eager, backend=count_traced,
                                                dynamic=False, recompile_limit=RETRACE_LIMIT,
                                                isolate_recompiles=True)
    return regions


if __name__ == "__main__":
    factory.compile_model_layers = compile_tracing_packed_rows
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    try:
        code = main(sys.argv[1:])
    finally:
        factory.compile_model_layers = ORIGINAL
        torch._dynamo.utils.counters["graph_break"].clear()
        torch._dynamo.utils.counters["graph_break"].update(breaks)
    if code:
        raise SystemExit(code)
