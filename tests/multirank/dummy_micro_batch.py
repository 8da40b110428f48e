"""`engine.sft` in a pool rank, optionally with the router padding fix undone (negative control
of tests/test_moe_sft_cli.py's dummy micro-batch and padding tests).

`sft(argv, undo)`: main(argv) of engine.sft on every rank; with `undo` the routers get no
padding mask (engine.training.schedule.moe_padding_mask returns {}) and micro-batches are never
marked dummy (engine.training.micro_batches `_dummy` returns False): padding and a DP rank's
dummy micro-batch run their routers' aux / z losses and count in N and in the moe/* metrics as
before the fix. The patches are restored before returning (pool ranks are reused)."""
from __future__ import annotations

import engine.training.micro_batches as micro_batches
import engine.training.schedule as schedule
from engine.sft.__main__ import main


def sft(argv: list[str], undo: bool) -> int:
    """engine.sft's exit code on this rank (0 on success)."""
    dummy, mask = micro_batches._dummy, schedule.moe_padding_mask
    if undo:
        micro_batches._dummy = lambda seq_index: False
        schedule.moe_padding_mask = lambda model, mb: {}
    try:
        return main(list(argv))
    finally:
        micro_batches._dummy, schedule.moe_padding_mask = dummy, mask
