"""The registry of model families by HF `model_type` (one line per family)."""
from __future__ import annotations

from typing import Any

from models.families.base import Family, UnsupportedArchitectureError, field
from models.families.llama import Llama
from models.families.qwen2 import Qwen2
from models.families.qwen3 import Qwen3
from models.families.qwen3_moe import Qwen3Moe

FAMILIES: dict[str, Family] = {f.model_type: f for f in (Llama(), Qwen2(), Qwen3(), Qwen3Moe())}


def family_of(hf_config: Any) -> Family:
    """The Family of an HF config (dict or transformers object), or a clear error listing the
    supported model_type values."""
    model_type = field(hf_config, "model_type")
    if model_type not in FAMILIES:
        supported = ", ".join(f.describe() for f in FAMILIES.values())
        raise UnsupportedArchitectureError(
            f"unsupported architecture model_type={model_type!r} in config.json; supported "
            f"model_type values: {supported}")
    return FAMILIES[model_type]


def model_presets() -> dict[str, dict]:
    """Every family's presets: model.shape name -> public config.json values."""
    return {name: preset for f in FAMILIES.values() for name, preset in f.presets.items()}
