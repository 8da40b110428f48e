"""The H100 GRPO/DAPO recipes parse against the RL schema and get the algorithm's defaults."""
from pathlib import Path

import pytest

from engine.config import load_config
from engine.rl.config import RLConfig, apply_algorithm_defaults, explicit_keys

RECIPES = sorted(Path(__file__).resolve().parents[1].joinpath("recipes", "rl").glob("*.yaml"))


def test_both_recipes_exist():
    assert {p.name for p in RECIPES} == {"qwen3_8b_grpo_h100.yaml", "qwen3_8b_dapo_h100.yaml"}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_loads_with_algorithm_defaults(path):
    argv = ["--config", str(path)]
    cfg, _ = load_config(RLConfig, argv)
    cfg = apply_algorithm_defaults(cfg, explicit_keys(argv))
    assert cfg.rollout.backend == "sglang" and cfg.model.dtype == "bfloat16"
    assert cfg.train.seq_length >= cfg.rollout.max_new_tokens
    if cfg.algorithm == "dapo":
        assert (cfg.clip.eps_low, cfg.clip.eps_high, cfg.kl.beta) == (0.2, 0.28, 0.0)
        assert cfg.dapo.dynamic_sampling and cfg.dapo.overlong_buffer == 4096 // 5
    else:
        assert cfg.kl.beta > 0 and cfg.clip.eps_high == 0.2
