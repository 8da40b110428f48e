"""The log-prob stage of an RL step, ONE call before the updates (`logprob_stage`): MoE routing
replay begins, the old (proximal) policy's token log-probs with rollout correction
(engine.rl.algo.rollout_correction) in its two verl modes, and the KL reference's log-probs.

Where the old log-probs come from is decided once per run (engine.rl.policy.old_logprobs):
- from the training forward (an exactly on-policy step, train.old_logprobs=auto): no pass runs
  here; the update's loss detaches its own log-probs (engine.rl.policy.update);
- decoupled (rollout_correction.bypass_mode=false, three policies), wherever the policy may move
  before a training forward reads them: the trainer recomputes the old log-probs forward-only (engine.rl.policy.logprobs); IS weights and rejection between old and
  rollout log-probs are computed on the WHOLE rollout batch here, before any mini-batch or
  micro-batch split.
- bypass (two policies): the rollout engine's log-probs ARE the old log-probs; no forward pass
  runs here (one forward over the rollout batch saved per step); IS / rejection against the
  current policy happen in the loss (engine.rl.policy.update).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from engine.rl.algo.distill import apply_distillation
from engine.rl.algo.rollout_correction import apply_to_batch
from engine.rl.policy.critic import CriticSettings, attach_gae, compute_token_values
from engine.rl.policy.logprobs import attach_extra, compute_token_logprobs, logprob_gap
from engine.rl.policy.old_logprobs import old_logprobs_plan
from engine.rl.policy.reward_model import RewardModel
from engine.rl.policy.routing_replay import after_old_logprobs, start_routing_replay
from engine.training.host_offload import HostOffload
from engine.training.micro_batches import SequenceData
from engine.training.train_engine import TrainEngine
from models.hf.conditional import peft_layers
from models.lora.modes import adapters_disabled, has_reference, reference_adapters
from models.lora.peft import load_reference_adapter


def attach_old_logprobs(policy, seqs: list[SequenceData], cfg) -> dict[str, float]:
    """Set extras "old_logprobs" on every sequence (and, in decoupled mode with correction on,
    "rollout_is_weights" and rejected tokens' loss_mask 0); return the metrics
    (rollout/logprob_diff[_max] and rollout_corr/* in decoupled mode). Collective over the
    world in decoupled mode (the recompute forward); local in bypass mode. Sets nothing and
    returns {} where the old log-probs come from the training forward
    (old_logprobs_plan(cfg).from_forward)."""
    if old_logprobs_plan(cfg).from_forward:
        return {}
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


def base_logprobs(policy: TrainEngine, seqs: list[SequenceData], temperature: float):
    """compute_token_logprobs of the LoRA policy's frozen base: its forward with every adapter
    switched off (exactly the base model, whose weights training never changes)."""
    with adapters_disabled(policy.chunks):
        return compute_token_logprobs(policy, seqs, temperature)


def lora_reference_logprobs(policy: TrainEngine, seqs: list[SequenceData],
                            temperature: float, start_adapter: str | None):
    """compute_token_logprobs of a LoRA policy's KL reference: with `start_adapter` (the PEFT
    folder of model.lora.init_from) the policy with that starting adapter, frozen (as TRL
    keeps a pretrained adapter's frozen "ref" copy): loaded from the folder into the
    policy's reference matrices on the first call in this process (after a resume too: never
    the checkpoint's adapters; models.lora.peft.load_reference_adapter, local) and swapped in
    for the pass (models.lora.modes.reference_adapters); without it the frozen base
    (`base_logprobs`, the initial policy of fresh adapters). Collective over the world."""
    if start_adapter is None:
        return base_logprobs(policy, seqs, temperature)
    if not has_reference(policy.chunks):
        load_reference_adapter(policy.chunks, start_adapter, peft_layers(policy.hf_config))
    with reference_adapters(policy.chunks):
        return compute_token_logprobs(policy, seqs, temperature)


@dataclass
class AuxiliaryModels:
    """The models of an RL run beside the policy, all at the policy's layout: the frozen KL
    reference (kl.beta > 0) and distillation teacher (distill.teacher_path), and the PPO
    critic (advantage.estimator=gae; trained, with its own optimizer). `reference_is_base`:
    with LoRA the KL reference runs inside the policy, so `reference` stays None (no second
    model): the starting adapter of model.lora.init_from, frozen, or with fresh adapters the
    policy's own frozen base (its adapters switched off, models.lora.modes.
    adapters_disabled); `lora_reference_logprobs`.
    `reward_model` (reward.model.path) scores rollouts, not the batch's tokens: it takes no
    part in the log-prob stage (engine.rl.policy.reward_model)."""

    reference: TrainEngine | None = None
    reference_is_base: bool = False
    teacher: TrainEngine | None = None
    critic: TrainEngine | None = None
    # distill.offload: the teacher's weights live in host memory outside its forward pass
    teacher_offload: HostOffload | None = None
    reward_model: RewardModel | None = None


def logprob_stage(policy, aux: AuxiliaryModels | None, seqs: list[SequenceData], cfg,
                  rewards: list[float] = ()) -> dict[str, float]:
    """Everything the step's updates need besides the current policy, on every rank, in order:
    1. routing replay begins (moe.routing_replay: R2 records the old-log-prob forward's routing,
       R3 replays the rollout engine's);
    2. old log-probs and rollout correction (`attach_old_logprobs`);
    3. R2: the recorded routing travels with `seqs`; R3: moe/rollout_replay_mismatch. The
       policy replays from here until engine.rl.policy.routing_replay.end_replay after the updates;
    4. with a KL reference (kl.beta > 0, `aux.reference`): extras "ref_logprobs" from its
       forward-only pass (it keeps its own routing);
    5. with a critic (advantage.estimator=gae, `aux.critic`): its values of every position, then GAE's
       token-level advantages (whitened over the batch) and returns from `rewards` (one per
       sequence; engine.rl.policy.critic.attach_gae);
    6. with a distillation teacher (`aux.teacher`): extras "teacher_logprobs" from its
       forward-only pass at the rollout temperature (with `aux.teacher_offload` its weights
       come from host memory for that pass and go back after it), and the advantages of
       sampled tokens shifted by engine.rl.algo.distill.apply_distillation.
    With LoRA (`aux.reference_is_base`) step 4 runs first, on the policy with its starting
    adapter (model.lora.init_from) swapped in or its adapters switched off
    (`lora_reference_logprobs`), before routing replay begins (the reference routes on its
    own).
    Collective over the world (unless bypass mode, or old log-probs from the training forward,
    without reference and replay: local).
    Returns the metrics, with time/logprob_s the stage's wall time, time/old_logprob_s step 2's
    (0.0 where no pass runs) and time/reference_s step 4's (0.0 without a reference)."""
    start = time.perf_counter()
    aux = aux or AuxiliaryModels()
    sampled = [list(s.loss_mask) for s in seqs]  # before rejection zeroes rejected tokens
    reference_s = 0.0
    if aux.reference_is_base:
        t0 = time.perf_counter()
        attach_extra(seqs, "ref_logprobs", lora_reference_logprobs(
            policy, seqs, cfg.rollout.temperature, cfg.model.lora.init_from))
        reference_s = time.perf_counter() - t0
    mode = cfg.moe.routing_replay
    start_routing_replay(policy, mode)
    t0 = time.perf_counter()
    metrics = attach_old_logprobs(policy, seqs, cfg)
    metrics["time/old_logprob_s"] = time.perf_counter() - t0
    metrics.update(after_old_logprobs(policy, seqs, mode))
    if aux.reference is not None:
        t0 = time.perf_counter()
        attach_extra(seqs, "ref_logprobs",
                     compute_token_logprobs(aux.reference, seqs, cfg.rollout.temperature))
        reference_s = time.perf_counter() - t0
    metrics["time/reference_s"] = reference_s
    if aux.critic is not None:
        attach_gae(seqs, compute_token_values(aux.critic, seqs), sampled, list(rewards),
                   CriticSettings.from_config(cfg))
    if aux.teacher is not None:
        if aux.teacher_offload is not None:
            aux.teacher_offload.reload()
        attach_extra(seqs, "teacher_logprobs",
                     compute_token_logprobs(aux.teacher, seqs, cfg.rollout.temperature))
        if aux.teacher_offload is not None:
            aux.teacher_offload.offload()
        metrics.update(apply_distillation(seqs, sampled, cfg.distill.coef))
    metrics["time/logprob_s"] = time.perf_counter() - start
    return metrics
