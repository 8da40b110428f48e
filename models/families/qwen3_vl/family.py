"""Qwen3-VL dense (Qwen3VLForConditionalGeneration, model_type `qwen3_vl`).

The text model (`qwen3_vl_text`) is Qwen3's decoder: GQA with per-head q/k RMSNorm, SwiGLU
MLP, no biases, RoPE over the whole head laid out as interleaved M-RoPE (`mrope_section`,
default [24, 20, 20]: with text-only input all three positions are equal, 1-D RoPE exactly).
Deepstack: the vision tower also emits merged features of some of its blocks
(`vision_config.deepstack_visual_indexes`); the k-th is added to the output of decoder layer k
at the image tokens (models.vision.model). There is no text-only transformers class: the
wrapper is the model (verify and the tests compare with Qwen3VLForConditionalGeneration).

The wrapper's tensors: `model.language_model.*` (the text model, read as `model.*`),
`model.visual.*` (the vision tower, mapped to the trainer's tower), `lm_head.weight`.
"""
from __future__ import annotations

from typing import Any

from models.families.base import Family, FieldRule
from models.families.moe import ALL_SPARSE, MOE_FIELDS, ExpertNaming, MoeFamily
from models.families.qwen3_vl.presets import PRESETS
from models.families.fields import (ATTENTION_DROPOUT, HEAD_DIM, HIDDEN_ACT, MROPE, NORM,
                                    NO_ATTENTION_BIAS, TIE, WRAPPER, viewed_as)


class Qwen3VL(Family):
    model_type = "qwen3_vl_text"
    hf_class = "Qwen3VLForConditionalGeneration"
    qk_norm = True
    vision_prefix = "model.visual."    # the wrapper's vision tower (models.vision)
    presets = PRESETS                  # text views of the published wrappers (presets.py)
    # vLLM 0.32's qwen3_vl module imports transformers' Qwen2-VL image processor (torchvision)
    vllm_imports_torchvision = True
    fields = (MROPE, HIDDEN_ACT, ATTENTION_DROPOUT, HEAD_DIM, NORM, TIE, NO_ATTENTION_BIAS,
              FieldRule("intermediate_size", "any -> ffn_hidden_size"),
              FieldRule("(no field) q/k norm", "always on -> megatron qk_layernorm"),
              WRAPPER)


class Qwen3VLConditional(Family):
    """Qwen3VLForConditionalGeneration's model_type: read as qwen3_vl_text (models.hf.
    conditional); a config of this model_type that reaches the bridge unviewed is refused."""

    model_type = "qwen3_vl"
    hf_class = "Qwen3VLForConditionalGeneration"
    text_model_type = "qwen3_vl_text"
    fields = viewed_as("qwen3_vl_text")


class Qwen3VLMoe(MoeFamily):
    """Qwen3-VL-MoE's text model (`qwen3_vl_moe_text`): Qwen3VL's attention and M-RoPE with a
    sparse block in every layer: a linear router `mlp.gate.weight` [E, H], softmax over all
    experts, top-k, always renormalised; the experts fused ON DISK, gate and up concatenated:
    `mlp.experts.gate_up_proj` [E, H, 2I] (columns: gate, then up) and `mlp.experts.down_proj`
    [E, I, H] (models.layers.biased_experts.fused reads them as per-expert tensors; transformers
    holds them transposed in memory, [E, 2I, H] / [E, H, I])."""

    model_type = "qwen3_vl_moe_text"
    hf_class = "Qwen3VLMoeForConditionalGeneration"
    qk_norm = True
    vision_prefix = "model.visual."
    vllm_imports_torchvision = True
    experts = ExpertNaming(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")
    expert_width_field = "moe_intermediate_size"
    renormalise_field = None          # the router always renormalises the k weights
    fused_experts_on_disk = True
    fused_expert_layout = "concatenated"
    fused_experts_transposed_in_memory = True
    fields = Qwen3VL.fields + (
        FieldRule("moe_intermediate_size", "any -> moe_ffn_hidden_size (each expert's SwiGLU)"),
        FieldRule("(no field) routing", "softmax over all experts, top-k, always renormalised "
                  "-> moe_router_pre_softmax=false"),
        ALL_SPARSE,
    ) + MOE_FIELDS

    def layer_tensors(self, cfg: Any) -> tuple[str, ...]:
        """On-disk names: attention with q/k norms, norms, router, fused experts."""
        return (("input_layernorm.weight", "post_attention_layernorm.weight",
                 "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate.weight")
                + tuple(f"self_attn.{p}_proj.weight" for p in "qkvo")
                + ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))


class Qwen3VLMoeConditional(Qwen3VLConditional):
    model_type = "qwen3_vl_moe"
    hf_class = "Qwen3VLMoeForConditionalGeneration"
    text_model_type = "qwen3_vl_moe_text"
    fields = viewed_as("qwen3_vl_moe_text")
