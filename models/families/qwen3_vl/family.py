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
from models.families.qwen3_vl.presets import PRESETS
from models.families.fields import (ATTENTION_DROPOUT, HEAD_DIM, HIDDEN_ACT, MROPE, NORM, TIE,
                                    WRAPPER, not_viewed)

_TEXT_FIELDS = ("every field through the text model's table (text_config: rope_parameters, "
                "rope_scaling, rope_theta, partial_rotary_factor, hidden_act, head_dim, "
                "rms_norm_eps, attention_bias, attention_dropout); the top-level "
                "tie_word_embeddings")


class Qwen3VL(Family):
    model_type = "qwen3_vl_text"
    hf_class = "Qwen3VLForConditionalGeneration"
    qk_norm = True
    vision_prefix = "model.visual."    # the wrapper's vision tower (models.vision)
    presets = PRESETS                  # text views of the published wrappers (presets.py)
    # vLLM 0.32's qwen3_vl module imports transformers' Qwen2-VL image processor (torchvision)
    vllm_imports_torchvision = True
    fields = (MROPE, HIDDEN_ACT, ATTENTION_DROPOUT, HEAD_DIM, NORM, TIE,
              FieldRule("attention_bias", "false; refused: true (the published models have "
                        "none)", lambda cfg: "attention_bias=true is not supported; supported: "
                        "false" if getattr(cfg, "attention_bias", False) else None),
              FieldRule("intermediate_size", "any -> ffn_hidden_size"),
              FieldRule("(no field) q/k norm", "always on -> megatron qk_layernorm"),
              WRAPPER)

    def passthrough(self, cfg: Any, name: str) -> bool:
        return False


class Qwen3VLConditional(Family):
    """Qwen3VLForConditionalGeneration's model_type: read as qwen3_vl_text (models.hf.
    conditional); a config of this model_type that reaches the bridge unviewed is refused."""

    model_type = "qwen3_vl"
    hf_class = "Qwen3VLForConditionalGeneration"
    text_model_type = "qwen3_vl_text"
    fields = (FieldRule(f"model_type ({_TEXT_FIELDS})", "read as qwen3_vl_text "
                        "(models.hf.conditional)", not_viewed),)
