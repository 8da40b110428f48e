"""The policy side of an RL step: the per-token GRPO/DAPO loss and one optimizer step per
mini-batch through TrainEngine.train_batch (docs/design/loss-math.md, docs/design/rl.md).

Loss contract (engine.training.loss): per token, with r = exp(logp - old_logp) and A the advantage,

    l = policy_loss(logp, old_logp, A, ctx)   [ppo_clip: -min(r A, clip(r, 1-eps_low, 1+eps_high) A),
                                               dual clip; x rollout IS weight; gspo, geo_mean,
                                               cispo, sapo: engine.rl.algo.policy_loss_variants]
        + kl.beta * KL(logp, ref_logp) - entropy_coef * H

`ctx` (engine.rl.algo.policy_loss.PolicyLossContext) carries the micro-batch's SequenceReducer
(whole-sequence sums, exact under CP) and the decoupled rollout IS weights (extras
"rollout_is_weights", computed on the whole rollout batch by engine.rl.algo.rollout_correction). In
rollout_correction.bypass_mode the old policy is the rollout engine's (extras "old_logprobs"
hold the rollout log-probs) and IS / rejection are computed here from the current policy, as
verl's bypass loss does: rejected tokens contribute 0 to the policy-gradient term but stay in
the normalizer's counts (which are fixed before the forward).

and the micro-batch loss is `aggregate(l, token_weights)`: weights from the GlobalLossNormalizer
of the whole mini-batch (counts over the DP group only), so the loss, the gradient and every
logged policy metric (weighted with the same token weights) are the same on every layout.

`policy/clipfrac_low` / `policy/clipfrac_high` are weighted means over the KEPT tokens:
sum_t w_t k_t c_t / sum_t w_t k_t, with c_t the clip indicator, w_t the token weight above and
k_t 0 on the tokens bypass-mode rejection removed from the loss (1 elsewhere; decoupled-mode
rejection already zeroed their loss mask, hence w_t). Both sums are report sums, so the ratio
is layout-invariant. A rejected token lies outside the clip band but has no gradient: it
counts neither in the numerator nor in the denominator. By aggregation mode: token-mean
(w_t = 1/N): exactly verl's masked_mean of the indicator over the kept tokens (verl takes it per
micro-batch, here over the mini-batch); token-sum, seq-mean-token-sum and
seq-mean-token-sum-norm (w_t equal for every token): the same plain mean over the kept tokens;
seq-mean-token-mean (w_t = 1/(n_i S), n_i the sequence's trained tokens before bypass
rejection): each kept token weighs 1/n_i, i.e. without rejection the mean over sequences of each
sequence's clipped fraction (verl: still the plain token mean).

Old log-probs from the training forward (`PolicyLossSettings.old_from_forward`, the
train.old_logprobs=auto path of an exactly on-policy step, engine.rl.policy.old_logprobs):
old_logp = logp.detach() of this very forward, so r = 1 exactly, both clip fractions are 0 and
the gradient is the one a separately recomputed old_logp would give (same weights); no
"old_logprobs" extra is read. The loss function then also measures `rollout/logprob_diff`
(report sums of |rollout_logp - logp| and of the trained tokens over the mini-batch, which is
the whole rollout batch) and `rollout/logprob_diff_max` (a maximum, as below), the metrics the
separate pass would have logged (engine.rl.policy.logprobs.logprob_gap).

`rollout_corr/is_weight_max` (bypass mode with rollout IS, engine.rl.algo.rollout_correction
max_weight) and `rollout/logprob_diff_max` are maxima, not sums: the loss function records it per micro-batch (MAX_KEYS)
and policy_update reduces it with MAX over the micro-batches, the data-parallel group WITH
context parallelism (each CP rank holds a shard of every sequence; TP ranks hold copies) and
the pipeline group (only the last stage computes a loss).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from engine.rl.algo import rollout_correction as rc
from engine.rl.algo import seq_reduce
from engine.rl.algo.policy_loss import PolicyLossContext, kl_penalty
from engine.rl.algo.policy_loss_variants import POLICY_LOSSES, reinforce_loss
from engine.rl.algo.seq_reduce import SequenceReducer
from engine.rl.policy.old_logprobs import old_logprobs_plan
from engine.training.loss import GlobalLossNormalizer, aggregate
from engine.training.micro_batches import SequenceData
from engine.training.schedule import LossFn
from engine.training.token_losses import token_logprobs_and_entropy
from engine.training.train_engine import TrainEngine

# Weighted sums reported by the loss function, reduced over micro-batches and DP x CP; the
# first drives the non-finite guard.
REPORT_KEYS = ("policy/loss", "policy/pg_loss", "policy/clipfrac_low", "policy/clipfrac_high",
               "policy/kl", "policy/entropy", "policy/response_tokens",
               "policy/_clip_weight")  # sum of w_t k_t: the clip fractions' denominator
CLIP_KEYS = ("policy/clipfrac_low", "policy/clipfrac_high")
IS_MAX_KEY = "rollout_corr/is_weight_max"      # bypass mode with rollout IS
GAP_MAX_KEY = "rollout/logprob_diff_max"       # old log-probs from the training forward
# Maxima recorded by the loss function, reduced with MAX.
MAX_KEYS = (IS_MAX_KEY, GAP_MAX_KEY)
# Report sums of the rollout-vs-trainer gap (old_from_forward): |difference| and token count.
GAP_KEYS = ("rollout/_logprob_gap_sum", "rollout/_logprob_gap_tokens")


@dataclass
class PolicyLossSettings:
    vocab_size: int
    temperature: float
    eps_low: float
    eps_high: float
    dual_c: float | None = None
    kl_beta: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    policy_loss: str = "ppo_clip"
    tau_pos: float = 1.0                 # sapo
    tau_neg: float = 1.05                # sapo
    bypass: rc.RolloutCorrectionConfig | None = None  # set: bypass mode (in-loss correction)
    old_from_forward: bool = False       # old_logp = logp.detach() (module docstring)

    @classmethod
    def from_config(cls, cfg, vocab_size: int) -> "PolicyLossSettings":
        corr = cfg.rollout_correction
        return cls(vocab_size=vocab_size, temperature=cfg.rollout.temperature,
                   eps_low=cfg.clip.eps_low, eps_high=cfg.clip.eps_high, dual_c=cfg.clip.dual_c,
                   kl_beta=cfg.kl.beta, kl_estimator=cfg.kl.estimator,
                   entropy_coef=cfg.entropy_coef, policy_loss=cfg.policy_loss,
                   tau_pos=cfg.sapo.tau_pos, tau_neg=cfg.sapo.tau_neg,
                   bypass=corr if corr.bypass_mode else None,
                   old_from_forward=old_logprobs_plan(cfg).from_forward)

    def report_keys(self) -> tuple[str, ...]:
        return (REPORT_KEYS + (rc.SUM_KEYS if self.bypass is not None else ())
                + (GAP_KEYS if self.old_from_forward else ()))

    def max_keys(self) -> tuple[str, ...]:
        return (((IS_MAX_KEY,) if self.bypass is not None and self.bypass.rollout_is else ())
                + ((GAP_MAX_KEY,) if self.old_from_forward else ()))


def _policy_terms(s: PolicyLossSettings, logp, mb, seqs: SequenceReducer, report: dict,
                  maxes: dict):
    """(per-token pg terms, keep mask or None): the registered loss, or in bypass mode verl's
    bypass loss (IS / rejection from the current policy against the rollout log-probs; its
    metric sums go to `report`, its maxima to `maxes`). With `s.old_from_forward` the old
    log-probs are this forward's own, detached."""
    old = logp.detach() if s.old_from_forward else mb.extras["old_logprobs"]
    ctx = PolicyLossContext(mb.loss_mask, seqs, mb.extras.get("rollout_is_weights"))
    if s.bypass is None:
        return POLICY_LOSSES[s.policy_loss](logp, old, mb.extras["advantages"], s, ctx), None
    corr = s.bypass
    log_ratio = logp.detach() - old
    rs = rc.parse_rs(corr.rollout_rs, corr.rollout_rs_threshold) if corr.rollout_rs else None
    w, raw, keep, _ = rc.correct(log_ratio, seqs, corr, rs, normalize=False)
    report.update(rc.metric_sums(log_ratio, seqs, raw, keep, corr.rollout_is,
                                 corr.rollout_is_threshold))
    if raw is not None:
        maxes["rollout_corr/is_weight_max"] = rc.max_weight(raw, seqs, corr.rollout_is,
                                                            corr.rollout_is_threshold)
    if corr.loss_type == "reinforce":
        ctx.is_weights = w
        terms = reinforce_loss(logp, mb.extras["advantages"], ctx)
    else:  # ppo_clip: the ratio to the rollout policy is the IS correction (no weights)
        terms = POLICY_LOSSES["ppo_clip"](logp, old, mb.extras["advantages"], s, ctx)
    return terms, (keep.to(logp.dtype) if keep is not None else None)


