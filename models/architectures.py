"""The supported HF architectures and what distinguishes them for the bridge."""
from __future__ import annotations

from dataclasses import dataclass


class UnsupportedArchitectureError(ValueError):
    """The HF config names an architecture this bridge does not convert."""


@dataclass(frozen=True)
class Architecture:
    """Per-family switches of the Megatron mapping."""

    name: str
    hf_class: str
    qkv_bias: bool
    qk_norm: bool


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", "LlamaForCausalLM", qkv_bias=False, qk_norm=False),
    "qwen2": Architecture("qwen2", "Qwen2ForCausalLM", qkv_bias=True, qk_norm=False),
    "qwen3": Architecture("qwen3", "Qwen3ForCausalLM", qkv_bias=False, qk_norm=True),
}


def architecture_of(hf_config) -> Architecture:
    """The Architecture for an HF config (object or dict), or a clear error listing the choices."""
    model_type = (hf_config.get("model_type") if isinstance(hf_config, dict)
                  else getattr(hf_config, "model_type", None))
    if model_type not in ARCHITECTURES:
        supported = ", ".join(f"{a.name} ({a.hf_class})" for a in ARCHITECTURES.values())
        raise UnsupportedArchitectureError(
            f"unsupported architecture model_type={model_type!r} in config.json; supported "
            f"model_type values: {supported}")
    return ARCHITECTURES[model_type]
