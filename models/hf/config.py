"""HF config.json values read through transformers' own config class, and the check that the
bridge maps every field that changes the math (models.families field tables).

Reading through `transformers.AutoConfig.for_model` gives the values transformers' model uses:
legacy `rope_scaling` / top-level `rope_theta` become `rope_parameters`, `layer_types` is
derived from the sliding-window fields, defaults are filled in.
"""
from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from transformers import AutoConfig

from models.families.base import UnsupportedConfigError
from models.families.registry import family_of, register_hf_classes
from models.formats.quantized import quantization_problem

register_hf_classes()  # model_types transformers lacks, e.g. kimi_k2 (Family.register_hf_classes)


@lru_cache(maxsize=16)
def _config_object(config_json: str):
    values = json.loads(config_json)
    model_type = values.pop("model_type")
    for key in ("transformers_version", "_name_or_path"):
        values.pop(key, None)
    try:
        return AutoConfig.for_model(model_type, **values)
    except (ValueError, TypeError, KeyError) as e:
        raise UnsupportedConfigError(f"transformers rejects config.json: {e}") from None


def hf_config_object(hf_config: Any):
    """The transformers config for a config.json dict (a transformers config is returned as
    is). Raises UnsupportedArchitectureError / UnsupportedConfigError."""
    if not isinstance(hf_config, dict):
        return hf_config
    family_of(hf_config)
    return _config_object(json.dumps(hf_config, sort_keys=True, default=str))


def config_problems(hf_config: Any) -> list[str]:
    """Every config field whose value the bridge cannot map exactly (empty: converts exactly).
    Raises UnsupportedArchitectureError for an unknown model_type."""
    fam = family_of(hf_config)
    try:
        cfg = hf_config_object(hf_config)
    except UnsupportedConfigError as e:
        return [str(e)]
    problems = fam.problems(cfg)
    if not any("quantization_config" in rule.field for rule in fam.fields):
        quant = quantization_problem(cfg)  # any family: fp8 blocks load exactly, rest refused
        problems += [quant] if quant else []
    return [f"config.json field {p}" for p in problems]


def check_config(hf_config: Any) -> None:
    """Raise UnsupportedConfigError naming every field that does not map (one line)."""
    problems = config_problems(hf_config)
    if problems:
        fam = family_of(hf_config)
        raise UnsupportedConfigError(f"{fam.describe()} cannot be converted exactly: "
                                     + "; ".join(problems))
