"""The old (proximal) policy's token log-probs of a rollout batch, and rollout correction
(engine.rl.algo.rollout_correction) in its two verl modes.

- decoupled (rollout_correction.bypass_mode=false, three policies): the trainer recomputes the
  old log-probs forward-only (engine.rl.policy.logprobs); IS weights and rejection between old and
  rollout log-probs are computed on the WHOLE rollout batch here, before any mini-batch or
  micro-batch split.
- bypass (two policies): the rollout engine's log-probs ARE the old log-probs; no forward pass
  runs here (one forward over the rollout batch saved per step); IS / rejection against the
  current policy happen in the loss (engine.rl.policy.update).
"""
from __future__ import annotations

from engine.rl.algo.rollout_correction import apply_to_batch
from engine.rl.policy.logprobs import attach_extra, compute_token_logprobs, logprob_gap
from engine.training.micro_batches import SequenceData


def attach_old_logprobs(policy, seqs: list[SequenceData], cfg) -> dict[str, float]:
    """Set extras "old_logprobs" on every sequence (and, in decoupled mode with correction on,
    "rollout_is_weights" and rejected tokens' loss_mask 0); return the metrics
    (rollout/logprob_diff[_max] and rollout_corr/* in decoupled mode). Collective over the
    world in decoupled mode (the recompute forward); local in bypass mode."""
    corr = cfg.rollout_correction
    if corr.bypass_mode:
        for s in seqs:
            s.extras["old_logprobs"] = list(s.extras["rollout_logprobs"])
        return {}
    old = compute_token_logprobs(policy, seqs, cfg.rollout.temperature)
    attach_extra(seqs, "old_logprobs", old)
    gap_mean, gap_max = logprob_gap(seqs, old)
    metrics = {"rollout/logprob_diff": gap_mean, "rollout/logprob_diff_max": gap_max}
    if corr.enabled:
        metrics.update(apply_to_batch(seqs, corr))
    return metrics
