"""Rollout correction (verl `algorithm.rollout_correction`): importance weights and rejection
between the rollout engine's policy and the trainer's (docs/design/rl.md).

log r_t = log pi_train(t) - log pi_rollout(t) on response tokens, where pi_train is the
recomputed old (proximal) policy in decoupled mode and the current policy in bypass mode.

- IS (`rollout_is`): token w_t = exp(clamp(log r_t, +-20)); sequence w_i = exp(clamp(sum_t log
  r_t, +-20)) on every token of i; truncated at `rollout_is_threshold`, detached; optional
  batch normalisation to mean 1 (token: over the batch's response tokens; sequence: over its
  sequences).
- RS (`rollout_rs`, comma list, all must pass): token_k1/k2/k3 per token; seq_sum_*, seq_mean_*,
  seq_max_* per sequence, with k1 = -log r, k2 = (log r)^2 / 2, k3 = exp(log r) - 1 - log r
  (log r clamped to +-20). k1 options take "lower_upper" (a single value u: lower 1/u) and keep
  log(lower) <= k1 <= log(upper), exactly verl's comparison (it keeps 1/upper <= r <= 1/lower;
  symmetric bounds are unaffected); k2/k3 options keep stat <= upper.

Whole sequences and the whole batch: every statistic goes through a SequenceReducer (engine.rl.
seq_reduce), so sequence sums are over whole sequences even on a CP shard; the decoupled mode
runs on the whole rollout batch before it is split (batch normalisation over all of it).

Metrics (METRICS, metric_means; decoupled: pi_old vs pi_rollout on the whole rollout batch;
bypass: current policy vs rollout, per optimizer step, then over the RL step's optimizer steps):
- `rollout_corr/is_weight_max` follows verl 0.9.1 (compute_is_metrics): token-level IS reports
  the TRUNCATED maximum, max_t min(w_t, rollout_is_threshold); sequence-level IS the
  untruncated maximum sequence weight (log clamped at +20). Batch normalisation does not enter.
  Decoupled: over the whole rollout batch. Bypass: the maximum over every micro-batch, CP shard
  and DP rank of the step's optimizer steps (reduced with MAX, engine.rl.policy.update
  MAX_KEYS; the RL loop combines optimizer steps with max), so it does not depend on the layout.
  The untruncated information the truncated maximum drops is carried by
  `rollout_corr/is_truncated_fraction` (verl's rollout_is_ratio_fraction_high: response tokens,
  or sequences for sequence-level IS, whose untruncated weight exceeds the threshold) and
  `rollout_corr/is_weight_mean` (the untruncated mean; verl 0.9.1's rollout_is_mean averages
  the truncated weights).
- Sequence averages (`ppl_ratio`, `rejected_sequence_fraction`, sequence-level
  `is_truncated_fraction`) are over the sequences with at least one trained token: a sequence
  with none has no ratio. verl averages over every row of the batch (an empty row adds
  exp(0) = 1 to ppl_ratio and 0 to rollout_rs_seq_masked_fraction); metric_means says more.
"""
from __future__ import annotations

import math

import torch

from engine.rl.algo.rollout_correction_config import (IS_LEVELS,  # noqa: F401 (re-exported)
                                                      LOSS_TYPES, RS_OPTIONS,
                                                      RolloutCorrectionConfig, parse_rs)
from engine.rl.algo.seq_reduce import SequenceReducer

SAFETY_BOUND = 20.0


