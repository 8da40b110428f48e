"""Deterministic process crashes for the reliability tests; inert unless the environment asks.

`ENGINE_FAULT_INJECT="<point>@<rank>:<step>"` makes global rank `rank` kill itself with SIGKILL
(no cleanup, no exception handlers: what an out-of-memory kill or a node failure looks like to
the other ranks) when it reaches `point` at optimizer step `step`. Points:

- `save`: inside engine.checkpoint.checkpointing.save_training_checkpoint, after the staging directory
  exists and the other ranks have started writing, before this rank writes its shards.

Normal runs never set the variable; the check is one dictionary lookup per call.
"""
from __future__ import annotations

import os
import signal

ENV_VAR = "ENGINE_FAULT_INJECT"


def parse(spec: str) -> tuple[str, int, int]:
    """`"save@1:3"` -> ("save", 1, 3); raises ValueError naming the expected form."""
    try:
        point, rest = spec.split("@", 1)
        rank, step = rest.split(":", 1)
        return point, int(rank), int(step)
    except ValueError:
        raise ValueError(f"{ENV_VAR}={spec!r}: expected <point>@<rank>:<step>, "
                         "e.g. save@1:3") from None


def maybe_crash(point: str, rank: int, step: int) -> None:
    """SIGKILL this process if ENGINE_FAULT_INJECT names (point, rank, step)."""
    spec = os.environ.get(ENV_VAR)
    if spec and parse(spec) == (point, rank, step):
        print(f"[fault-injection] killing rank {rank} at {point}, step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
