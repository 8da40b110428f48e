"""What tools/convert.py's commands share: the exit-2 error, a layout's process groups, a run's
checkpoint iteration. tools/convert.py and its verify command (tools/convert_verify.py, which
convert.py imports when the command runs) both import them from here, so neither imports the
other (tests/test_tools_imports.py: no import circle inside tools/). Imports live in the
functions: `convert.py --help` and argument errors answer without loading megatron.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path


def fail(msg: str) -> None:
    """`error: msg` on stderr, exit 2 (a usage error)."""
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def setup_layout(cfg: dict, tp: int = 1, pp: int = 1, ep: int = 1):
    """Process groups for (tp, pp, ep) after checking the layout against the model."""
    from models.families.registry import experts_per_layer
    from parallel.layout import ParallelLayout
    from parallel.process_groups import init_distributed, setup_model_parallel

    _, world = init_distributed()
    layout = ParallelLayout(world, tp=tp, pp=pp, ep=ep)
    layout.validate(num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
                    num_kv_heads=cfg.get("num_key_value_heads"),
                    num_experts=experts_per_layer(cfg))
    setup_model_parallel(layout)
    return layout


def resolve_checkpoint(path: str, iteration: int | None = None) -> Path:
    """A checkpoint dir itself, or a run's checkpoint dir (checkpoint.dir: iter_* folders and
    latest_checkpointed_iteration.txt): its iteration `iteration`, else the newest complete
    one that file names. Which iteration was taken is printed (rank 0); an iteration the run
    does not hold exits 2 listing those it holds."""
    from engine.checkpoint.io import LATEST_FILE, iteration_dir, list_iterations, read_latest

    p = Path(path)
    held = list_iterations(p)
    if iteration is not None:
        if not held:
            fail(f"--iteration {iteration}: {p} holds no iter_* folders (--ckpt is a single "
                 "checkpoint; give the run's checkpoint directory)")
        if iteration not in held:
            fail(f"--iteration {iteration}: {p} holds iterations {held}")
        chosen, why = iteration, "--iteration"
    elif (chosen := read_latest(p)) is not None:
        why = f"the newest complete, {LATEST_FILE}"
    else:
        return p
    if os.environ.get("RANK", "0") == "0":
        print(f"[convert] {p}: iteration {chosen} ({why}; held: {held}; --iteration N picks "
              "another)", flush=True)
    return iteration_dir(p, chosen)
