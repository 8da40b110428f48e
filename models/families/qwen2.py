"""Qwen2 (Qwen2ForCausalLM): Llama-like, with q/k/v biases always on (no o_proj/MLP bias)."""
from __future__ import annotations

from typing import Any

from models.families.base import Biases, Family, FieldRule
from models.families.fields import COMMON_FIELDS, SLIDING_WINDOW


class Qwen2(Family):
    model_type = "qwen2"
    lora = True
    vllm_lora_targets = Family.lora_targets   # vLLM's qkv_proj, o_proj, gate_up_proj, down_proj
    hf_class = "Qwen2ForCausalLM"
    fields = COMMON_FIELDS + (
        SLIDING_WINDOW,
        FieldRule("(no field) q/k/v bias", "always on in HF Qwen2 -> megatron add_qkv_bias"),
    )
    presets: dict[str, dict] = {}

    def biases(self, cfg: Any) -> Biases:
        return Biases(qkv=True)
