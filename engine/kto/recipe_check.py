"""`python -m engine.kto --config RECIPE --validate [--nodes M] [--gpus-per-node G]`: check a KTO
recipe for a cluster shape without GPUs, weights or training (exit 0, or 2 listing problems).

The SFT check (engine.config.recipe_validation.validate_recipe: layout, memory per GPU, the
communication plan) runs on the step's training pass: a global batch of G examples is G
sequences, a micro-batch of M examples M sequences. Beside it: the kto.* keys
(engine.config.kto_settings) and what the reference costs per GPU: a frozen copy of the
policy's weights at its layout (the fuller pipeline stage of one TP rank in model.dtype, a
vision tower whole on stage 0; no gradients, no optimizer state), nothing with LoRA (the
policy's base with its adapters off, or the starting adapter frozen beside the trained one).
The step's forward-only passes (the reference over the examples and their mismatched
sequences, the policy over the mismatched ones) free their activations micro-batch by
micro-batch, below the training pass's peak.
"""
from __future__ import annotations

from engine.config.kto_settings import KTOConfig, kto_problems
from engine.config.micro_batch_defaults import per_micro_batch
from engine.config.recipe_validation import (RecipeReport, model_config, validate_main,
                                             validate_recipe)
from models.estimate.counting import stage_parameters
from models.estimate.training_memory import GIB
from models.estimate.vision import tower_parameters


def reference_gib(cfg, hf: dict) -> float:
    """GiB per GPU of the frozen reference (module docstring); 0 with LoRA."""
    if cfg.model.lora.rank:
        return 0.0
    p = cfg.parallel
    stage = stage_parameters(hf, p.tp, p.pp, p.ep)
    width = 2 if cfg.model.dtype == "bfloat16" else 4
    return max(stage.first_stage + tower_parameters(hf), stage.last_stage) * width / GIB


def validate_kto_recipe(cfg, world_size: int, nodes: int) -> RecipeReport:
    """Every problem and warning of running the KTO recipe `cfg` on `nodes` nodes."""
    report = validate_recipe(cfg, world_size, nodes,
                             beside=lambda hf: ("reference", reference_gib(cfg, hf)))
    hf = model_config(cfg, [])
    if hf is None or not report.summary:
        return report
    report.problems += kto_problems(cfg, hf)
    t, k = cfg.train, cfg.kto
    ref = reference_gib(cfg, hf)
    policy = report.data["memory_gib"]["total"]
    what = ("none: the policy's base with its LoRA adapters off (or the starting adapter)"
            if cfg.model.lora.rank else
            f"{ref:.1f} GiB per GPU (a frozen copy of the weights, forward-only)")
    report.summary[2:2] = [
        f"examples: {t.global_batch_size} per step, {per_micro_batch(t)}; "
        f"kto beta {k.beta}, desirable_weight {k.desirable_weight}, undesirable_weight "
        f"{k.undesirable_weight}",
        f"reference: {what}; memory per GPU with it (estimate, GiB): {policy:.1f} + "
        f"{ref:.1f} = {policy + ref:.1f}"]
    report.data["memory_gib"]["reference"] = ref
    report.data["memory_gib"]["total_with_reference"] = policy + ref
    return report


def main(argv: list[str]) -> int:
    return validate_main(argv, KTOConfig, validate_kto_recipe)
