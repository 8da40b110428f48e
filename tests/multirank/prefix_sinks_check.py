"""Prefix sharing on a model with learned sinks and sliding windows (gpt-oss), sharing off against
on on the same batches (launched by tests/test_prefix_sharing_sinks.py):

    torchrun --nproc_per_node W tests/multirank/prefix_sinks_check.py MODEL_DIR SPEC...

SPEC and the RESULT lines as tests/multirank/prefix_sharing_check.py (its objectives, layouts
and comparison); with the flag ctl, after each spec's grpo run, two negative controls print
CONTROL lines: "natural_order" (the tree attention counts the window along the tree row's
natural order instead of each token's position in its row) and "no_sinks" (the tree attention
drops the layer's sink logits).
"""
from __future__ import annotations

import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@contextlib.contextmanager
def broken(kind: str):
    """The tree attention of sink/window layers broken the way a negative control needs."""
    import models.layers.attention.core as core
    import parallel.tree_attention_sinks as sinks_module
    from models.layers.attention.sinks import attend_fn

    if kind == "natural_order":
        name, module, original = "run_depths", sinks_module, sinks_module.run_depths
        replacement = lambda run, nodes: nodes   # noqa: E731  (node index, not depth)
    else:
        name, module, original = "tree_sink_attention", core, core.tree_sink_attention

        def replacement(q, k, v, params, attend, first_head=0):
            return original(q, k, v, params, attend_fn(attend.scale, attend.window_left, None),
                            first_head)
    setattr(module, name, replacement)
    try:
        yield
    finally:
        setattr(module, name, original)


def main() -> None:
    from models.hf.io import read_config
    from parallel.process_groups import init_distributed, shutdown
    from tests.multirank.prefix_sharing_check import run_specs

    _, world = init_distributed()
    run_specs(sys.argv[1], read_config(sys.argv[1]), world, sys.argv[2:],
              ("natural_order", "no_sinks"), broken)
    shutdown()


if __name__ == "__main__":
    from engine.cli import exit_process

    main()
    exit_process(0)
