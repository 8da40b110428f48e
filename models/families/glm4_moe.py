"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (`glm4_moe`, Glm4MoeForCausalLM).

Attention: GQA with q/k/v biases (`attention_bias`; o_proj never has one), an optional
per-head q/k RMSNorm before RoPE (`use_qk_norm` -> megatron qk_layernorm), partial RoPE
(`partial_rotary_factor`, 0.5 when absent: transformers' default for this model): the first
head_dim x factor dimensions of each head rotate (rotate-half, as megatron's `rotary_percent`),
the rest pass unchanged.
MLP: `first_k_dense_replace` dense SwiGLU layers, then sigmoid-routed MoE layers with shared
experts (models.families.sigmoid_routed: the routing, its megatron mapping and its refusals).

MTP (`num_nextn_predict_layers` > 0): the checkpoint holds the multi-token-prediction layers
as `model.layers.{N}.*` .. `model.layers.{N+n-1}.*` (N = num_hidden_layers), which
transformers drops on load and never runs. They pass through unchanged: stored as read with
every checkpoint this project writes (models.hf.passthrough) and written back, bitwise, by
every export; they are not trained.
"""
from __future__ import annotations

from typing import Any

from models.families.base import Biases, FieldRule, field, head_dim
from models.families.fields import (ATTENTION_DROPOUT, HEAD_DIM, HIDDEN_ACT, NORM, TIE,
                                    rope_parameters)
from models.families.moe import PEFT_QWEN2_MOE
from models.families.sigmoid_routed import MTP_LAYERS, ROUTING_FIELDS, SigmoidRoutedMoe


def rotary_fraction(cfg: Any) -> float:
    """The rotated fraction of each head (transformers keeps it in rope_parameters)."""
    params = rope_parameters(cfg)
    return float(params.get("partial_rotary_factor", field(cfg, "partial_rotary_factor", 0.5)))


def _rope(cfg: Any) -> str | None:
    params = rope_parameters(cfg)
    kind = params.get("rope_type", params.get("type", "default"))
    rotary = head_dim(cfg) * rotary_fraction(cfg)
    if kind == "default" and rotary == int(rotary) and int(rotary) % 2 == 0 and rotary > 0:
        return None
    return (f"rope_parameters rope_type={kind!r} with partial_rotary_factor="
            f"{rotary_fraction(cfg)!r} is not supported; supported: rope_type 'default' with "
            "head_dim x partial_rotary_factor a positive even integer")


GLM_FIELDS = (
    FieldRule("rope_parameters / rope_scaling (rope_type) / rope_theta / partial_rotary_factor",
              "rope_type default, any "
              "rope_theta -> rotary_base, partial_rotary_factor (default 0.5) -> rotary_percent;"
              " refused: other rope types", _rope),
    HIDDEN_ACT, ATTENTION_DROPOUT, HEAD_DIM, NORM, TIE,
    FieldRule("attention_bias", "true/false -> q/k/v biases (add_qkv_bias); o_proj has none"),
    FieldRule("use_qk_norm", "true/false -> qk_layernorm (per-head RMSNorm of q and k)"),
    FieldRule("intermediate_size", "any -> ffn_hidden_size of the dense layers"),
    MTP_LAYERS,
    FieldRule("max_position_embeddings", "any -> max_sequence_length (no effect on the "
              "default RoPE)"),
    FieldRule("initializer_range / use_cache / pad_token_id / bos_token_id / eos_token_id",
              "no effect on the forward pass"),
)


class Glm4Moe(SigmoidRoutedMoe):
    model_type = "glm4_moe"
    hf_class = "Glm4MoeForCausalLM"
    # the attention by peft's names (models.lora.sites), routed experts on SequentialMLP experts
    lora = True
    # gate/up/down_proj and all-linear as peft converts them: the routed experts and router,
    # never the dense layers' or the shared experts' MLP
    lora_targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    lora_fused = PEFT_QWEN2_MOE
    fields = GLM_FIELDS + ROUTING_FIELDS
    presets = {
        "glm-4.5-air": dict(
            model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], hidden_size=4096,
            intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=46,
            num_attention_heads=96, num_key_value_heads=8, head_dim=128, n_routed_experts=128,
            n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1,
            first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=1.0,
            attention_bias=True, use_qk_norm=False, partial_rotary_factor=0.5,
            rope_theta=1000000, vocab_size=151552, max_position_embeddings=131072,
            rms_norm_eps=1e-5, tie_word_embeddings=False, num_nextn_predict_layers=1,
            hidden_act="silu", pad_token_id=151329, eos_token_id=[151329, 151336, 151338]),
    }

    def biases(self, cfg: Any) -> Biases:
        return Biases(qkv=bool(field(cfg, "attention_bias", False)))

    def has_qk_norm(self, cfg: Any) -> bool:
        return bool(field(cfg, "use_qk_norm", False))

    def rotary_percent(self, cfg: Any) -> float:
        return rotary_fraction(cfg)
