"""Qwen3 (Qwen3ForCausalLM): Llama-like with per-head RMSNorm on q and k; optional
attention biases (q/k/v and o_proj, like Llama's attention_bias)."""
from __future__ import annotations

from typing import Any

from models.families.base import Biases, Family, FieldRule, field
from models.families.fields import COMMON_FIELDS, SLIDING_WINDOW


class Qwen3(Family):
    model_type = "qwen3"
    lora = True
    vllm_lora_targets = Family.lora_targets   # vLLM's qkv_proj, o_proj, gate_up_proj, down_proj
    hf_class = "Qwen3ForCausalLM"
    qk_norm = True
    fields = COMMON_FIELDS + (
        SLIDING_WINDOW,
        FieldRule("attention_bias", "false; true -> q/k/v biases (megatron add_qkv_bias) and "
                  "the o_proj bias (a biased linear_proj, models.layers.spec)"),
        FieldRule("(no field) q/k norm", "always on in HF Qwen3 -> megatron qk_layernorm "
                  "(RMSNorm, eps rms_norm_eps)"),
    )
    presets = {
        "qwen3-8b": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"],
                         hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         vocab_size=151936, max_position_embeddings=40960,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
        "qwen3-1.7b": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"],
                           hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                           num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                           vocab_size=151936, max_position_embeddings=40960,
                           rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    }

    def biases(self, cfg: Any) -> Biases:
        attention = bool(field(cfg, "attention_bias", False))
        return Biases(qkv=attention, o_proj=attention)
