"""The trainer's part of one RL step on every rank: the log-prob stage, then one optimizer step
per mini-batch (the critic's first with PPO, then the policy's), epochs_per_rollout times; and
the models beside the policy (`build_auxiliary`).

Metrics of the updates are averaged over the step's optimizer steps, except maxima (MAX_KEYS)
which take the max and the compile/* counts (train.compile) which are the last update's. With
logging.rollout_dir, rank 0 (the collector's rank, which wrote the step's dump) adds the token
fields the stage computed: teacher_logprobs (distillation) and values, returns and advantages
(PPO), aligned with each record's token_ids.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from engine.config.compile_settings import compile_overrides
from engine.config.fusion_settings import fusion_overrides
from engine.config.model_settings import megatron_overrides
from engine.config.moe_settings import moe_overrides
from engine.training.muon import megatron_distributed_optimizer
from engine.config.parallel_settings import overlap_settings
from engine.config.schema import read_hf_config
from engine.rl.collect.batch import build_sequences
from engine.rl.env.dump import add_token_field
from engine.rl.policy.critic import CriticSettings, critic_update
from engine.rl.policy.logprob_stage import AuxiliaryModels, logprob_stage
from engine.rl.policy.reward_model import build_reward_model
from engine.rl.policy.routing_replay import end_replay
from engine.rl.policy.update import MAX_KEYS, PolicyLossSettings, policy_update, split_mini_batches
from engine.training.host_offload import HostOffload
from engine.training.loss_head import DEFAULT_LOSS_CHUNK_TOKENS
from engine.training.nonfinite import NonFiniteGuard
from engine.training.train_engine import BatchSettings, TrainEngine
from models.bridge.critic import load_critic
from models.layers.heads.value import attach_value_heads

# Metrics averaged over the optimizer steps of one RL step (maxima: MAX_KEYS).
UPDATE_MEAN_KEYS = ("policy/loss", "policy/pg_loss", "policy/clipfrac_low",
                    "policy/clipfrac_high", "policy/kl", "policy/entropy", "grad_norm",
                    "train/update_skipped",
                    "train/prefix_token_ratio",   # tree / unshared tokens (1.0 unshared)
                    # old log-probs from the training forward (engine.rl.policy.old_logprobs):
                    # the rollout-vs-trainer gap, measured by its one update
                    "rollout/logprob_diff", "rollout/logprob_diff_max")
CRITIC_KEYS = ("critic/value_loss", "critic/grad_norm", "critic/vpred_mean",
               "critic/values_clipfrac")
# dump field -> the sequence extra it holds (when the stage computed it)
DUMP_FIELDS = {"teacher_logprobs": "teacher_logprobs", "values": "values",
               "returns": "returns", "advantages": "advantages"}


def _dump_fields(cfg, aux: AuxiliaryModels, batch, seqs, step: int) -> None:
    if not cfg.logging.rollout_dir or dist.get_rank() != 0:
        return
    wanted = (["teacher_logprobs"] if aux.teacher is not None else []) + \
        (["values", "returns", "advantages"] if aux.critic is not None else [])
    for name in wanted:
        add_token_field(cfg.logging.rollout_dir, step + 1, name, batch.dump_rows,
                        [s.extras[DUMP_FIELDS[name]] for s in seqs])


def _mean_metrics(updates: list[dict], keys) -> dict[str, float]:
    out = {}
    for key in keys:
        values = [u[key] for u in updates if key in u]  # a maximum is absent without tokens
        if values:
            out[key] = max(values) if key in MAX_KEYS else sum(values) / len(values)
    return out


def train_on_rollout(policy: TrainEngine, aux: AuxiliaryModels | None, batch, cfg,
                     step: int) -> dict[str, float]:
    """Collective over the world: every rank passes the same rollout batch; returns the
    metrics of the trainer's side (complete on every rank)."""
    aux = aux or AuxiliaryModels()
    seqs = build_sequences(batch)
    metrics = logprob_stage(policy, aux, seqs, cfg, batch.rewards)
    _dump_fields(cfg, aux, batch, seqs, step)
    settings = PolicyLossSettings.from_config(cfg, policy.vocab_size)
    critic_settings = CriticSettings.from_config(cfg)
    horizon = cfg.loss.norm_horizon or cfg.rollout.max_new_tokens
    updates, critic_updates = [], []
    for epoch in range(cfg.train.epochs_per_rollout):
        for part in split_mini_batches(len(seqs), cfg.train.mini_batches_per_step, cfg.seed,
                                       step, epoch, cfg.data.shuffle):
            mini = [seqs[i] for i in part]
            if aux.critic is not None:
                critic_updates.append(critic_update(aux.critic, mini, cfg.loss,
                                                    critic_settings, horizon))
            updates.append(policy_update(policy, mini, cfg.loss, settings, horizon))
    end_replay(policy)
    # moe/*: MoE policies (engine.training.router_losses); rollout_corr/*: bypass mode;
    # mtp/*: model.mtp.enabled (engine.training.mtp)
    moe_keys = sorted({k for u in updates for k in u
                       if k.startswith(("moe/", "rollout_corr/", "mtp/"))})
    metrics.update(_mean_metrics(updates, (*UPDATE_MEAN_KEYS, *moe_keys)))
    metrics.update(_mean_metrics(critic_updates, CRITIC_KEYS))
    # compile/*: train.compile's counts since the process started (engine.training.
    # compile_report), so the last update's, not a mean
    metrics.update({k: v for k, v in updates[-1].items() if k.startswith("compile/")})
    metrics["lr"] = updates[-1]["lr"]
    metrics["train/optimizer_steps"] = float(len(updates))
    metrics["train/micro_batches"] = sum(u["train/micro_batches"] for u in updates)
    metrics["train/response_tokens"] = sum(u["policy/response_tokens"] for u in updates)
    return metrics


