"""Checks of the asynchronous-RL keys (rollout.placement, rollout.num_ranks,
rollout.max_staleness, rollout.peer_timeout_s; README "Asynchronous RL"), before any process
group exists. A combination the disaggregated run does not implement is refused naming its key.
"""
from __future__ import annotations

import os

PLACEMENTS = ("colocated", "disaggregated")


def split_sizes(cfg, world: int) -> tuple[int, int]:
    """(training ranks, rollout ranks) of a job of `world` processes; (world, 0) colocated or
    while rollout.num_ranks is invalid (its problem is reported by async_problems)."""
    r = cfg.rollout
    n = r.num_ranks
    if r.placement != "disaggregated" or not isinstance(n, int) or not 0 < n < world:
        return world, 0
    return world - n, n


def rollout_procs_per_node(world: int, n_rollout: int) -> int:
    """The rollout world's processes per node (as engine.rl.split_world numbers them)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    n_train = world - n_rollout
    return local if n_rollout % local == 0 and n_train % local == 0 else n_rollout


def async_problems(cfg, world: int, gpus_per_node: int | None = None) -> list[str]:
    """Every problem of the asynchronous keys for a job of `world` processes; with
    `gpus_per_node` (GPU hosts) the rollout ranks must be whole nodes."""
    r = cfg.rollout
    p: list[str] = []
    if r.placement not in PLACEMENTS:
        return [f"rollout.placement={r.placement!r} must be one of {list(PLACEMENTS)}"]
    s = r.max_staleness
    if not isinstance(s, int) or isinstance(s, bool) or s < 0:
        p.append(f"rollout.max_staleness={s!r} must be an integer >= 0")
    if r.placement == "colocated":
        if r.num_ranks is not None:
            p.append(f"rollout.num_ranks={r.num_ranks} needs rollout.placement=disaggregated "
                     "(colocated engines share the training ranks)")
        if isinstance(s, int) and s > 0:
            p.append(f"rollout.max_staleness={s} needs rollout.placement=disaggregated "
                     "(colocated rollout and training take turns on the same ranks)")
        return p
    n = r.num_ranks
    if not isinstance(n, int) or isinstance(n, bool) or not 0 < n < world:
        p.append(f"rollout.num_ranks={n!r} must be an integer in [1, {world - 1}] with "
                 f"rollout.placement=disaggregated on {world} processes (the last num_ranks "
                 "ranks run the rollout engines, the others train)")
    elif gpus_per_node and n % gpus_per_node:
        p.append(f"rollout.num_ranks={n} must be whole nodes of {gpus_per_node} GPUs "
                 "(rollout ranks are the job's last nodes)")
    if not r.peer_timeout_s or r.peer_timeout_s <= 0:
        p.append(f"rollout.peer_timeout_s={r.peer_timeout_s!r} must be > 0")
    refused = [
        (r.backend == "sglang", "rollout.backend='sglang' is not available yet: the rollout "
         "ranks' SGLang path (weights arriving as host tensors) has not run on a GPU; use hf "
         "or a package.module:Class backend"),
        (r.check_weight_sync, "rollout.check_weight_sync=true is colocated only"),
        (r.sleep_during_train, "rollout.sleep_during_train=true is colocated only (rollout "
         "ranks never train)"),
        (cfg.moe.routing_replay == "R3", "moe.routing_replay=R3 is colocated only"),
    ]
    p += [f"{msg} (rollout.placement=disaggregated)" for bad, msg in refused if bad]
    return p
