"""The `--validate` estimate of the frozen models an RL run reads from folders of their own
(engine.rl.recipe_check): the distillation teacher (distill.teacher_path) and the reward model
(reward.model.path). Each is counted from its own config.json: its fullest pipeline stage's
parameters at the policy's tp / pp / ep, in model.dtype, frozen (no gradients or optimizer
state); a folder that is not on the validating machine is not counted, and the report says so.
"""
from __future__ import annotations

import os

from engine.config.schema import ConfigError, read_hf_config
from models.estimate.counting import stage_parameters
from models.estimate.training_memory import GIB


def frozen_config(path: str | None, key: str, problems: list[str]) -> dict | None:
    """The HF config of the folder `path` (config key `key`) for the estimate, or None: no such
    model, or its directory is not on this machine (not counted). A directory that is there but
    unreadable or unsupported is a problem (appended to `problems`), as model.hf_path's."""
    if not path or not os.path.isdir(path):
        return None
    try:
        return read_hf_config(path, key)
    except ConfigError as e:
        problems.append(str(e))
        return None


def frozen_memory(cfg, path: str | None, key: str, config: dict | None,
                  label: str) -> tuple[float, list[str]]:
    """(GiB per GPU, report lines) of the frozen model in `path` (config key `key`, called
    `label` in the report; `config` from frozen_config)."""
    par = cfg.parallel
    if not path:
        return 0.0, []
    if config is None:
        return 0.0, [f"{label}: NOT counted in the memory estimate ({key}={path} is not on this "
                     "machine; its config.json gives its size), so recipe.expected_memory_gib is "
                     "not compared"]
    stage = stage_parameters(config, par.tp, par.pp, par.ep)
    gib = max(stage.first_stage, stage.last_stage) * (
        2 if cfg.model.dtype == "bfloat16" else 4) / GIB
    return gib, [f"{label} per GPU (estimate, GiB): weights {gib:.1f} "
                 f"({config.get('model_type')}, {stage.total / 1e9:.2f} B parameters, frozen, "
                 f"{cfg.model.dtype}, at tp={par.tp} pp={par.pp})"]
