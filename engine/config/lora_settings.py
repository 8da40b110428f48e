"""LoRA keys `model.lora.*` (SFT and RL; docs/lora.md).

- `model.lora.rank` (0: off): the adapter rank r; `model.lora.alpha`: the scaling numerator
  (scaling alpha / r, or alpha / sqrt(r) with `model.lora.rslora=true`, peft's use_rslora);
- `model.lora.dropout` (default 0): dropout on the adapter input while training. Any other
  value draws random masks that depend on the layout, so the layout invariance no longer holds;
- `model.lora.target_modules`: HF projection names (models.lora.sites.TARGET_NAMES) or
  `all-linear` (every attention and MLP projection; not the experts, as in peft);
- `model.lora.init_from`: a PEFT adapter folder to start from; its r, lora_alpha,
  target_modules (and target_parameters: `experts`) and use_rslora fill the keys left unset
  (`fill_lora_keys`), and keys given that contradict them are refused by name (DoRA, biases,
  per-layer ranks are refused);
- `model.lora.dora`: peft's use_dora; only false is implemented (refused by name otherwise).

`lora_problems` checks them before any process group exists; `lora_spec` gives the
models.lora.adapters.LoraSpec that models.build.factory.build_model_chunks attaches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from models.families.base import ORIGINAL, Family
from models.families.registry import FAMILIES, experts_per_layer
from models.lora.adapters import LoraSpec
from models.lora.peft import adapter_config_problems, adapter_keys
from models.lora.sites import TARGET_NAMES, resolve_targets, target_list


# defaults of the keys left null (an init_from adapter's own values come first)
DEFAULTS = {"alpha": 16.0, "target_modules": ["all-linear"], "rslora": False}


@dataclass
class LoraConfig:
    rank: int = 0                 # 0: no LoRA (full fine-tuning), unless init_from gives r
    alpha: Optional[float] = None     # null: init_from's lora_alpha, else 16
    dropout: float = 0.0          # > 0 breaks the layout invariance (random masks)
    target_modules: Optional[list[str]] = None   # null: init_from's, else [all-linear]
    init_from: Optional[str] = None   # PEFT adapter folder
    rslora: Optional[bool] = None  # alpha / sqrt(rank) (peft use_rslora); null: init_from's
    dora: bool = False            # peft use_dora: not implemented, only false


def fill_lora_keys(lora: LoraConfig) -> None:
    """Fill, in place, the model.lora.* keys left unset from model.lora.init_from's
    adapter_config.json (rank 0: its r; alpha, target_modules, rslora null: its lora_alpha,
    target_modules plus `experts` for target_parameters, use_rslora), then the DEFAULTS.
    Explicit keys stay as given: `lora_problems` refuses those that contradict the adapter.
    Run by lora_problems before any process group starts, so the run's config.yaml holds the
    values it trained with."""
    found = adapter_keys(lora.init_from) if lora.init_from is not None else None
    if found is not None:
        if lora.rank == 0 and isinstance(found["rank"], int):
            lora.rank = found["rank"]
        for key in ("alpha", "target_modules", "rslora"):
            if getattr(lora, key) is None:
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
    unknown = [n for n in names if n not in TARGET_NAMES + ("all-linear",)]
    if not names or unknown:
        p.append(f"model.lora.target_modules={names!r}: {unknown or 'empty'} not valid; "
                 f"choose from {', '.join(TARGET_NAMES)} or all-linear")
    return p


def _model_problems(cfg: Any, hf_config: dict) -> list[str]:
    lora, p = cfg.model.lora, []
    family = hf_config.get("model_type")
    if not FAMILIES.get(family, Family()).lora:  # the families' declared `lora`
        supported = [name for name, fam in FAMILIES.items() if fam.lora]
        return [f"model.lora.rank={lora.rank}: LoRA is not implemented for model_type "
                f"{family!r}; supported: {', '.join(supported)}"]
    if ORIGINAL in hf_config and "all-linear" in target_list(lora.target_modules):
        p.append(f"model.lora.target_modules=all-linear on a conditional-generation checkpoint "
                 f"(config.json model_type {hf_config[ORIGINAL].get('model_type')!r}): peft's "
                 "all-linear adapts the vision tower's linears too, which are carried "
                 "unchanged here (no adapter sites); list the text model's projections")
    refused, known = FAMILIES[family].lora_refused, FAMILIES[family].lora_targets
    for name in target_list(lora.target_modules):
        if name in refused:
            p.append(f"model.lora.target_modules={name!r} on {family}: {refused[name]}")
        elif name not in known + ("all-linear", "experts"):
            p.append(f"model.lora.target_modules={name!r}: {family} has no such projection; "
                     f"its names: {', '.join(known)} (experts on MoE models), all-linear")
    targets = resolve_targets(lora.target_modules)
    moe = experts_per_layer(hf_config) > 0
    if "experts" in targets and not moe:
        p.append("model.lora.target_modules contains experts, but the model has no MoE "
                 "experts; remove it")
    if "experts" in targets and moe and lora.dropout:
        p.append(f"model.lora.dropout={lora.dropout} with experts in model.lora.target_modules: "
                 "expert adapters take no dropout (peft's adapters of fused expert parameters "
                 "refuse it too); set model.lora.dropout=0")
    if lora.init_from is not None:
        p += adapter_config_problems(lora.init_from, lora_spec(cfg),
                                     frozenset(known + ("experts",)))
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


def lora_spec(cfg: Any) -> LoraSpec | None:
    """The LoraSpec of model.lora.* (None when model.lora.rank is 0); seeded by `seed`."""
    lora = getattr(cfg.model, "lora", None)
    if lora is None:
        return None
    fill_lora_keys(lora)
    if not lora.rank:
        return None
    return LoraSpec(rank=int(lora.rank), alpha=float(lora.alpha),
                    targets=resolve_targets(lora.target_modules), dropout=float(lora.dropout),
                    rslora=bool(lora.rslora), seed=int(getattr(cfg, "seed", 0)))


def lora_build_kwargs(cfg: Any) -> dict:
    """TrainEngine.build arguments of model.lora.* ({} without LoRA)."""
    spec = lora_spec(cfg)
    if spec is None:
        return {}
    return {"lora": spec, "lora_init": cfg.model.lora.init_from}
