"""Llama (LlamaForCausalLM): RMSNorm, SwiGLU, GQA, RoPE; optional attention and MLP biases."""
from __future__ import annotations

from typing import Any

from models.families.base import Biases, Family, FieldRule, field
from models.families.fields import COMMON_FIELDS

_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _llama31(hidden: int, ffn: int, layers: int, heads: int) -> dict:
    return dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=hidden,
                intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                rope_theta=500000.0, rms_norm_eps=1e-5, rope_scaling=_LLAMA31_ROPE,
                tie_word_embeddings=False)


class Llama(Family):
    model_type = "llama"
    lora = True
    vllm_lora_targets = Family.lora_targets   # vLLM's qkv_proj, o_proj, gate_up_proj, down_proj
    hf_class = "LlamaForCausalLM"
    fields = COMMON_FIELDS + (
        FieldRule("attention_bias", "false; true -> q/k/v biases (megatron add_qkv_bias) and "
                  "the o_proj bias (a biased linear_proj, models.layers.spec)"),
        FieldRule("mlp_bias", "false; true -> gate/up/down biases (megatron add_bias_linear; "
                  "linear_proj's bias follows attention_bias)"),
    )
    presets = {
        "llama-3.1-8b": _llama31(4096, 14336, 32, 32),
        "llama-3.1-70b": _llama31(8192, 28672, 80, 64),
    }

    def biases(self, cfg: Any) -> Biases:
        attention = bool(field(cfg, "attention_bias", False))
        return Biases(qkv=attention, o_proj=attention, mlp=bool(field(cfg, "mlp_bias", False)))
