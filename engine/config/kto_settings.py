"""KTO's configuration: the SFT tree plus `kto.*` (docs/preference.md, "KTO").

- `kto.beta` (0.1): TRL's KTOConfig.beta, the scale of the implied rewards;
- `kto.desirable_weight`, `kto.undesirable_weight` (1.0): the weights of the desirable
  (label true) and undesirable (label false) examples' losses (TRL's names);
- `kto.ref_path` (null: model.hf_path): the frozen reference's HF folder; with LoRA the
  reference is the policy's base with the adapters off (after `model.lora.init_from`: the
  starting adapter, frozen) and `ref_path` is refused.
`train.global_batch_size` and `train.micro_batch_size` count examples (one prompt and one
completion each); the KL reference point pairs each example's prompt with another example's
completion of the same global batch, so a global batch needs at least 2 examples.
data.train_files hold unpaired rows (engine.data.preference_unpaired).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from engine.config.dpo_settings import reference_problems
from engine.config.schema import LoggingConfig, SFTConfig, raise_problems, validate_sft


@dataclass
class KTOSettings:
    beta: float = 0.1                 # scale of the implied rewards beta * log(pi / ref)
    desirable_weight: float = 1.0     # weight of a desirable (label true) example's loss
    undesirable_weight: float = 1.0   # weight of an undesirable (label false) example's loss
    ref_path: Optional[str] = None    # the reference's HF folder (null: model.hf_path)


@dataclass
class KTOConfig(SFTConfig):
    logging: LoggingConfig = field(default_factory=lambda: LoggingConfig(dir="runs/kto"))
    kto: KTOSettings = field(default_factory=KTOSettings)


def _positive_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def kto_problems(cfg, hf_config: dict) -> list[str]:
    """Every violated kto.* constraint (and KTO's batch-size floor), as a sentence naming the
    key."""
    k, p = cfg.kto, []
    for key in ("beta", "desirable_weight", "undesirable_weight"):
        if not _positive_number(getattr(k, key)):
            p.append(f"kto.{key}={getattr(k, key)!r} must be a number > 0")
    if cfg.train.global_batch_size < 2:
        p.append(f"train.global_batch_size={cfg.train.global_batch_size}: KTO's KL reference "
                 "point pairs each prompt with another example's completion of the same "
                 "global batch, so it needs at least 2 examples")
    if k.ref_path:
        if cfg.model.lora.rank:
            p.append(f"kto.ref_path={k.ref_path}: with LoRA (model.lora.rank > 0) the "
                     "reference is the policy's base with its adapters off (the starting "
                     "adapter, frozen, after model.lora.init_from); leave it null")
        else:
            p.extend(reference_problems(k.ref_path, hf_config, "kto.ref_path"))
    return p


def validate_kto(cfg, world_size: int) -> dict:
    """validate_sft (model, data files, layout, batch, checkpoint keys) plus kto.*; before
    any process group exists. Returns the policy's HF config dict."""
    hf_config = validate_sft(cfg, world_size)
    raise_problems(kto_problems(cfg, hf_config))
    return hf_config
