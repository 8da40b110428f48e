"""LoRA keys `model.lora.*` (SFT and RL; docs/lora.md).

- `model.lora.rank` (0: off): the adapter rank r; `model.lora.alpha`: the scaling numerator
  (scaling alpha / r, or alpha / sqrt(r) with `model.lora.rslora=true`, peft's use_rslora);
- `model.lora.dropout` (default 0): dropout on the adapter input while training. Any other
  value draws random masks that depend on the layout, so the layout invariance no longer holds;
- `model.lora.target_modules`: peft's names with peft 0.21's meaning on the model's family
  (engine.config.lora_family, models.lora.targets): projection names (models.lora.targets.
  TARGET_NAMES), `all-linear` (every nn.Linear but the head; where peft converts names for
  transformers' fused experts, Qwen3-MoE, Mixtral, GLM-4.5, DeepSeek-V3, also the experts and
  the router), gate_proj / up_proj / down_proj (Mixtral: w1 / w3 / w2) there as the experts'
  fused gate_up_proj (rank and alpha doubled, as peft writes) and down_proj, and the
  target_parameters words `experts` (both expert parameters at rank r),
  `experts.gate_up_proj`, `experts.down_proj`, `router`;
- `model.lora.rank_pattern` / `model.lora.alpha_pattern`: peft's {module pattern: rank /
  alpha}, matched as peft matches them (empty: init_from's, else none);
- `model.lora.init_from`: a PEFT adapter folder to start from; its r, lora_alpha,
  target_modules (and target_parameters), use_rslora, rank_pattern and alpha_pattern fill the
  keys left unset (`fill_lora_keys`), and keys given that contradict them are refused by name
  (DoRA, biases, per-layer adapters are refused);
- `model.lora.dora`: peft's use_dora; only false is implemented (refused by name otherwise).

`lora_problems` checks them before any process group exists; `lora_spec` gives the
models.lora.slices.LoraSpec that models.build.factory.build_model_chunks attaches.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from engine.config.lora_family import (FUSED_NAMES, family, family_spec, init_from_problems,
                                       layer_rank_problems, target_problems)
from models.families.base import ORIGINAL
from models.families.registry import FAMILIES
from models.lora.peft_config import adapter_config_problems, adapter_keys
from models.lora.slices import LoraSpec
from models.lora.targets import TARGET_NAMES, pattern_problems, target_list


# defaults of the keys left null (an init_from adapter's own values come first)
DEFAULTS = {"alpha": 16.0, "target_modules": ["all-linear"], "rslora": False}
_FILLED = ("alpha", "target_modules", "rslora")
_PATTERNS = ("rank_pattern", "alpha_pattern")   # empty: the adapter's


@dataclass
class LoraConfig:
    rank: int = 0                 # 0: no LoRA (full fine-tuning), unless init_from gives r
    alpha: Optional[float] = None     # null: init_from's lora_alpha, else 16
    dropout: float = 0.0          # > 0 breaks the layout invariance (random masks)
    target_modules: Optional[list[str]] = None   # null: init_from's, else [all-linear]
    init_from: Optional[str] = None   # PEFT adapter folder
    rslora: Optional[bool] = None  # alpha / sqrt(rank) (peft use_rslora); null: init_from's
    dora: bool = False            # peft use_dora: not implemented, only false
    # peft's {module pattern: rank} / {module pattern: alpha}; empty: init_from's, else none
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)  # as rank_pattern, for alpha


def fill_lora_keys(lora: LoraConfig) -> None:
    """Fill, in place, the model.lora.* keys left unset from model.lora.init_from's
    adapter_config.json (rank 0: its r; alpha, target_modules, rslora null: its lora_alpha,
    target_modules plus its target_parameters' words (models.lora.peft.adapter_keys),
    use_rslora; rank_pattern, alpha_pattern empty: its own), then the DEFAULTS. Explicit
    keys stay as given: `lora_problems` refuses those that contradict the adapter. Run by lora_problems before any process group starts, so the run's config.yaml
    holds the values it trained with."""
    found = adapter_keys(lora.init_from) if lora.init_from is not None else None
    if found is not None:
        if lora.rank == 0 and isinstance(found["rank"], int):
            lora.rank = found["rank"]
        for key in _FILLED:
            if getattr(lora, key) is None:
                setattr(lora, key, found[key])
        for key in _PATTERNS:
            if not getattr(lora, key):
                setattr(lora, key, found[key])
    for key, value in DEFAULTS.items():
        if getattr(lora, key) is None:
            setattr(lora, key, value)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _value_problems(lora: LoraConfig) -> list[str]:
    p: list[str] = []
    if not _number(lora.alpha) or not lora.alpha > 0:
        p.append(f"model.lora.alpha={lora.alpha!r} must be a number > 0")
    if not _number(lora.dropout) or not 0 <= lora.dropout < 1:
        p.append(f"model.lora.dropout={lora.dropout!r} must be in [0, 1) (0: exact at every "
                 "layout)")
    if lora.dora:
        p.append("model.lora.dora=true (DoRA) is not implemented; valid: false")
    for key in ("rslora", "dora"):
        if not isinstance(getattr(lora, key), bool):
            p.append(f"model.lora.{key}={getattr(lora, key)!r} must be true or false")
    names = target_list(lora.target_modules)
    valid = TARGET_NAMES + FUSED_NAMES + ("all-linear",)
    unknown = [n for n in names if n not in valid]
    if not names or unknown:
        p.append(f"model.lora.target_modules={names!r}: {unknown or 'empty'} not valid; "
                 f"choose from {', '.join(valid)}")
    for key in ("rank_pattern", "alpha_pattern"):
        p += [f"model.lora.{x}" for x in pattern_problems(getattr(lora, key), key)]
    return p


def _model_problems(cfg: Any, hf_config: dict) -> list[str]:
    lora, p = cfg.model.lora, []
    model_type = hf_config.get("model_type")
    if not family(hf_config).lora:  # the families' declared `lora`
        supported = [name for name, fam in FAMILIES.items() if fam.lora]
        return [f"model.lora.rank={lora.rank}: LoRA is not implemented for model_type "
                f"{model_type!r}; supported: {', '.join(supported)}"]
    if ORIGINAL in hf_config and "all-linear" in target_list(lora.target_modules):
        p.append(f"model.lora.target_modules=all-linear on a conditional-generation checkpoint "
                 f"(config.json model_type {hf_config[ORIGINAL].get('model_type')!r}): peft's "
                 "all-linear adapts the vision tower's linears too, which are carried "
                 "unchanged here (no adapter sites); list the text model's projections")
    p += target_problems(lora.target_modules, lora.dropout, hf_config)
    if p:
        return p
    spec = lora_spec(cfg, hf_config)
    p += layer_rank_problems(spec, hf_config)
    if lora.init_from is not None:
        problems = adapter_config_problems(lora.init_from)
        found = adapter_keys(lora.init_from)
        p += problems or init_from_problems(lora, spec, found, hf_config)
    return p


def lora_problems(cfg: Any, hf_config: dict) -> list[str]:
    """Every invalid model.lora.* value for this model, after `fill_lora_keys` (reads the
    init_from folder)."""
    lora = cfg.model.lora
    fill_lora_keys(lora)
    rank = lora.rank
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        return [f"model.lora.rank={rank!r} must be an integer >= 0 (0: no LoRA)"]
    if rank == 0:
        if lora.init_from is not None:
            return [f"model.lora.init_from={lora.init_from}: no adapter_config.json with an r "
                    "to take model.lora.rank from (not a PEFT LoRA adapter folder)"]
        return []
    p = _value_problems(lora)
    return p or _model_problems(cfg, hf_config)


def lora_spec(cfg: Any, hf_config: dict) -> LoraSpec | None:
    """The LoraSpec of model.lora.* on the model of `hf_config` (None when model.lora.rank is
    0; engine.config.lora_family.family_spec); seeded by `seed`."""
    lora = getattr(cfg.model, "lora", None)
    if lora is None:
        return None
    fill_lora_keys(lora)
    if not lora.rank:
        return None
    return family_spec(hf_config, int(lora.rank), float(lora.alpha), lora.target_modules,
                       bool(lora.rslora), _plain(lora.rank_pattern), _plain(lora.alpha_pattern),
                       float(lora.dropout), int(getattr(cfg, "seed", 0)))


def _plain(patterns) -> dict:
    """A pattern key's value as a plain dict in its order (an OmegaConf DictConfig too)."""
    return {str(k): v for k, v in (patterns or {}).items()}


def lora_build_kwargs(cfg: Any, hf_config: dict) -> dict:
    """TrainEngine.build arguments of model.lora.* ({} without LoRA)."""
    spec = lora_spec(cfg, hf_config)
    if spec is None:
        return {}
    return {"lora": spec, "lora_init": cfg.model.lora.init_from}
