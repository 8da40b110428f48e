"""The end of a rollout phase: rank 0's rollout batch (or the error its rollout raised) shared
with every rank over the world group, so no rank waits forever on a failed rollout."""
from __future__ import annotations

import torch.distributed as dist

from engine.data.files import DataError
from engine.errors import RunError
from engine.rl.collect.batch import RolloutBatch
from engine.generation.pool import RolloutPool


def broadcast_rollout(batch: RolloutBatch | Exception | None, pool: RolloutPool | None
                      ) -> RolloutBatch:
    """End the rollout phase and share rank 0's rollout batch with every rank (collective over
    the world). Rank 0 passes the batch, or the exception its rollout raised: then every rank
    raises instead of waiting forever (rank 0 its own exception; the others a DataError,
    RunError or RuntimeError like it, so the entry point reports data errors and run failures
    without a traceback). Other ranks pass None: they serve the rollout engines they own
    (`pool.serve`) until rank 0's `pool.finish` delivers the batch. `pool` None: a plain
    broadcast (no engine on ranks > 0)."""
    payload = None
    if dist.get_rank() == 0:
        payload = (batch if not isinstance(batch, Exception) else
                   ("error", error_kind(batch), f"{type(batch).__name__}: {batch}"))
        if pool is not None:
            pool.finish(payload)
        else:
            dist.broadcast_object_list([payload], src=0)
    elif pool is not None:
        payload = pool.serve()
    else:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        payload = box[0]
    if isinstance(payload, tuple) and payload and payload[0] == "error":
        if dist.get_rank() == 0 and isinstance(batch, Exception):
            raise batch
        kinds = {"data": DataError, "run": RunError, "other": RuntimeError}
        raise kinds[payload[1]](f"rollout on rank 0 failed: {payload[2]}")
    return payload


def error_kind(error: Exception) -> str:
    return ("data" if isinstance(error, DataError) else "run" if isinstance(error, RunError)
            else "other")