def build_auxiliary(cfg, hf_config: dict, dtype: torch.dtype, batching: BatchSettings,
                    pad_id: int, optimizer_steps: int) -> AuxiliaryModels:
    """The models beside the policy, at its layout. Frozen (forward-only, never recomputed):
    the KL reference, the initial policy (model.hf_path, also after a resume; with LoRA
    (model.lora.rank > 0) none is built: the reference runs inside the policy, its frozen base
    with the adapters switched off, or after model.lora.init_from the starting adapter, a
    frozen copy (AuxiliaryModels.reference_is_base)); the distillation teacher,
    distill.teacher_path (any supported family sharing the tokenizer), with distill.offload
    kept in host memory from here on except during its forward pass (AuxiliaryModels.
    teacher_offload); the reward model, reward.model.path (engine.rl.policy.reward_model,
    with reward.model.offload in host memory outside its forward pass).
    Trained: the PPO critic (a full model, also when the policy has LoRA adapters), the
    policy's initial weights plus a zero value head
    (models.layers.heads.value), or critic.hf_path (a critic in HF form, models.bridge.critic), with
    optim.* but critic.lr, critic.warmup_steps and min_lr scaled by critic.lr / optim.lr; it
    always takes hidden states (the chunked head's path)."""
    def frozen(config: dict, path: str) -> TrainEngine:
        return TrainEngine.frozen(config, dtype, path, batching, pad_id,
                                  loss_chunk_tokens=cfg.train.loss_chunk_tokens or None,
                                  **megatron_overrides(cfg.parallel),
                                  **moe_overrides(cfg, config, forward_only=True),
                                  **fusion_overrides(cfg, config))

    teacher_path = cfg.distill.teacher_path
    base_reference = cfg.kl.beta > 0 and bool(cfg.model.lora.rank)  # LoRA: the policy's base
    aux = AuxiliaryModels(
        reference=(frozen(hf_config, cfg.model.hf_path)
                   if cfg.kl.beta > 0 and not base_reference else None),
        reference_is_base=base_reference,
        teacher=(frozen(read_hf_config(teacher_path, "distill.teacher_path"), teacher_path)
                 if teacher_path else None),
        reward_model=build_reward_model(cfg, dtype, batching, pad_id))
    if aux.teacher is not None and cfg.distill.offload:
        aux.teacher_offload = HostOffload(aux.teacher.chunks)
        aux.teacher_offload.offload()
    if cfg.advantage.estimator == "gae":
        critic_cfg = cfg.critic
        optim = dataclasses.replace(cfg.optim, lr=critic_cfg.lr,
                                    warmup_steps=critic_cfg.warmup_steps,
                                    min_lr=cfg.optim.min_lr * critic_cfg.lr / cfg.optim.lr)
        path = critic_cfg.hf_path
        aux.critic = TrainEngine.build(
            hf_config, optim, dtype, optimizer_steps, batching, pad_id,
            weights_dir=cfg.model.hf_path, load_weights=path is None,
            prepare=(attach_value_heads if path is None else
                     lambda raw: load_critic(raw, path, hf_config)),
            overlap=overlap_settings(cfg.parallel, megatron_distributed_optimizer(cfg.optim)),
            loss_chunk_tokens=cfg.train.loss_chunk_tokens or DEFAULT_LOSS_CHUNK_TOKENS,
            **megatron_overrides(cfg.parallel, cfg.train), **moe_overrides(cfg, hf_config),
            **fusion_overrides(cfg, hf_config), **compile_overrides(cfg))
        aux.critic.guard = NonFiniteGuard(cfg.train.max_consecutive_nonfinite_steps)
    return aux