def _gap_terms(logp, mb, report: dict, maxes: dict) -> None:
    """old_from_forward: the report sums GAP_KEYS and the maximum GAP_MAX_KEY of |rollout
    log-prob - logp| over the micro-batch's trained tokens (a tensor: no host sync)."""
    mask = mb.loss_mask > 0
    gap = (mb.extras["rollout_logprobs"].to(logp.dtype) - logp.detach()).abs()
    gap = torch.where(mask, gap, torch.zeros_like(gap))
    report[GAP_KEYS[0]] = gap.to(torch.float64).sum()
    report[GAP_KEYS[1]] = mask.sum()
    maxes[GAP_MAX_KEY] = torch.where(mask, gap, torch.full_like(gap, float("-inf"))).max()


def _keep_max(maxes: dict, key: str, value) -> None:
    """maxes[key] = the running maximum with `value` (a float, or a 0-d tensor kept on its
    device until reduce_maxes reads it)."""
    if key not in maxes:
        maxes[key] = value
    elif torch.is_tensor(value) or torch.is_tensor(maxes[key]):
        maxes[key] = torch.maximum(torch.as_tensor(maxes[key]), torch.as_tensor(value))
    else:
        maxes[key] = max(maxes[key], value)


def policy_loss_fn(s: PolicyLossSettings, maxes: dict | None = None) -> LossFn:
    """loss_fn(logits [b, s, V/tp], mb) -> (weighted loss sum, report) for TrainEngine.
    Reads mb.extras "advantages", "old_logprobs" (unless s.old_from_forward, which reads
    "rollout_logprobs" for the gap metrics), "ref_logprobs" (kl_beta > 0) and
    "rollout_is_weights" (decoupled rollout IS). Collective over TP (vocab-parallel log-probs,
    entropy) and over CP (whole-sequence sums, engine.rl.algo.seq_reduce). `maxes` (optional)
    collects the running maximum of each MAX_KEYS entry over the micro-batches it sees."""

    def loss_fn(logits, mb):
        w = mb.token_weights
        logp, entropy = token_logprobs_and_entropy(logits, mb.labels, s.vocab_size,
                                                   s.temperature, entropy_grad=s.entropy_coef != 0)
        seqs = SequenceReducer(mb.seq_ids, mb.loss_mask, seq_reduce.cp_group())
        extra: dict = {}
        local_max: dict = {}
        terms, keep = _policy_terms(s, logp, mb, seqs, extra, local_max)
        if s.old_from_forward:
            with torch.no_grad():
                _gap_terms(logp, mb, extra, local_max)
        if maxes is not None:
            for key, value in local_max.items():
                _keep_max(maxes, key, value)
        pg = terms.loss if keep is None else terms.loss * keep
        per_token = pg
        kl = torch.zeros_like(logp)
        if s.kl_beta > 0:
            kl = kl_penalty(logp, mb.extras["ref_logprobs"], s.kl_estimator)
            per_token = per_token + s.kl_beta * kl
        if s.entropy_coef != 0:
            per_token = per_token - s.entropy_coef * entropy
        loss = aggregate(per_token, w)
        with torch.no_grad():
            # clip fractions over the kept tokens only (module docstring): rejected tokens
            # (keep 0) lie outside the clip band but carry no gradient
            kept_w = w if keep is None else w * keep.to(w.device, w.dtype)
            report = {
                "policy/loss": loss.detach(), "policy/pg_loss": aggregate(pg, w),
                "policy/clipfrac_low": aggregate(terms.clipped_low, kept_w),
                "policy/clipfrac_high": aggregate(terms.clipped_high, kept_w),
                "policy/_clip_weight": kept_w.detach().to(torch.float64).sum(),
                "policy/kl": aggregate(kl, w), "policy/entropy": aggregate(entropy, w),
                "policy/response_tokens": mb.loss_mask.sum(), **extra,
            }
        return loss, report

    return loss_fn


