"""`python -m engine.rm --config RECIPE --validate [--nodes M] [--gpus-per-node G]`: check a
reward-model recipe for a cluster shape without GPUs, weights or training (exit 0, or 2 listing
problems).

The SFT check (engine.config.recipe_validation.validate_recipe: layout, memory per GPU, the
communication plan) runs on the SEQUENCES of a step: a global batch of G pairs is 2G sequences
and a micro-batch of M pairs 2M sequences (engine.rm.loss_fn keeps a pair's sides together).
The score head adds hidden_size parameters (nothing at this scale); the unused output layer is
frozen (no gradient or optimizer state), which the SFT estimate counts as trained: the estimate
is an upper bound by that much. Beside it: the rm.* keys (engine.config.rm_settings).
"""
from __future__ import annotations

import copy

from engine.config.micro_batch_defaults import per_micro_batch
from engine.config.recipe_validation import RecipeReport, model_config, validate_main, \
    validate_recipe
from engine.config.rm_settings import RMConfig, rm_problems


def validate_rm_recipe(cfg, world_size: int, nodes: int) -> RecipeReport:
    """Every problem and warning of running the reward-model recipe `cfg` on `nodes` nodes."""
    sequences = copy.deepcopy(cfg)
    sequences.train.global_batch_size *= 2
    if sequences.train.micro_batch_size:   # pairs -> sequences (null: the default budget)
        sequences.train.micro_batch_size *= 2
    report = validate_recipe(sequences, world_size, nodes)
    hf = model_config(cfg, [])
    if hf is None or not report.summary:
        return report
    report.problems += [p for p in rm_problems(cfg, hf) if "is not a reward model" not in p]
    t = cfg.train
    report.summary[2:2] = [
        f"pairs: {t.global_batch_size} per step ({2 * t.global_batch_size} sequences), "
        f"{per_micro_batch(sequences.train, t.micro_batch_size)}; Bradley-Terry loss on each side's "
        "end-of-turn token's score"
        + (f", center_rewards_coefficient {cfg.rm.center_rewards_coefficient}"
           if cfg.rm.center_rewards_coefficient else "")]
    return report


def main(argv: list[str]) -> int:
    return validate_main(argv, RMConfig, validate_rm_recipe)
