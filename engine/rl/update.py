"""The policy side of an RL step: the per-token GRPO/DAPO loss and one optimizer step per
mini-batch through TrainEngine.train_batch (DESIGN sections 4 and 9).

Loss contract (engine.training.loss): per token, with r = exp(logp - old_logp) and A the advantage,

    l = policy_loss(logp, old_logp, A)   [ppo_clip: -min(r A, clip(r, 1-eps_low, 1+eps_high) A),
                                          dual clip, truncated IS optional]
        + kl.beta * KL(logp, ref_logp) - entropy_coef * H

and the micro-batch loss is `aggregate(l, token_weights)`: weights from the GlobalLossNormalizer
of the whole mini-batch (counts over the DP group only), so the loss, the gradient and every
logged policy metric (weighted with the same token weights) are the same on every layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from megatron.core import parallel_state as ps

from engine.training.loss import GlobalLossNormalizer, aggregate
from engine.training.micro_batches import SequenceData
from engine.rl.policy_loss import POLICY_LOSSES, kl_penalty
from engine.training.schedule import LossFn
from engine.training.token_losses import token_entropy, token_logprobs
from engine.training.train_engine import TrainEngine

# Weighted sums reported by the loss function, reduced over micro-batches and DP x CP; the
# first drives the non-finite guard.
REPORT_KEYS = ("policy/loss", "policy/pg_loss", "policy/clipfrac_low", "policy/clipfrac_high",
               "policy/kl", "policy/entropy", "policy/response_tokens")


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
    tis_cap: float | None = None
    policy_loss: str = "ppo_clip"

    @classmethod
    def from_config(cls, cfg, vocab_size: int) -> "PolicyLossSettings":
        return cls(vocab_size=vocab_size, temperature=cfg.rollout.temperature,
                   eps_low=cfg.clip.eps_low, eps_high=cfg.clip.eps_high, dual_c=cfg.clip.dual_c,
                   kl_beta=cfg.kl.beta, kl_estimator=cfg.kl.estimator,
                   entropy_coef=cfg.entropy_coef, tis_cap=cfg.rollout.tis_cap,
                   policy_loss=cfg.policy_loss)


def policy_loss_fn(s: PolicyLossSettings) -> LossFn:
    """loss_fn(logits [b, s, V/tp], mb) -> (weighted loss sum, report) for TrainEngine.
    Reads mb.extras "old_logprobs", "advantages", and "ref_logprobs" (kl_beta > 0),
    "rollout_logprobs" (tis_cap). Collective over TP (vocab-parallel log-probs, entropy)."""
    per_token_loss = POLICY_LOSSES[s.policy_loss]

    def loss_fn(logits, mb):
        w = mb.token_weights
        logp = token_logprobs(logits, mb.labels, s.vocab_size, s.temperature)
        old = mb.extras["old_logprobs"]
        terms = per_token_loss(logp, old, mb.extras["advantages"], s)
        pg = terms.loss
        if s.tis_cap is not None:  # truncated IS: pi_old / pi_rollout, capped, on sampled tokens
            is_weight = torch.exp(old - mb.extras["rollout_logprobs"]).clamp(max=s.tis_cap)
            pg = pg * torch.where(mb.loss_mask > 0, is_weight, torch.ones_like(is_weight))
        per_token = pg
        kl = torch.zeros_like(logp)
        if s.kl_beta > 0:
            kl = kl_penalty(logp, mb.extras["ref_logprobs"], s.kl_estimator)
            per_token = per_token + s.kl_beta * kl
        with torch.set_grad_enabled(s.entropy_coef != 0 and torch.is_grad_enabled()):
            entropy = token_entropy(logits, s.vocab_size, s.temperature)
        if s.entropy_coef != 0:
            per_token = per_token - s.entropy_coef * entropy
        loss = aggregate(per_token, w)
        with torch.no_grad():
            report = {
                "policy/loss": loss.detach(), "policy/pg_loss": aggregate(pg, w),
                "policy/clipfrac_low": aggregate(terms.clipped_low, w),
                "policy/clipfrac_high": aggregate(terms.clipped_high, w),
                "policy/kl": aggregate(kl, w), "policy/entropy": aggregate(entropy, w),
                "policy/response_tokens": mb.loss_mask.sum(),
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


def policy_update(engine: TrainEngine, seqs: list[SequenceData], loss_cfg,
                  settings: PolicyLossSettings, horizon: float) -> dict[str, float]:
    """One optimizer step on the mini-batch `seqs` (every rank passes the same list); returns
    the globally reduced weighted sums (REPORT_KEYS), grad_norm, lr, train/update_skipped,
    train/micro_batches and time/update_s. A non-finite loss or gradient skips the update
    (engine.guard counts it; the RL loop raises after logging the step)."""
    normalizer = GlobalLossNormalizer(loss_cfg.agg_mode, horizon, loss_cfg.count_empty_sequences,
                                      group=ps.get_data_parallel_group())
    out = engine.train_batch(seqs, normalizer, policy_loss_fn(settings), REPORT_KEYS)
    out["time/update_s"] = out.pop("time/step_s")
    return out