def is_weights(log_ratio: torch.Tensor, seqs, level: str, threshold: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(truncated weights, untruncated weights) per token, float64, detached; `seqs` a
    SequenceReducer over the same tokens. 0 on untrained tokens."""
    lr = log_ratio.detach().to(torch.float64)
    if level == "token":
        raw = torch.exp(lr.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        (total,) = seqs.sums(lr)
        raw = torch.exp(total.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    mask = seqs.mask.reshape(raw.shape).to(raw.device)
    raw = raw * mask
    return raw.clamp(max=threshold), raw


def rejection_keep(log_ratio: torch.Tensor, seqs, rs: list) -> torch.Tensor:
    """Per token 1.0 where every RS option of `rs` (parse_rs) passes, else 0.0 (float64)."""
    lr = log_ratio.detach().to(torch.float64).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    stats = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": torch.exp(lr) - 1.0 - lr}
    keep = torch.ones_like(lr, dtype=torch.bool)
    for name, lower, upper in rs:
        stat = stats[name[-2:]]
        if name.startswith("seq_sum"):
            (stat,) = seqs.sums(stat)
        elif name.startswith("seq_mean"):
            (stat,) = seqs.means(stat)
        elif name.startswith("seq_max"):
            stat = seqs.maxes(stat)
        if name.endswith("k1"):
            keep &= (stat >= math.log(lower)) & (stat <= math.log(upper))
        else:
            keep &= stat <= upper
    return keep.to(torch.float64)


def batch_normalize(weights: torch.Tensor, seqs, level: str) -> tuple[torch.Tensor, float]:
    """Weights / their mean (token level: over trained tokens; sequence level: over sequences
    with a trained token) and the factor; unchanged if the mean is <= 1e-8. `seqs` must cover
    the WHOLE batch (decoupled mode only)."""
    mask = seqs.mask.reshape(weights.shape).to(weights.device)
    if level == "token":
        mean = float((weights * mask).sum() / mask.sum().clamp(min=1))
    else:
        (per_seq,) = seqs.means(weights)  # w_i on each token of sequence i
        share = mask / seqs.counts.reshape(weights.shape).clamp(min=1)  # sums to 1 per sequence
        mean = float((per_seq * share).sum() / share.sum().clamp(min=1e-12))
    if mean <= 1e-8:
        return weights, 1.0
    return weights / mean, mean


METRICS = ("rollout_corr/kl_k1", "rollout_corr/kl_k3", "rollout_corr/ppl_ratio",
           "rollout_corr/is_weight_mean", "rollout_corr/is_truncated_fraction",
           "rollout_corr/masked_token_fraction", "rollout_corr/rejected_sequence_fraction")
# token sums behind METRICS (summable over micro-batches, CP shards and DP ranks)
SUM_KEYS = ("rollout_corr/_tokens", "rollout_corr/_sequences", "rollout_corr/_k1",
            "rollout_corr/_k3", "rollout_corr/_ppl", "rollout_corr/_is",
            "rollout_corr/_truncated_tokens", "rollout_corr/_truncated_sequences",
            "rollout_corr/_masked", "rollout_corr/_rejected")


def max_weight(raw_weights: torch.Tensor, seqs, level: str, threshold: float) -> float:
    """`rollout_corr/is_weight_max` of the tokens of `seqs` (module docstring, verl 0.9.1):
    token level the truncated maximum min(max_t w_t, threshold), sequence level the untruncated
    maximum; -inf without a trained token (the neutral element of the MAX reduction)."""
    mask = seqs.mask.reshape(raw_weights.shape).to(raw_weights.device) > 0
    if not bool(mask.any()):
        return float("-inf")
    top = float(raw_weights[mask].max())
    return min(top, float(threshold)) if level == "token" else top


def metric_sums(log_ratio, seqs, raw_weights, keep, level: str | None = None,
                threshold: float | None = None) -> dict[str, torch.Tensor]:
    """Token sums (SUM_KEYS) over this shard; a per-sequence value enters as value / n_i on each
    of its n_i tokens, so sums over shards and ranks are exact. `raw_weights` / `keep` None:
    IS / RS off; `level` / `threshold`: rollout_is / rollout_is_threshold (with raw_weights)."""
    lr = log_ratio.detach().to(torch.float64)
    m = seqs.mask.reshape(lr.shape).to(lr.device)
    share = m / seqs.counts.reshape(lr.shape).clamp(min=1)
    lr = torch.where(m > 0, lr, torch.zeros_like(lr))
    (mean_lr,) = seqs.means(lr)
    dropped = (1.0 - keep) * m if keep is not None else torch.zeros_like(m)
    rejected = seqs.maxes(dropped) if keep is not None else torch.zeros_like(m)
    above = (raw_weights > threshold).to(m.dtype) * m if raw_weights is not None \
        else torch.zeros_like(m)  # untruncated weight above the threshold
    return {"rollout_corr/_tokens": m.sum(), "rollout_corr/_sequences": share.sum(),
            "rollout_corr/_k1": (-lr * m).sum(),
            "rollout_corr/_k3": ((torch.exp(lr) - lr - 1.0) * m).sum(),
            "rollout_corr/_ppl": (torch.exp(-mean_lr) * share).sum(),
            "rollout_corr/_is": ((raw_weights if raw_weights is not None else m) * m).sum(),
            "rollout_corr/_truncated_tokens": above.sum() if level == "token" else m.new_zeros(()),
            "rollout_corr/_truncated_sequences": (above * share).sum() if level == "sequence"
            else m.new_zeros(()),
            "rollout_corr/_masked": dropped.sum(), "rollout_corr/_rejected": (rejected * share).sum()}


def metric_means(sums: dict) -> dict[str, float]:
    """METRICS from reduced SUM_KEYS sums: kl_k1 = mean(log pi_rollout - log pi_train) and kl_k3
    = mean(r - 1 - log r) over response tokens; ppl_ratio = mean over sequences of
    exp(mean_t log pi_rollout - mean_t log pi_train) (training PPL / rollout PPL);
    is_weight_mean: untruncated IS weights over tokens (1 without rollout_is);
    is_truncated_fraction: response tokens (token-level IS) or sequences (sequence-level IS)
    whose untruncated weight exceeds rollout_is_threshold (verl's rollout_is_ratio_fraction_high;
    0 without rollout_is); masked_token_fraction: rejected response tokens;
    rejected_sequence_fraction: sequences with at least one rejected token (verl's
    rollout_rs_seq_masked_fraction).

    "Sequences" are those with at least one trained (response) token: a sequence without one
    (a fully masked multi-turn row, a padding row) has no log-ratio, no PPL and nothing to
    reject, and is left out of ppl_ratio, rejected_sequence_fraction and the sequence-level
    is_truncated_fraction, numerator and denominator. verl 0.9.1 (compute_offpolicy_metrics,
    compute_rollout_rejection_mask) averages over every row of the batch instead: an empty row
    adds exp(0) = 1 to its ppl_ratio and 0 to its rollout_rs_seq_masked_fraction, so with empty
    rows verl's numbers move towards 1 and 0 by the share of empty rows; on batches without
    one the two agree (tests/test_rl_rollout_correction.py pins both)."""
    tokens = max(float(sums["rollout_corr/_tokens"]), 1.0)
    seqs = max(float(sums["rollout_corr/_sequences"]), 1e-12)
    return {"rollout_corr/kl_k1": float(sums["rollout_corr/_k1"]) / tokens,
            "rollout_corr/kl_k3": float(sums["rollout_corr/_k3"]) / tokens,
            "rollout_corr/ppl_ratio": float(sums["rollout_corr/_ppl"]) / seqs,
            "rollout_corr/is_weight_mean": float(sums["rollout_corr/_is"]) / tokens,
            "rollout_corr/is_truncated_fraction":  # one of the two sums is 0 (the other level)
                float(sums["rollout_corr/_truncated_tokens"]) / tokens
                + float(sums["rollout_corr/_truncated_sequences"]) / seqs,
            "rollout_corr/masked_token_fraction": float(sums["rollout_corr/_masked"]) / tokens,
            "rollout_corr/rejected_sequence_fraction":
                float(sums["rollout_corr/_rejected"]) / seqs}


def correct(log_ratio, seqs, cfg: RolloutCorrectionConfig, rs: list | None,
            normalize: bool) -> tuple:
    """(IS weights or None, untruncated IS weights or None, keep mask or None, batch-norm
    factor) of one set of tokens covered by the SequenceReducer `seqs`."""
    w = raw = keep = None
    factor = 1.0
    if cfg.rollout_is is not None:
        w, raw = is_weights(log_ratio, seqs, cfg.rollout_is, cfg.rollout_is_threshold)
        if normalize:
            w, factor = batch_normalize(w, seqs, cfg.rollout_is)
    if rs:
        keep = rejection_keep(log_ratio, seqs, rs)
    return w, raw, keep, factor


def apply_to_batch(seqs: list, cfg: RolloutCorrectionConfig) -> dict[str, float]:
    """Decoupled mode on the WHOLE rollout batch (every rank, same result): from extras
    "old_logprobs" and "rollout_logprobs", set extras "rollout_is_weights" (when rollout_is) and
    set loss_mask 0 on rejected tokens, so the GlobalLossNormalizer does not count them (verl
    0.9 modifies response_mask before the loss: token-mean's N and seq-mean-token-mean's n_i
    exclude them; a fully rejected sequence follows loss.count_empty_sequences). Returns
    METRICS plus, with rollout_is, rollout_corr/is_weight_max (max_weight) and
    rollout_corr/is_batch_norm_factor."""

    width = max(len(s.tokens) for s in seqs)
    lr = torch.zeros(len(seqs), width, dtype=torch.float64)
    mask = torch.zeros(len(seqs), width)
    ids = torch.full((len(seqs), width), -1, dtype=torch.long)
    for i, s in enumerate(seqs):
        n = len(s.tokens)
        lr[i, :n] = (torch.tensor(s.extras["old_logprobs"], dtype=torch.float64)
                     - torch.tensor(s.extras["rollout_logprobs"], dtype=torch.float64))
        mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        ids[i, :n] = i
    red = SequenceReducer(ids, mask, group=None)
    w, raw, keep, factor = correct(lr, red, cfg, parse_rs(cfg.rollout_rs, cfg.rollout_rs_threshold)
                                   if cfg.rollout_rs else None, cfg.rollout_is_batch_normalize)
    metrics = metric_means(metric_sums(lr, red, raw, keep, cfg.rollout_is,
                                       cfg.rollout_is_threshold))
    if raw is not None:
        top = max_weight(raw, red, cfg.rollout_is, cfg.rollout_is_threshold)
        if math.isfinite(top):
            metrics["rollout_corr/is_weight_max"] = top
        metrics["rollout_corr/is_batch_norm_factor"] = factor
    for i, s in enumerate(seqs):
        n = len(s.tokens)
        if w is not None:
            s.extras["rollout_is_weights"] = w[i, :n].tolist()
        if keep is not None:
            s.loss_mask = [int(m and k > 0) for m, k in zip(s.loss_mask, keep[i, :n].tolist())]
    return metrics
