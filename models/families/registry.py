"""The registry of model families by HF `model_type` (one line per family), and the
mixture-of-experts queries that work for any family's config (dict or transformers object)."""
from __future__ import annotations

from typing import Any

from models.families.base import Family, UnsupportedArchitectureError, field
from models.families.deepseek_v3.family import DeepseekV3
from models.families.gpt_oss import GptOss
from models.families.glm4_moe import Glm4Moe
from models.families.deepseek_v3.kimi_k2 import KimiK2
from models.families.llama import Llama
from models.families.mixtral import Mixtral
from models.families.moe import ExpertNaming, MoeFamily
from models.families.qwen2 import Qwen2
from models.families.qwen3 import Qwen3
from models.families.qwen3_moe import Qwen3Moe
from models.families.qwen3_5.family import Qwen3_5, Qwen3_5Moe
from models.families.qwen3_5.fields import Qwen3_5Conditional, Qwen3_5MoeConditional
from models.families.qwen3_vl.family import (Qwen3VL, Qwen3VLConditional, Qwen3VLMoe,
                                             Qwen3VLMoeConditional)

FAMILIES: dict[str, Family] = {f.model_type: f for f in (Llama(), Qwen2(), Qwen3(), Qwen3Moe(),
                                                          Mixtral(), Qwen3_5(), Qwen3_5Moe(),
                                                          Qwen3_5Conditional(),
                                                          Qwen3_5MoeConditional(),
                                                          Qwen3VL(), Qwen3VLConditional(),
                                                          Qwen3VLMoe(), Qwen3VLMoeConditional(),
                                                          GptOss(), Glm4Moe(),
                                                          DeepseekV3(), KimiK2())}


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


def register_hf_classes() -> None:
    """Every family's `register_hf_classes` (idempotent): model_types transformers lacks."""
    for fam in FAMILIES.values():
        fam.register_hf_classes()


def model_presets() -> dict[str, dict]:
    """Every family's presets: model.shape name -> public config.json values."""
    return {name: preset for f in FAMILIES.values() for name, preset in f.presets.items()}


def moe_family(cfg: Any) -> MoeFamily | None:
    """The MoeFamily of a config, or None for a dense or unknown model_type."""
    fam = FAMILIES.get(field(cfg, "model_type"))
    return fam if isinstance(fam, MoeFamily) else None


def is_moe(cfg: Any) -> bool:
    """True for configs of a mixture-of-experts family (experts in the decoder layers)."""
    return moe_family(cfg) is not None


def experts_per_layer(cfg: Any) -> int:
    """Experts of each MoE layer of any family's config; 0 for a dense or unknown model (the
    value parallel.layout's `num_experts` check expects)."""
    fam = moe_family(cfg)
    return fam.num_experts(cfg) if fam else 0


def expert_naming(cfg: Any) -> ExpertNaming | None:
    """HF checkpoint names of the router and experts of a MoE config (None: dense)."""
    fam = moe_family(cfg)
    return fam.experts if fam else None