def split_mini_batches(num_seqs: int, num_mini_batches: int, seed: int, step: int,
                       epoch: int, shuffle: bool = True) -> list[list[int]]:
    """Positions 0..num_seqs-1 in `num_mini_batches` near-equal parts: a permutation seeded by
    (seed, step, epoch) (identity when not shuffling), then contiguous slices. Independent of
    the parallel layout. Fewer parts when there are fewer sequences than parts."""
    order = (np.random.default_rng([seed, step, epoch]).permutation(num_seqs) if shuffle
             else np.arange(num_seqs))
    parts = np.array_split(order, min(num_mini_batches, num_seqs))
    return [sorted(int(i) for i in p) for p in parts if len(p)]


def reduce_maxes(maxes: dict, keys: tuple[str, ...]) -> dict[str, float]:
    """{key: maximum over every rank's `maxes`} for `keys` (collective: every rank passes the
    same keys, -inf where it has no value): MAX over the data-parallel group with context
    parallelism, then over the pipeline group, as engine.training.schedule.reduce_reports sums.
    Keys without a value on any rank are left out."""
    if not keys:
        return {}
    vec = torch.tensor([float(maxes.get(k, float("-inf"))) for k in keys], dtype=torch.float64)
    if ps.model_parallel_is_initialized():
        for group in (ps.get_data_parallel_group(with_context_parallel=True),
                      ps.get_pipeline_model_parallel_group()):
            if dist.get_world_size(group) > 1:
                dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    return {k: float(v) for k, v in zip(keys, vec) if math.isfinite(float(v))}


