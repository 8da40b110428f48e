"""DPO's configuration: the SFT tree plus `dpo.*` (docs/preference.md).

- `dpo.loss_type`: TRL's names, engine.dpo.pair_loss.LOSS_TYPES (sigmoid, the default; ipo,
  hinge, robust; simpo, reference-free as TRL's CPOTrainer loss_type=simpo with cpo_alpha=0;
  orpo, reference-free as TRL's experimental ORPOTrainer, with dpo.beta as its lambda);
- `dpo.beta` (0.1); `dpo.label_smoothing` (0: cDPO for sigmoid, the robust loss's eps, simpo's
  smoothing; refused for hinge, ipo and orpo, which have none); `dpo.simpo_gamma` (simpo only);
- `dpo.rpo_alpha` (null: off): alpha x the chosen completions' NLL, aggregated over the global
  batch with loss.agg_mode (token-mean by default: the token mean over ALL chosen completion
  tokens of the global batch, whatever the layout); refused with orpo, whose own NLL term
  (weight 1) covers the chosen sequences;
- `dpo.ref_path` (null: model.hf_path): the frozen reference's HF folder. With LoRA the
  reference is the policy's base with the adapters off (after `model.lora.init_from`: the
  starting adapter, frozen) and `ref_path` is refused; refused too with the reference-free
  loss types (simpo, orpo).
`train.global_batch_size` and `train.micro_batch_size` count pairs; data.train_files hold
preference rows (engine.data.preference).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from engine.errors import ConfigError
from engine.config.schema import (LoggingConfig, SFTConfig, check_choice, raise_problems,
                                  read_hf_config, validate_sft)

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo", "orpo")   # engine.dpo.pair_loss
SMOOTHED = ("sigmoid", "robust", "simpo")
REFERENCE_FREE = ("simpo", "orpo")
DEFAULT_SIMPO_GAMMA = 0.5


@dataclass
class DPOSettings:
    # sigmoid (DPO; cDPO with label_smoothing) | ipo | hinge | robust | simpo (reference-free)
    # | orpo (reference-free; SFT + odds-ratio preference, beta as ORPO's lambda)
    loss_type: str = "sigmoid"
    beta: float = 0.1                # beta of every loss type (ORPO's lambda, SimPO's beta)
    # eps of cDPO (sigmoid), robust (< 0.5) and simpo; must be 0 for hinge, ipo and orpo
    label_smoothing: float = 0.0
    # RPO: + alpha x NLL of the chosen completions (null: off); refused with orpo
    rpo_alpha: Optional[float] = None
    simpo_gamma: float = DEFAULT_SIMPO_GAMMA   # SimPO's target margin gamma (simpo only)
    # the frozen reference's HF folder (null: model.hf_path); refused with LoRA, simpo, orpo
    ref_path: Optional[str] = None


@dataclass
class DPOConfig(SFTConfig):
    logging: LoggingConfig = field(default_factory=lambda: LoggingConfig(dir="runs/dpo"))
    dpo: DPOSettings = field(default_factory=DPOSettings)


def dpo_problems(cfg, hf_config: dict) -> list[str]:
    """Every violated dpo.* constraint, as a sentence naming the key."""
    d, p = cfg.dpo, []
    check_choice(p, d.loss_type, "dpo.loss_type", LOSS_TYPES)
    if not d.beta > 0:
        p.append(f"dpo.beta={d.beta!r} must be > 0")
    eps = d.label_smoothing
    if eps and d.loss_type not in SMOOTHED:
        p.append(f"dpo.label_smoothing={eps!r}: dpo.loss_type={d.loss_type} has no label "
                 f"smoothing (it applies to {', '.join(SMOOTHED)}); leave it 0")
    elif d.loss_type == "robust" and not 0 <= eps < 0.5:
        p.append(f"dpo.label_smoothing={eps!r} must lie in [0, 0.5) for the robust loss")
    elif not 0 <= eps <= 0.5:
        p.append(f"dpo.label_smoothing={eps!r} must lie in [0, 0.5]")
    if d.rpo_alpha is not None and not d.rpo_alpha > 0:
        p.append(f"dpo.rpo_alpha={d.rpo_alpha!r} must be null (off) or > 0")
    elif d.rpo_alpha is not None and d.loss_type == "orpo":
        p.append(f"dpo.rpo_alpha={d.rpo_alpha!r}: dpo.loss_type=orpo has its own NLL term "
                 "(weight 1, every label of the chosen sequences); leave dpo.rpo_alpha null")
    if d.simpo_gamma != DEFAULT_SIMPO_GAMMA and d.loss_type != "simpo":
        p.append(f"dpo.simpo_gamma={d.simpo_gamma!r} applies only to dpo.loss_type=simpo "
                 f"(here {d.loss_type})")
    if d.ref_path:
        if d.loss_type in REFERENCE_FREE:
            p.append(f"dpo.ref_path={d.ref_path}: dpo.loss_type={d.loss_type} is "
                     "reference-free; leave dpo.ref_path null")
        elif cfg.model.lora.rank:
            p.append(f"dpo.ref_path={d.ref_path}: with LoRA (model.lora.rank > 0) the "
                     "reference is the policy's base with its adapters off (the starting "
                     "adapter, frozen, after model.lora.init_from); leave it null")
        else:
            p.extend(reference_problems(d.ref_path, hf_config))
    return p


def reference_problems(path: str, hf_config: dict, key: str = "dpo.ref_path") -> list[str]:
    """`key` (dpo.ref_path, kto.ref_path) must hold an HF checkpoint of the policy's
    architecture and shape."""
    try:
        ref = read_hf_config(path, key)
    except ConfigError as e:  # the message names the key
        return [str(e)]
    keys = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "intermediate_size")
    diff = [f"{k} {ref.get(k)!r} (policy {hf_config.get(k)!r})" for k in keys
            if ref.get(k) != hf_config.get(k)]
    return [f"{key}={path} is not the policy's architecture: {', '.join(diff)}"] \
        if diff else []


def validate_dpo(cfg, world_size: int) -> dict:
    """validate_sft (model, data files, layout, batch, checkpoint keys) plus dpo.*; before
    any process group exists. Returns the policy's HF config dict."""
    hf_config = validate_sft(cfg, world_size)
    raise_problems(dpo_problems(cfg, hf_config))
    return hf_config
