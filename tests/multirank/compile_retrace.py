"""`engine.sft` with packed rows traced into the compiled core attention: the negative control
of tests/test_compile_stability.py (launched on the session's rank pool like `-m engine.sft`).

    compile_retrace.py KEY=VALUE ...        (engine.sft's own arguments)

The run is engine.sft's own, except that after models.build.compile_layers compiled the layers
the core attention's regions no longer send packed ("thd") rows to its eager forward
(`CompiledRegion.eager_when` cleared): the packed path, whose segment loop (CP1) or segment list
and zigzag index (Ulysses, CP > 1) come from the host-known boundaries, runs inside the traced
frame, as before issue 83, so dynamo bakes the boundaries into the graph and guards on them.
The patch is undone when the run ends (the pool's ranks run other cases afterwards).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from engine.sft.__main__ import main  # noqa: E402
from models.build import compile_layers, factory  # noqa: E402

ORIGINAL = factory.compile_model_layers


def compile_tracing_packed_rows(chunks: list) -> int:
    regions = ORIGINAL(chunks)
    for chunk in chunks:
        for module in chunk.modules():
            region = module.__dict__.get("forward")
            if isinstance(region, compile_layers.CompiledRegion):
                region.eager_when = None
    return regions


if __name__ == "__main__":
    factory.compile_model_layers = compile_tracing_packed_rows
    try:
        code = main(sys.argv[1:])
    finally:
        factory.compile_model_layers = ORIGINAL
    if code:
        raise SystemExit(code)