def policy_update(engine: TrainEngine, seqs: list[SequenceData], loss_cfg,
                  settings: PolicyLossSettings, horizon: float) -> dict[str, float]:
    """One optimizer step on the mini-batch `seqs` (every rank passes the same list); returns
    the globally reduced weighted sums (REPORT_KEYS; the clip fractions divided by their
    weight, module docstring), grad_norm, lr, train/update_skipped, train/micro_batches and
    time/update_s; in bypass mode rollout_corr/* (with rollout IS, is_weight_max: a maximum);
    with settings.old_from_forward rollout/logprob_diff and rollout/logprob_diff_max.
    A non-finite loss or gradient skips the update (engine.guard counts it; the RL loop raises
    after logging the step)."""
    normalizer = GlobalLossNormalizer(loss_cfg.agg_mode, horizon, loss_cfg.count_empty_sequences,
                                      group=ps.get_data_parallel_group())
    maxes: dict = {}
    out = engine.train_batch(seqs, normalizer, policy_loss_fn(settings, maxes),
                             settings.report_keys())
    out["time/update_s"] = out.pop("time/step_s")
    clip_weight = out.pop("policy/_clip_weight")
    for key in CLIP_KEYS:
        out[key] = out[key] / clip_weight if clip_weight > 0 else 0.0
    if settings.bypass is not None:  # rollout_corr/* of the current policy vs the rollout's
        out.update(rc.metric_means({k: out.pop(k) for k in rc.SUM_KEYS}))
    if settings.old_from_forward:
        gap_sum, tokens = (out.pop(k) for k in GAP_KEYS)
        out["rollout/logprob_diff"] = gap_sum / tokens if tokens > 0 else 0.0
    out.update(reduce_maxes(maxes, settings.max_keys()))
    return out
