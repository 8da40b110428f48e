"""Reward-model training's configuration: the SFT tree plus `rm.*` (docs/preference.md).

- `model.hf_path`: an HF `*ForSequenceClassification` checkpoint with num_labels 1 (its
  `score.weight` [1, h] is the score head), or a causal LM whose new score row is drawn from
  N(0, `rm.init_std`^2) with a generator seeded by `seed` (the same row on every layout);
- `rm.init_std` (null: the model's `initializer_range`, else 0.02, transformers' own start
  for a new `score` layer); refused with a sequence-classification `model.hf_path`, which
  brings its head;
- `rm.center_rewards_coefficient` (null: off): c in the loss term c * mean((r_c + r_r)^2)
  (TRL's RewardTrainer);
- `model.mtp.enabled=true` is refused: a reward model trains no MTP layer (docs/mtp.md);
`train.global_batch_size` and `train.micro_batch_size` count pairs; data.train_files hold
preference rows (engine.data.preference; a row's optional `margin` enters the loss).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from engine.config.schema import LoggingConfig, SFTConfig, raise_problems, validate_sft
from models.bridge.head_checks import (classifier_problem, is_reward_model_config,
                                       reward_model_problem)

DEFAULT_INIT_STD = 0.02


@dataclass
class RMSettings:
    init_std: Optional[float] = None  # a causal LM's new score row ~ N(0, std^2); null: initializer_range
    center_rewards_coefficient: Optional[float] = None  # c * mean((r_c + r_r)^2) (TRL); null: off


@dataclass
class RMConfig(SFTConfig):
    logging: LoggingConfig = field(default_factory=lambda: LoggingConfig(dir="runs/rm"))
    rm: RMSettings = field(default_factory=RMSettings)


def score_init_std(cfg, hf_config: dict) -> float:
    """The std of a new score row (module docstring)."""
    if cfg.rm.init_std is not None:
        return float(cfg.rm.init_std)
    return float(hf_config.get("initializer_range") or DEFAULT_INIT_STD)


def rm_problems(cfg, hf_config: dict) -> list[str]:
    """Every violated rm.* / model.hf_path constraint of a reward-model run, naming the key."""
    r, p = cfg.rm, []
    if is_reward_model_config(hf_config):
        problem = reward_model_problem(cfg.model.hf_path)
        if problem:
            p.append(f"model.hf_path={cfg.model.hf_path} is not a reward model: {problem}")
        if r.init_std is not None:
            p.append(f"rm.init_std={r.init_std!r}: model.hf_path is a sequence classifier "
                     "whose score head is loaded; leave rm.init_std null")
    elif any(a.endswith("ForSequenceClassification") or a.endswith("ForTokenClassification")
             for a in hf_config.get("architectures") or []):
        p.append(f"model.hf_path={cfg.model.hf_path}: architectures "
                 f"{hf_config.get('architectures')} with {hf_config.get('id2label') or 2} "
                 "labels; a reward model is a *ForSequenceClassification with num_labels 1, "
                 "or a causal LM (a new score head)")
    if r.init_std is not None and not r.init_std > 0:
        p.append(f"rm.init_std={r.init_std!r} must be null or > 0")
    c = r.center_rewards_coefficient
    if c is not None and not c > 0:
        p.append(f"rm.center_rewards_coefficient={c!r} must be null (off) or > 0")
    missing = classifier_problem(hf_config)
    if missing:
        p.append(f"model.hf_path={cfg.model.hf_path}: {missing}")
    if cfg.model.mtp.enabled:
        p.append("model.mtp.enabled=true is not supported for reward models: a reward model "
                 "scores a sequence at one token and predicts none, so its MTP layer (a "
                 "draft model) would learn nothing; leave model.mtp.enabled false")
    return p


def validate_rm(cfg, world_size: int) -> dict:
    """validate_sft (model, data files, layout, batch, checkpoint keys) plus rm.*; before any
    process group exists. Returns the model's HF config dict."""
    hf_config = validate_sft(cfg, world_size)
    raise_problems(rm_problems(cfg, hf_config))
    return hf_config
