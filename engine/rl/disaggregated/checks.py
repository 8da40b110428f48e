"""The checks of the asynchronous-RL keys (rollout.placement, rollout.num_ranks,
rollout.max_staleness, rollout.peer_timeout_s, rollout.check_behaviour_logprobs,
rollout.sync_delta; docs/async-rl.md),
used by engine.rl.checks before any process group exists and by `--validate`: one sentence per
problem, naming its key and the valid choices."""
from __future__ import annotations

PLACEMENTS = ("colocated", "disaggregated")


def async_problems(cfg, world: int, gpus_per_node: int | None = None) -> list[str]:
    """Every problem of the asynchronous keys for a job of `world` processes; with
    `gpus_per_node` (GPU hosts) the rollout ranks must be whole nodes."""
    rollout = cfg.rollout
    p: list[str] = []
    if rollout.placement not in PLACEMENTS:
        return [f"rollout.placement={rollout.placement!r} must be one of {list(PLACEMENTS)}"]
    if rollout.sync_delta is not None and not isinstance(rollout.sync_delta, bool):
        p.append(f"rollout.sync_delta={rollout.sync_delta!r} must be true, false or null "
                 "(auto: on when the job spans more than one node)")
    staleness = rollout.max_staleness
    if not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0:
        p.append(f"rollout.max_staleness={staleness!r} must be an integer >= 0")
    if rollout.check_behaviour_logprobs and not (isinstance(staleness, int) and staleness >= 1):
        p.append("rollout.check_behaviour_logprobs=true needs rollout.max_staleness >= 1 "
                 "(with staleness 0 every batch is sampled by the trainer's current weights: "
                 "rollout/logprob_diff already measures the engine)")
    if rollout.placement == "colocated":
        if rollout.num_ranks is not None:
            p.append(f"rollout.num_ranks={rollout.num_ranks} needs rollout.placement=disaggregated "
                     "(colocated engines share the training ranks)")
        if isinstance(staleness, int) and staleness > 0:
            p.append(f"rollout.max_staleness={staleness} needs rollout.placement=disaggregated "
                     "(colocated rollout and training take turns on the same ranks)")
        return p
    num_ranks = rollout.num_ranks
    if not isinstance(num_ranks, int) or isinstance(num_ranks, bool) or not 0 < num_ranks < world:
        p.append(f"rollout.num_ranks={num_ranks!r} must be an integer in [1, {world - 1}] with "
                 f"rollout.placement=disaggregated on {world} processes (the last num_ranks "
                 "ranks run the rollout engines, the others train)")
    elif gpus_per_node and num_ranks % gpus_per_node:
        p.append(f"rollout.num_ranks={num_ranks} must be whole nodes of {gpus_per_node} GPUs "
                 "(rollout ranks are the job's last nodes)")
    if not rollout.peer_timeout_s or rollout.peer_timeout_s <= 0:
        p.append(f"rollout.peer_timeout_s={rollout.peer_timeout_s!r} must be > 0")
    refused = [
        (rollout.backend == "sglang", "rollout.backend='sglang' is not available yet: the rollout "
         "ranks' SGLang path (weights arriving as host tensors) has not run on a GPU; use hf "
         "or a package.module:Class backend"),
        (rollout.check_weight_sync, "rollout.check_weight_sync=true is colocated only"),
        (rollout.sleep_during_train, "rollout.sleep_during_train=true is colocated only (rollout "
         "ranks never train)"),
        (cfg.moe.routing_replay == "R3", "moe.routing_replay=R3 is colocated only"),
    ]
    p += [f"{msg} (rollout.placement=disaggregated)" for bad, msg in refused if bad]
    return p
