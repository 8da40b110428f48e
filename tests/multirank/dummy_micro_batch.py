"""`engine.sft` in a pool rank, optionally with the dummy micro-batch fix undone (negative
control of tests/test_moe_sft_cli.py's single-row DP2 test).

`sft(argv, undo)`: main(argv) of engine.sft on every rank; with `undo` the micro-batches are
never marked dummy (engine.training.micro_batches `_dummy` returns False), so a DP rank's dummy
micro-batch runs its routers' aux / z losses, counts in N and in the moe/* metrics as before the
fix. The patch is restored before returning (pool ranks are reused)."""
from __future__ import annotations

import engine.training.micro_batches as micro_batches
from engine.sft.__main__ import main


def sft(argv: list[str], undo: bool) -> int:
    """engine.sft's exit code on this rank (0 on success)."""
    original = micro_batches._dummy
    if undo:
        micro_batches._dummy = lambda seq_index: False
    try:
        return main(list(argv))
    finally:
        micro_batches._dummy = original
