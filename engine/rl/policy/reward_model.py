"""RL against a learned reward model (reward.model.*; docs/rl.md#rl-against-a-reward-model).

The reward model (RM) is an HF *ForSequenceClassification checkpoint with one label
(models.bridge.reward_model): the trunk of a causal LM plus `score.weight` [1, h]. Its score of
a sequence of token ids is score.weight . h_last, with h_last the final-norm hidden state of the
sequence's LAST token. Here it is a frozen TrainEngine at the trainer's layout (TP/PP/CP/EP
sharded like the KL reference), forward-only with hidden states (the chunked head's path), its
score head on the last pipeline stage; with reward.model.offload its weights stay in host memory
except during its forward pass (engine.training.host_offload).

Scoring (`score_sequences`): each token-id list goes in WHOLE, as
SequenceData(tokens=ids, labels=ids[1:] + [pad], loss mask 1 on the last position only), so the
hidden state at position len - 1 is the last token's. A trajectory's ids are prompt + response as
generated, and a response that stopped ends on its end-of-turn (eos) id: the token a reward
model trained by engine.rm was trained on (a side's last trained token,
engine.rm.training.scored_ids), and the token transformers' sequence classifier scores on the
same ids. A multi-turn episode ends on its last sampled id too (observations are appended only
before another turn). A response cut by rollout.max_new_tokens (or by its episode's token
budget) has no end-of-turn id: its last generated id is scored, a position the model was not
trained on. TP rank 0 of the last stage writes the
head's value at that position into a table indexed by the sequence (seq_ids, position_ids undo
DP partition, packing and CP sharding: the last token lives on one CP rank), and the table is
summed over the world: every rank gets every score, whatever the layout.

Where it runs: colocated, during the rollout phase, through the pool's `score` command (every
rank runs `RewardModel.score`; engine.rl.collect.collector adds weight x score to each
response's score before shaping, dynamic sampling, advantages and the dump); disaggregated, on
the training ranks when a batch arrives (`rescore_batch`): the rollout ranks hold no training
model, and the RM stays at the trainer's layout beside the policy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from engine.config.fusion_settings import fusion_overrides
from engine.config.model_settings import megatron_overrides
from engine.config.moe_settings import moe_overrides
from engine.config.schema import read_hf_config
from engine.rl.algo.advantages import ADVANTAGE_ESTIMATORS, zero_std_groups
from engine.rl.algo.gae import TOKEN_ESTIMATORS
from engine.rl.collect.batch import RolloutBatch
from engine.rl.env.dump import add_model_scores
from engine.training.host_offload import HostOffload
from engine.training.loss_head import DEFAULT_LOSS_CHUNK_TOKENS
from engine.training.micro_batches import SequenceData
from engine.training.train_engine import BatchSettings, TrainEngine
from models.bridge.reward_model import load_reward_model
from models.layers.heads.value import value_head
from parallel import cpu_runtime


def score_sequences(engine: TrainEngine, ids: list[list[int]]) -> list[float]:
    """The score of each token-id list (module docstring): float32 values as Python floats,
    identical on every rank. Collective over the world."""
    seqs = [SequenceData(tokens=list(x), labels=list(x[1:]) + [engine.pad_id],
                         loss_mask=[0] * (len(x) - 1) + [1]) for x in ids]
    device = cpu_runtime.device()
    last = torch.tensor([len(x) - 1 for x in ids], dtype=torch.long, device=device)
    table = torch.zeros(len(ids), dtype=torch.float32, device=device)
    head = value_head(engine.chunks)
    writer = ps.get_tensor_model_parallel_rank() == 0

    def output_fn(output, mb):
        values = head(output.hidden)  # [b, s] float32 (a SUM over TP inside)
        if writer:
            valid = mb.seq_ids >= 0
            ends = valid & (mb.position_ids == last[mb.seq_ids.clamp(min=0)])
            table[mb.seq_ids[ends]] = values[ends].detach()

    engine.forward_only(seqs, output_fn=output_fn)
    if dist.get_world_size() > 1:
        dist.all_reduce(table)
    return table.cpu().tolist()


@dataclass
class RewardModel:
    """The run's reward model: its frozen engine, reward.model.weight and, with
    reward.model.offload, the host copy of its weights."""

    engine: TrainEngine
    weight: float
    offload: HostOffload | None = None

    def score(self, ids: list[list[int]]) -> list[float]:
        """score_sequences (collective over the world), its weights on the device meanwhile."""
        if self.offload is not None:
            self.offload.reload()
        try:
            return score_sequences(self.engine, ids)
        finally:
            if self.offload is not None:
                self.offload.offload()


def build_reward_model(cfg, dtype: torch.dtype, batching: BatchSettings,
                       pad_id: int) -> RewardModel | None:
    """reward.model.path's reward model at the policy's layout (None without one), frozen,
    in model.dtype; offloaded to host memory from here on with reward.model.offload."""
    rm = cfg.reward.model
    if not rm.path:
        return None
    config = read_hf_config(rm.path, "reward.model.path")
    engine = TrainEngine.frozen(
        config, dtype, rm.path, batching, pad_id,
        loss_chunk_tokens=cfg.train.loss_chunk_tokens or DEFAULT_LOSS_CHUNK_TOKENS,
        load_weights=False, prepare=lambda raw: load_reward_model(raw, rm.path, config),
        **megatron_overrides(cfg.parallel), **moe_overrides(cfg, config, forward_only=True),
        **fusion_overrides(cfg, config))
    offload = HostOffload(engine.chunks) if rm.offload else None
    if offload is not None:
        offload.offload()
    return RewardModel(engine, float(rm.weight), offload)


def rescore_batch(batch: RolloutBatch, rm: RewardModel, cfg, dump_step: int) -> None:
    """A disaggregated run, every training rank, when `batch` arrived (the same on every rank;
    collective over the world): the reward model's score of every trajectory (prompt and
    response ids as generated), weight x score added to each score and reward, the
    sequence-level advantages and reward/mean, reward/std, reward/frac_zero_std_groups
    recomputed as the colocated collector computes them (the rollout side kept every group:
    dynamic sampling is refused with a reward model there), reward/model_mean logged; rank 0
    adds rm_score and the new reward to the step's dump records (logging.rollout_dir)."""
    if not len(batch):
        return
    raw = torch.tensor(rm.score([list(p) + list(r) for p, r in
                                 zip(batch.prompt_ids, batch.response_ids)]))
    scores = torch.tensor(batch.scores, dtype=torch.float32) + rm.weight * raw
    rewards = torch.tensor(batch.rewards, dtype=torch.float32) + rm.weight * raw
    n, adv = cfg.rollout.n, cfg.advantage
    if adv.estimator in TOKEN_ESTIMATORS:
        advantages = torch.zeros_like(rewards)
    else:
        lengths = torch.tensor([sum(m) for m in batch.response_masks] if batch.response_masks
                               else [len(r) for r in batch.response_ids])
        advantages = ADVANTAGE_ESTIMATORS[adv.estimator](rewards, n, adv, lengths)
    batch.scores, batch.rewards = scores.tolist(), rewards.tolist()
    batch.advantages = advantages.tolist()
    batch.metrics.update({
        "reward/mean": float(scores.mean()), "reward/std": float(scores.std(unbiased=False)),
        "reward/frac_zero_std_groups": float(zero_std_groups(scores, n).float().mean()),
        "reward/model_mean": float(raw.mean())})
    if cfg.logging.rollout_dir and dist.get_rank() == 0 and batch.dump_rows:
        if add_model_scores(cfg.logging.rollout_dir, dump_step, batch.dump_rows, raw.tolist(),
                            batch.scores) is None:
            print(f"[rl] warning: the rollout dump of step {dump_step} is not on training rank "
                  "0's machine: its rm_score fields are not written", flush=True)
