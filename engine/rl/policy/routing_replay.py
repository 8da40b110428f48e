"""MoE routing replay in the RL step (`moe.routing_replay`: null | R2 | R3).

- R2: the old-log-prob forward (forward-only, engine.rl.policy.logprobs) records every token's top-k
  experts per MoE layer; they travel with the sequence as the extra ROUTED_EXPERTS and every
  update forward of the step replays them.
- R3: the rollout engine reports the routing of every token it processed (prompt tokens from its
  prefill, response tokens from the decode steps: Generation.routed_experts); the old-log-prob
  forward and every update forward replay it.

What replay changes (models.layers.experts.replay): only which experts a token uses; the routing
weights are recomputed from the current router at the replayed experts (renormalised softmax
over the replayed logits for Qwen3-MoE with norm_topk_prob / Mixtral), so the router still gets
gradients. Router losses (moe.aux_loss_coeff, moe.z_loss_coeff) are computed as megatron
computes them without replay: the z-loss from the router logits, the load-balancing loss from
the router's own top-k of its current scores (as verl's router replay does). The KL reference
model (kl.beta > 0) keeps its own routing.

Metrics: `moe/replay_mismatch` (update forwards, averaged over the step's optimizer steps) and,
with R3, `moe/rollout_replay_mismatch` (the old-log-prob forward): the fraction of (token, MoE
layer) pairs whose recomputed top-k set differs from the replayed one (engine.training.routing).
"""
from __future__ import annotations

from engine.training.routing import ROUTED_EXPERTS, compact


def rollout_engine_kwargs(cfg) -> dict:
    """Extra RolloutEngine.from_config arguments: routed experts for R3."""
    return {"routed_experts": True} if cfg.moe.routing_replay == "R3" else {}


def attach_routing(seqs, table, num_experts: int) -> None:
    """seqs[i].extras[ROUTED_EXPERTS] = the recorded table's rows of sequence i (compact)."""
    table = compact(table, num_experts)
    for i, s in enumerate(seqs):
        s.extras[ROUTED_EXPERTS] = table[i, :len(s.tokens)].clone()


def start_routing_replay(policy, mode: str | None) -> None:
    """Before the old-log-prob forward of a step: R2 records the policy's routing, R3 replays
    the rollout engine's (the sequences carry ROUTED_EXPERTS from build_sequences)."""
    if mode is not None:
        policy.routing.set_mode("record" if mode == "R2" else "replay")


def after_old_logprobs(policy, seqs, mode: str | None) -> dict[str, float]:
    """After the old-log-prob forward: R2 attaches the recorded routing to `seqs`
    (collective over the world); R3 returns moe/rollout_replay_mismatch (collective). Leaves
    the policy replaying for the step's updates (`end_replay` ends it)."""
    if mode is None:
        return {}
    routing = policy.routing
    metrics = {}
    if mode == "R2":
        attach_routing(seqs, routing.recorded(), routing.num_experts)
    else:
        metrics["moe/rollout_replay_mismatch"] = routing.mismatch()
    routing.set_mode("replay")
    return metrics


def end_replay(policy) -> None:
    """After the step's updates: the policy routes on its own again (weight-sync probes,
    validation)."""
    if policy.routing is not None:
        policy.routing.set_mode(None)
