"""LoRA RL harness (launched by tests/test_rl_lora.py on the rank pool).

    torchrun --nproc_per_node W tests/multirank/lora_rl_check.py MODEL_DIR

At tp=W with Megatron sequence parallelism (W = 1 or 2), on the fixed synthetic rollout batch of
tests/multirank/rl_invariance.py, with a LoRA policy (all-linear, rank 4, fresh adapters):

1. one policy update (engine.rl.policy.update.policy_update) per policy loss / estimator /
   rollout-correction combination of the RL harness (plain GRPO ppo_clip with a k3 KL to the
   frozen base, then tests/multirank/rl_variants.VARIANTS: gspo, geo_mean, cispo, sapo, the two
   bypass modes), in sequence on the same policy: each loss finite, each grad norm > 0;
2. only the adapters changed: every base parameter bitwise equal to its value after loading,
   every adapter's B moved off zero; the trainable parameters (those DDP and the optimizer
   hold) are exactly the adapters, and their count on this rank equals
   models.estimate.lora.adapter_parameters' per-rank count of the first stage;
3. the KL reference: the policy's log-probs with its adapters switched off
   (engine.rl.policy.logprob_stage.base_logprobs) against a separately built frozen base
   (TrainEngine.frozen of MODEL_DIR): largest relative difference; the negative control, the
   policy's log-probs with its adapters on; and the policy's log-probs before and after the
   switch (adapters back on).
Rank 0 prints one "RESULT {json}".
"""
from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

RANK, ALPHA, SEED = 4, 8.0, 3


def build_policy(model_dir: str, hf_config: dict, steps: int, sp: bool):
    """(the LoRA policy, a separately built frozen base, the LoraSpec) at the current layout."""
    import torch

    from engine.training.train_engine import TrainEngine
    from models.lora.adapters import LoraSpec
    from models.lora.sites import resolve_targets
    from tests.multirank import rl_invariance as inv

    spec = LoraSpec(RANK, ALPHA, resolve_targets("all-linear"), seed=SEED)
    train = SimpleNamespace(micro_batch_size=2, max_tokens_per_micro_batch=None,
                            balance_dp=True, packing=False)
    policy = TrainEngine.build(hf_config, inv.optim_settings(), torch.float32, steps, train,
                               weights_dir=model_dir, loss_chunk_tokens=inv.LOSS_CHUNK_TOKENS,
                               lora=spec, sequence_parallel=sp)
    frozen = TrainEngine.frozen(hf_config, torch.float32, model_dir, train,
                                loss_chunk_tokens=inv.LOSS_CHUNK_TOKENS, sequence_parallel=sp)
    return policy, frozen, spec


def run_updates(policy, batch, temperature: float) -> list[dict]:
    """One optimizer step per loss combination (module docstring, 1.). The log-prob tables
    are computed once, before the first update: the base's (the KL reference) does not change,
    and the old / rollout log-probs are perturbations of the policy's anyway."""
    from engine.rl.collect.batch import build_sequences
    from engine.rl.policy.logprob_stage import base_logprobs
    from engine.rl.policy.logprobs import attach_extra, compute_token_logprobs
    from engine.rl.policy.update import PolicyLossSettings, policy_update
    from tests.multirank import rl_invariance as inv
    from tests.multirank.rl_variants import VARIANTS

    seqs = build_sequences(batch)
    table = compute_token_logprobs(policy, seqs, temperature)
    reference = base_logprobs(policy, seqs, temperature)
    combos = {"grpo_kl": ("ppo_clip", "grpo", "token-mean", None), **VARIANTS}
    out = []
    for name, (loss, _estimator, mode, correction) in combos.items():
        seqs, _, corr, _ = inv._sequences(policy, batch, temperature, correction, table=table)
        attach_extra(seqs, "ref_logprobs", reference)
        settings = PolicyLossSettings(vocab_size=policy.vocab_size, policy_loss=loss,
                                      bypass=corr if corr.bypass_mode else None,
                                      **dict(inv.SETTINGS, temperature=temperature))
        loss_cfg = SimpleNamespace(agg_mode=mode, count_empty_sequences=True)
        m = policy_update(policy, seqs, loss_cfg, settings, inv.HORIZON)
        out.append({"name": name, "loss": m["policy/loss"], "grad_norm": m["grad_norm"],
                    "kl": m["policy/kl"], "skipped": m["train/update_skipped"]})
    return out


