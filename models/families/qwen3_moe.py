"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3 attention (per-head q/k RMSNorm) with a sparse MoE
block in every decoder layer: a linear router `mlp.gate` (no bias) over `num_experts` SwiGLU
experts `mlp.experts.{e}.{gate,up,down}_proj` of width `moe_intermediate_size`, softmax over
all experts, top-k, optional renormalisation of the k weights (`norm_topk_prob`). The shared
MoE mapping (megatron kwargs, router/expert names) is models.families.moe.

Config fields that only matter for HF's own training loss (`router_aux_loss_coef`,
`output_router_logits`) decide the default of the engine's `moe.aux_loss_coeff`
(engine.config.moe_settings); they never change the forward pass.
"""
from __future__ import annotations

from typing import Any

from models.families.base import Biases, FieldRule, field
from models.families.fields import COMMON_FIELDS, SLIDING_WINDOW
from models.families.moe import ALL_SPARSE, MOE_FIELDS, PEFT_QWEN2_MOE, ExpertNaming, MoeFamily


class Qwen3Moe(MoeFamily):
    model_type = "qwen3_moe"
    lora = True
    # the attention; gate/up/down_proj and all-linear as peft converts them: the experts
    # (target_parameters), all-linear also the router (gate.weight)
    lora_targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    lora_fused = PEFT_QWEN2_MOE
    hf_class = "Qwen3MoeForCausalLM"
    qk_norm = True
    experts = ExpertNaming(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")
    expert_width_field = "moe_intermediate_size"
    renormalise_field = "norm_topk_prob"
    fields = COMMON_FIELDS + (
        SLIDING_WINDOW,
        FieldRule("attention_bias", "false; true -> q/k/v biases (megatron add_qkv_bias) and "
                  "the o_proj bias (a biased linear_proj, models.layers.spec)"),
        FieldRule("(no field) q/k norm", "always on in HF Qwen3-MoE -> megatron qk_layernorm"),
        FieldRule("moe_intermediate_size", "any -> moe_ffn_hidden_size (each expert's SwiGLU)"),
        FieldRule("norm_topk_prob", "true -> moe_router_pre_softmax=false (softmax over the k "
                  "selected logits = renormalised top-k of the full softmax); false -> "
                  "moe_router_pre_softmax=true (softmax over all experts, top-k unscaled)"),
        ALL_SPARSE,
        FieldRule("intermediate_size", "unused when every layer is sparse (HF uses it only for "
                  "dense layers)"),
    ) + MOE_FIELDS
    presets = {
        "qwen3-30b-a3b": dict(
            model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048,
            intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
            num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
            num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
            mlp_only_layers=[], vocab_size=151936, max_position_embeddings=40960,
            rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
            router_aux_loss_coef=0.001, output_router_logits=False),
    }

    def biases(self, cfg: Any) -> Biases:
        attention = bool(field(cfg, "attention_bias", False))
        return Biases(qkv=attention, o_proj=attention)
