"""The PPO critic (`advantage.estimator=gae`, `critic.*`; docs/algorithms.md): the policy's
GPTModel with a scalar value head (models.layers.heads.value), its own optimizer, at the policy's
layout.

- `compute_token_values`: forward-only values of every position (the value of the state
  before each label), a table identical on every rank, placed by (sequence, position) as
  engine.rl.policy.logprobs places log-probs (undoes DP partition, packing and CP sharding).
- `attach_gae`: extras "values", "returns" and token-level "advantages" from
  engine.rl.algo.gae over the whole rollout batch.
- `critic_update`: one optimizer step of the value loss on a mini-batch (verl 0.9.1's
  compute_value_loss): per sampled token
      l_t = 0.5 * max((v_t - R_t)^2, (clip(v_t, V_t - c, V_t + c) - R_t)^2),  c = critic.value_clip
  aggregated with the GlobalLossNormalizer weights of loss.agg_mode (counts over the DP group
  only), so the loss and the gradient do not depend on the layout. Metrics: critic/value_loss
  (that loss), critic/grad_norm, critic/vpred_mean and critic/values_clipfrac (token means over
  the sampled tokens: sum over tokens / token count, both summed like the loss).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from engine.rl.algo.gae import gae, token_rewards
from engine.rl.policy.logprobs import attach_extra
from engine.training.loss import GlobalLossNormalizer, aggregate
from engine.training.micro_batches import SequenceData
from engine.training.train_engine import TrainEngine
from models.layers.heads.value import value_head
from parallel import cpu_runtime

REPORT_KEYS = ("critic/value_loss", "critic/_vpred_sum", "critic/_clipped", "critic/_tokens")


@dataclass
class CriticSettings:
    value_clip: float
    gamma: float
    lam: float

    @classmethod
    def from_config(cls, cfg) -> "CriticSettings":
        return cls(cfg.critic.value_clip, cfg.advantage.gamma, cfg.advantage.lam)


def _values(output, head) -> torch.Tensor:
    """[b, s] float32 values of a micro-batch (the critic always takes hidden states)."""
    return head(output.hidden)


def compute_token_values(critic: TrainEngine, seqs: list[SequenceData]) -> torch.Tensor:
    """float32 [len(seqs), max length] values, 0 beyond a sequence's end, identical on every
    rank (TP rank 0 of the last stage writes, then a SUM all-reduce over the world)."""
    width = max(len(s.tokens) for s in seqs)
    table = torch.zeros(len(seqs), width, dtype=torch.float32, device=cpu_runtime.device())
    head = value_head(critic.chunks)
    writer = ps.get_tensor_model_parallel_rank() == 0

    def output_fn(output, mb):
        values = _values(output, head)
        if writer:
            valid = mb.seq_ids >= 0
            table[mb.seq_ids[valid], mb.position_ids[valid]] = values[valid].detach()

    critic.forward_only(seqs, output_fn=output_fn)
    if dist.get_world_size() > 1:
        dist.all_reduce(table)
    return table.cpu()


def attach_gae(seqs: list[SequenceData], values: torch.Tensor, sampled: list[list[int]],
               rewards: list[float], settings: CriticSettings) -> None:
    """Set extras "values", "returns" and "advantages" (token-level, whitened over the batch's
    sampled tokens; 0 elsewhere) of every sequence. `sampled[i]`: sequence i's sampled
    positions (aligned with labels); `rewards[i]`: its response's reward."""
    width = values.shape[1]
    mask = torch.zeros(len(seqs), width, dtype=torch.float64)
    for i, m in enumerate(sampled):
        mask[i, :len(m)] = torch.tensor(m, dtype=torch.float64)
    advantages, returns = gae(token_rewards(rewards, sampled, width), values.double() * mask,
                              mask, settings.gamma, settings.lam)
    attach_extra(seqs, "values", values)
    attach_extra(seqs, "returns", returns * mask)
    attach_extra(seqs, "advantages", advantages * mask)


def value_loss_fn(settings: CriticSettings, head):
    """loss_fn(hidden states, mb) -> (weighted value-loss sum, report) for TrainEngine."""

    def loss_fn(output, mb):
        w = mb.token_weights
        vpred = _values(output, head)
        old, returns = mb.extras["values"], mb.extras["returns"]
        clip = settings.value_clip
        clipped = torch.maximum(torch.minimum(vpred, old + clip), old - clip)
        unclipped_loss, clipped_loss = (vpred - returns) ** 2, (clipped - returns) ** 2
        loss = aggregate(0.5 * torch.maximum(unclipped_loss, clipped_loss), w)
        with torch.no_grad():
            m = mb.loss_mask.to(vpred.dtype)
            report = {"critic/value_loss": loss.detach(),
                      "critic/_vpred_sum": (vpred * m).sum().double(),
                      "critic/_clipped": ((clipped_loss > unclipped_loss).to(m.dtype) * m).sum()
                      .double(),
                      "critic/_tokens": m.sum().double()}
        return loss, report

    return loss_fn


def critic_update(critic: TrainEngine, seqs: list[SequenceData], loss_cfg,
                  settings: CriticSettings, horizon: float) -> dict[str, float]:
    """One critic optimizer step on the mini-batch `seqs` (every rank passes the same list);
    returns critic/value_loss, critic/grad_norm, critic/vpred_mean, critic/values_clipfrac."""
    normalizer = GlobalLossNormalizer(loss_cfg.agg_mode, horizon, loss_cfg.count_empty_sequences,
                                      group=ps.get_data_parallel_group())
    out = critic.train_batch(seqs, normalizer, value_loss_fn(settings, value_head(critic.chunks)),
                             REPORT_KEYS)
    tokens = out["critic/_tokens"]
    return {"critic/value_loss": out["critic/value_loss"], "critic/grad_norm": out["grad_norm"],
            "critic/vpred_mean": out["critic/_vpred_sum"] / tokens if tokens else 0.0,
            "critic/values_clipfrac": out["critic/_clipped"] / tokens if tokens else 0.0}