def frozen_base_report(policy, snapshot: dict, hf_config: dict, spec) -> dict:
    """Module docstring, 2.: what changed, what is trainable, the per-rank adapter count."""
    from megatron.core import parallel_state as ps

    from models.estimate.lora import adapter_parameters
    from models.lora.sites import is_adapter_param

    base_changed, adapters_unmoved, trainable_not_adapter, adapter_numel = 0, 0, 0, 0
    for name, p in policy.chunks[0].module.named_parameters():
        if is_adapter_param(name):
            adapter_numel += p.numel()
            adapters_unmoved += int(".B_" in name and bool((p == 0).all()))
            trainable_not_adapter += 0 if p.requires_grad else 1
        else:
            base_changed += int(not (p.detach() == snapshot[name]).all())
            trainable_not_adapter += int(p.requires_grad)
    ddp_params = sum(p.numel() for buf in policy.chunks[0].buffers for p in buf.params)
    counted = adapter_parameters(hf_config, spec.targets, spec.rank,
                                 ps.get_tensor_model_parallel_world_size(), 1)
    return {"base_changed": base_changed, "adapters_unmoved": adapters_unmoved,
            "wrong_trainable": trainable_not_adapter, "adapter_numel": adapter_numel,
            "ddp_numel": ddp_params, "counted_numel": counted.first_stage}


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def reference_report(policy, frozen, batch, temperature: float) -> dict:
    """Module docstring, 3."""
    from engine.rl.collect.batch import build_sequences
    from engine.rl.policy.logprob_stage import base_logprobs
    from engine.rl.policy.logprobs import compute_token_logprobs

    import torch

    seqs = build_sequences(batch)
    mask = [s.loss_mask for s in seqs]
    width = max(len(m) for m in mask)
    keep = torch.tensor([m + [0] * (width - len(m)) for m in mask], dtype=torch.bool)
    with_adapters = compute_token_logprobs(policy, seqs, temperature)[keep]
    base = base_logprobs(policy, seqs, temperature)[keep]
    again = compute_token_logprobs(policy, seqs, temperature)[keep]
    separate = compute_token_logprobs(frozen, seqs, temperature)[keep]
    return {"ref_rel": _rel(base, separate), "ref_abs": float((base - separate).abs().max()),
            "control_rel": _rel(with_adapters, separate),
            "restored_rel": _rel(again, with_adapters), "tokens": int(keep.sum())}


def main() -> None:
    import torch.distributed as dist

    from models.hf.io import read_config
    from parallel.layout import ParallelLayout
    from parallel.process_groups import init_distributed, setup_model_parallel, shutdown
    from tests.multirank import rl_invariance as inv
    from tests.multirank.rl_variants import VARIANTS

    model_dir = sys.argv[1]
    rank, world = init_distributed()
    setup_model_parallel(ParallelLayout(world, tp=world, sequence_parallel=world > 1))
    hf_config = read_config(model_dir)
    policy, frozen, spec = build_policy(model_dir, hf_config, 1 + len(VARIANTS), world > 1)
    snapshot = {n: p.detach().clone() for n, p in policy.chunks[0].module.named_parameters()}
    batch = inv.synthetic_rollout(hf_config["vocab_size"])
    temperature = inv.SETTINGS["temperature"]
    updates = run_updates(policy, batch, temperature)
    result = {"world": world, "updates": updates,
              **frozen_base_report(policy, snapshot, hf_config, spec),
              **reference_report(policy, frozen, batch, temperature)}
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    shutdown()


if __name__ == "__main__":
    from engine.cli import exit_process

    main()
    exit_process(0)
