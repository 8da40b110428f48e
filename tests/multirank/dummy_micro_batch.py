"""`engine.sft` in a pool rank, optionally with the router padding fix undone (negative control
of tests/test_moe_sft_cli.py's dummy micro-batch and padding tests).

`sft(argv, undo)`: main(argv) of engine.sft on every rank; with `undo` the routers get no
padding mask (engine.training.schedule.moe_padding_mask returns {}) and micro-batches are never
marked dummy (engine.training.micro_batches `_dummy` returns False): padding and a DP rank's
dummy micro-batch run their routers' aux / z losses and count in N and in the moe/* metrics as
before the fix. With `undo="uncompensated"` the router-loss coefficients are megatron-core's
own expectation, coeff / N (engine.training.router_losses `coefficients` not compensating for
the TP x CP group). The patches are restored before returning (pool ranks are reused)."""
from __future__ import annotations

import engine.training.micro_batches as micro_batches
import engine.training.router_losses as router_losses
import engine.training.schedule as schedule
from engine.sft.__main__ import main


def sft(argv: list[str], undo: bool | str) -> int:
    """engine.sft's exit code on this rank (0 on success)."""
    dummy, mask, coefficients = (micro_batches._dummy, schedule.moe_padding_mask,
                                 router_losses.coefficients)
    if undo == "uncompensated":
        router_losses.coefficients = lambda aux, z, tokens, tp_cp: (aux / tokens,
                                                                    (z or 0.0) / tokens)
    elif undo:
        micro_batches._dummy = lambda seq_index: False
        schedule.moe_padding_mask = lambda model, mb: {}
    try:
        return main(list(argv))
    finally:
        micro_batches._dummy, schedule.moe_padding_mask = dummy, mask
        router_losses.coefficients = coefficients
