"""The policy side of an RL step: log-probs recomputed forward-only, the per-token GRPO/DAPO
loss, and one optimizer step per mini-batch (DESIGN sections 4 and 9).

Loss contract (engine.loss): per token, with r = exp(logp - old_logp) and A the advantage,

    l = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)  [dual clip, truncated IS optional]
        + kl.beta * KL(logp, ref_logp) - entropy_coef * H

and the micro-batch loss is `aggregate(l, token_weights)`: weights from the GlobalLossNormalizer
of the whole mini-batch (counts over the DP group only), so the loss, the gradient and every
logged policy metric (weighted with the same token weights) are the same on every layout.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from engine.micro_batches import SequenceData

# Weighted sums reported by the loss function, reduced over micro-batches and DP x CP.
REPORT_KEYS = ["policy/loss", "policy/pg_loss", "policy/clipfrac_low", "policy/clipfrac_high",
               "policy/kl", "policy/entropy", "policy/response_tokens"]


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

    @classmethod
    def from_config(cls, cfg, vocab_size: int) -> "PolicyLossSettings":
        return cls(vocab_size=vocab_size, temperature=cfg.rollout.temperature,
                   eps_low=cfg.clip.eps_low, eps_high=cfg.clip.eps_high, dual_c=cfg.clip.dual_c,
                   kl_beta=cfg.kl.beta, kl_estimator=cfg.kl.estimator,
                   entropy_coef=cfg.entropy_coef, tis_cap=cfg.rollout.tis_cap)


def policy_loss_fn(s: PolicyLossSettings):
    """loss_fn(logits [b, s, V/tp], mb) -> (weighted loss sum, report) for engine.step.
    Reads mb.extras "old_logprobs", "advantages", and "ref_logprobs" (kl_beta > 0),
    "rollout_logprobs" (tis_cap). Collective over TP (vocab-parallel log-probs, entropy)."""
    from engine.loss import aggregate
    from engine.rl.policy_loss import clipped_surrogate, kl_penalty
    from engine.token_losses import token_entropy, token_logprobs

    def loss_fn(logits, mb):
        w = mb.token_weights
        logp = token_logprobs(logits, mb.labels, s.vocab_size, s.temperature)
        old = mb.extras["old_logprobs"]
        terms = clipped_surrogate(logp, old, mb.extras["advantages"], s.eps_low, s.eps_high,
                                  s.dual_c)
        pg = terms.loss
        if s.tis_cap is not None:  # truncated IS: pi_old / pi_rollout, capped, on sampled tokens
            is_weight = torch.exp(old - mb.extras["rollout_logprobs"]).clamp(max=s.tis_cap)
            pg = pg * torch.where(mb.loss_mask > 0, is_weight, torch.ones_like(is_weight))
        per_token = pg
        kl = torch.zeros_like(logp)
        if s.kl_beta > 0:
            kl = kl_penalty(logp, mb.extras["ref_logprobs"], s.kl_estimator)
            per_token = per_token + s.kl_beta * kl
        if s.entropy_coef != 0:
            entropy = token_entropy(logits, s.vocab_size, s.temperature)
            per_token = per_token - s.entropy_coef * entropy
        else:
            with torch.no_grad():
                entropy = token_entropy(logits, s.vocab_size, s.temperature)
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


def compute_token_logprobs(chunks: list, seqs: list[SequenceData], train_cfg, vocab_size: int,
                           temperature: float, pad_id: int = 0) -> torch.Tensor:
    """log p(labels[t]) at temperature T for every position of every sequence, as a float32
    CPU tensor [len(seqs), max length] (0 beyond a sequence's end), identical on every rank.

    Forward-only in this rank's micro-batches (train_cfg's sizes; memory does not grow with
    the rollout batch). Values are placed by (mini-batch position = mb.seq_ids, position within
    the sequence = mb.position_ids), which undoes DP partition, packing and CP zigzag sharding.
    Only TP rank 0 of the last pipeline stage writes; the table is summed over the world, so
    each entry has exactly one contributor. Collective over the whole world."""
    from megatron.core import parallel_state as ps

    from engine.loss import GlobalLossNormalizer
    from engine.sft_batches import build_rank_batch
    from engine.step import run_micro_batches
    from engine.token_losses import token_logprobs
    from parallel import cpu_runtime

    device = cpu_runtime.device()
    width = max(len(s.tokens) for s in seqs)
    table = torch.zeros(len(seqs), width, dtype=torch.float32, device=device)
    writer = ps.get_tensor_model_parallel_rank() == 0
    batch = build_rank_batch(seqs, GlobalLossNormalizer("token-sum"), train_cfg, pad_id)

    def output_fn(logits, mb):
        logp = token_logprobs(logits, mb.labels, vocab_size, temperature)
        if writer:
            valid = mb.seq_ids >= 0
            table[mb.seq_ids[valid], mb.position_ids[valid]] = logp[valid].to(table.dtype)

    def no_loss(logits, mb):
        return logits.sum() * 0.0, {}

    with torch.no_grad():
        run_micro_batches(chunks, batch.micro_batches, no_loss, forward_only=True,
                          output_fn=output_fn)
    if dist.get_world_size() > 1:
        dist.all_reduce(table)
    return table.cpu()


def attach_extra(seqs: list[SequenceData], name: str, table: torch.Tensor) -> None:
    """Set seqs[i].extras[name] = table[i, :len(seqs[i].tokens)] (as Python floats)."""
    for i, s in enumerate(seqs):
        s.extras[name] = table[i, :len(s.tokens)].tolist()


def logprob_gap(seqs: list[SequenceData], table: torch.Tensor) -> tuple[float, float]:
    """(mean, max) |rollout log-prob - recomputed log-prob| over the response tokens of `seqs`
    (extras "rollout_logprobs"), `table` from compute_token_logprobs."""
    gaps = []
    for i, s in enumerate(seqs):
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        rollout = torch.tensor(s.extras["rollout_logprobs"], dtype=torch.float32)
        gaps.append((rollout - table[i, :len(s.tokens)]).abs()[mask])
    flat = torch.cat(gaps) if gaps else torch.zeros(1)
    return float(flat.mean()), float(flat.max())


def split_mini_batches(num_seqs: int, num_mini_batches: int, seed: int, step: int,
                       epoch: int, shuffle: bool = True) -> list[list[int]]:
    """Positions 0..num_seqs-1 in `num_mini_batches` near-equal parts: a permutation seeded by
    (seed, step, epoch) (identity when not shuffling), then contiguous slices. Independent of
    the parallel layout. Fewer parts when there are fewer sequences than parts."""
    order = (np.random.default_rng([seed, step, epoch]).permutation(num_seqs) if shuffle
             else np.arange(num_seqs))
    parts = np.array_split(order, min(num_mini_batches, num_seqs))
    return [sorted(int(i) for i in p) for p in parts if len(p)]


def policy_update(state, seqs: list[SequenceData], loss_cfg, train_cfg,
                  settings: PolicyLossSettings, horizon: float, pad_id: int = 0
                  ) -> dict[str, float]:
    """One optimizer step on the mini-batch `seqs` (every rank passes the same list); returns
    the globally reduced weighted sums (REPORT_KEYS), grad_norm and lr. A non-finite loss or
    gradient skips the update and is counted in `state.guard` (engine.nonfinite); the RL loop
    calls `state.guard.raise_if_diverged()` after logging the step."""
    from megatron.core import parallel_state as ps

    from engine.loss import GlobalLossNormalizer
    from engine.nonfinite import guarded_optimizer_step
    from engine.sft_batches import build_rank_batch
    from engine.step import reduce_reports, run_micro_batches
    from engine.trainer import current_lr

    t0 = time.perf_counter()
    normalizer = GlobalLossNormalizer(loss_cfg.agg_mode, horizon, loss_cfg.count_empty_sequences,
                                      group=ps.get_data_parallel_group())
    batch = build_rank_batch(seqs, normalizer, train_cfg, pad_id)
    for chunk in state.chunks:
        chunk.zero_grad_buffer()
    state.optimizer.zero_grad()
    reports = run_micro_batches(state.chunks, batch.micro_batches, policy_loss_fn(settings))
    out = reduce_reports(reports, REPORT_KEYS)
    label = state.scheduler.num_steps + state.guard.skipped + 1  # optimizer steps attempted
    stepped, grad_norm = guarded_optimizer_step(state.optimizer, out["policy/loss"])
    lr = current_lr(state.optimizer)
    if stepped:
        state.scheduler.step(increment=1)
    state.guard.record(label, stepped, out["policy/loss"], grad_norm)
    out.update({"grad_norm": grad_norm, "lr": lr,
                "train/update_skipped": 0.0 if stepped else 1.0,
                "train/micro_batches": float(len(batch.micro_batches)),
                "time/update_s": time.perf_counter() - t0})
    return out
