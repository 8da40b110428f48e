"""`python -m engine.dpo --config RECIPE --validate [--nodes M] [--gpus-per-node G]`: check a DPO
recipe for a cluster shape without GPUs, weights or training (exit 0, or 2 listing problems).

The SFT check (engine.config.recipe_validation.validate_recipe: layout, memory per GPU, the
communication plan) runs on the SEQUENCES of a step: a global batch of G pairs is 2G sequences
and a micro-batch of M pairs 2M sequences (engine.dpo.loss_fn keeps a pair's sides together).
Beside it: the dpo.* keys (engine.config.dpo_settings) and what the reference costs per GPU:
- a frozen copy of the policy's weights at its layout (the fuller pipeline stage of one TP
  rank in model.dtype, a vision tower whole on stage 0; no gradients, no optimizer state)
  and one forward-only pass over the step's pairs (its activations are freed micro-batch by
  micro-batch, below the training pass's peak);
- nothing with LoRA (the policy's base with its adapters off; after model.lora.init_from the
  starting adapter, a frozen rank-r copy beside the trained one) or a reference-free loss
  (simpo, orpo).
"""
from __future__ import annotations

import copy

from engine.config.dpo_settings import REFERENCE_FREE, DPOConfig, dpo_problems
from engine.config.micro_batch_defaults import per_micro_batch
from engine.config.recipe_validation import (RecipeReport, model_config, validate_main,
                                             validate_recipe)
from models.estimate.counting import stage_parameters
from models.estimate.training_memory import GIB
from models.estimate.vision import tower_parameters


def reference_gib(cfg, hf: dict) -> float:
    """GiB per GPU of the frozen reference (module docstring); 0 when there is none."""
    if cfg.dpo.loss_type in REFERENCE_FREE or cfg.model.lora.rank:
        return 0.0
    p = cfg.parallel
    stage = stage_parameters(hf, p.tp, p.pp, p.ep)
    width = 2 if cfg.model.dtype == "bfloat16" else 4
    return max(stage.first_stage + tower_parameters(hf), stage.last_stage) * width / GIB


def validate_dpo_recipe(cfg, world_size: int, nodes: int) -> RecipeReport:
    """Every problem and warning of running the DPO recipe `cfg` on `nodes` nodes."""
    sequences = copy.deepcopy(cfg)
    sequences.train.global_batch_size *= 2
    if sequences.train.micro_batch_size:   # pairs -> sequences (null: the default budget)
        sequences.train.micro_batch_size *= 2
    report = validate_recipe(sequences, world_size, nodes,
                             beside=lambda hf: ("reference", reference_gib(cfg, hf)))
    hf = model_config(cfg, [])
    if hf is None or not report.summary:
        return report
    report.problems += dpo_problems(cfg, hf)
    t = cfg.train
    ref = reference_gib(cfg, hf)
    policy = report.data["memory_gib"]["total"]
    what = ("none (reference-free loss)" if cfg.dpo.loss_type in REFERENCE_FREE else
            "none: the starting adapter (model.lora.init_from), a frozen rank-r copy beside "
            "the trained one" if cfg.model.lora.rank and cfg.model.lora.init_from else
            "none: the policy's base with its LoRA adapters off" if cfg.model.lora.rank else
            f"{ref:.1f} GiB per GPU (a frozen copy of the weights, forward-only)")
    report.summary[2:2] = [
        f"pairs: {t.global_batch_size} per step ({2 * t.global_batch_size} sequences), "
        f"{per_micro_batch(sequences.train, t.micro_batch_size)}; loss {cfg.dpo.loss_type}, "
        f"beta {cfg.dpo.beta}",
        f"reference: {what}; memory per GPU with it (estimate, GiB): {policy:.1f} + "
        f"{ref:.1f} = {policy + ref:.1f}"]
    report.data["memory_gib"]["reference"] = ref
    report.data["memory_gib"]["total_with_reference"] = policy + ref
    return report


def main(argv: list[str]) -> int:
    return validate_main(argv, DPOConfig, validate_dpo_recipe)
