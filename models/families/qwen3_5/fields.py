"""Config-field rows of the Qwen3.5 tables (models.families.qwen3_5.family), the wrapper fields of the
conditional-generation checkpoints (read as their text model: models.hf.conditional) and the
registry entries of their model_type. Each check returns None when the value maps exactly,
else one sentence naming the field, its value and what is supported."""
from __future__ import annotations

from typing import Any

from models.families.base import Family, FieldRule, field
from models.families.fields import layer_kinds_problem, viewed_as

LAYER_KINDS = ("linear_attention", "full_attention")


def layer_types(cfg: Any) -> list[str]:
    return list(field(cfg, "layer_types", []) or [])


def linear_layers(cfg: Any) -> set[int]:
    """0-based indices of the Gated DeltaNet layers."""
    return {i for i, kind in enumerate(layer_types(cfg)) if kind == "linear_attention"}


def _layer_types(cfg: Any) -> str | None:
    return layer_kinds_problem(layer_types(cfg), int(field(cfg, "num_hidden_layers")),
                               LAYER_KINDS)


def _hidden_act(cfg: Any) -> str | None:
    act = field(cfg, "hidden_act", "silu")
    if act == "silu":
        return None
    return (f"hidden_act={act!r} is not supported (it is also the Gated DeltaNet conv "
            "activation); supported: silu")


def _attention_bias(cfg: Any) -> str | None:
    if not field(cfg, "attention_bias", False):
        return None
    return ("attention_bias=True is not supported for Qwen3.5 (the gated q_proj bias is not "
            "mapped); supported: false")


def _gdn_heads(cfg: Any) -> str | None:
    keys, values = int(field(cfg, "linear_num_key_heads")), int(field(cfg,
                                                                       "linear_num_value_heads"))
    if keys >= 1 and values % keys == 0:
        return None
    return (f"linear_num_value_heads={values} is not a multiple of linear_num_key_heads={keys}; "
            "supported: each key head serving an integer number of value heads")


HIDDEN_ACT_SILU = FieldRule("hidden_act", "silu (MLP and GDN conv); refused: others",
                            _hidden_act)
ATTENTION_BIAS = FieldRule("attention_bias", "false; refused: true", _attention_bias)
LAYER_TYPES = FieldRule("layer_types / full_attention_interval", "any sequence of "
                        "linear_attention (Gated DeltaNet) and full_attention layers -> the "
                        "per-layer spec (models.layers.gated_delta_net.spec) and linear_attention_freq",
                        _layer_types)
GDN_FIELDS = (
    FieldRule("linear_num_key_heads / linear_num_value_heads", "value heads a multiple of key "
              "heads -> linear_num_key_heads / linear_num_value_heads (TP x CP must divide "
              "both)", _gdn_heads),
    FieldRule("linear_key_head_dim / linear_value_head_dim", "any -> linear_key_head_dim / "
              "linear_value_head_dim"),
    FieldRule("linear_conv_kernel_dim", "any -> linear_conv_kernel_dim (causal depthwise conv)"),
    FieldRule("(no field) output gates", "full attention: q_proj carries a sigmoid gate per "
              "head -> attention_output_gate; GDN: in_proj_z gates its RMSNorm (silu)"),
    FieldRule("(no field) zero-centred norms", "every decoder RMSNorm computes "
              "norm(x) * (1 + weight) -> models.layers.norms.zero_centered (weights copied as stored)"),
    FieldRule("initializer_range / use_cache / pad_token_id / bos_token_id / eos_token_id",
              "no effect on the forward pass"),
)


MTP = FieldRule("mtp_num_hidden_layers / mtp_use_dedicated_embeddings", "the MTP layers "
                "(mtp.* tensors), which transformers' model does not build: no effect on the "
                "forward pass; they pass through unchanged, or with model.mtp.enabled (one "
                "layer, shared embeddings) are trained (models.layers.mtp)")



class Qwen3_5Conditional(Family):
    """Qwen3_5ForConditionalGeneration's model_type: its config.json is read as the text
    model's (models.hf.conditional), so no config of this model_type reaches the bridge; one
    that does (not read through the view) is refused."""

    model_type = "qwen3_5"
    hf_class = "Qwen3_5ForConditionalGeneration"
    text_model_type = "qwen3_5_text"
    fields = viewed_as("qwen3_5_text")


class Qwen3_5MoeConditional(Qwen3_5Conditional):
    model_type = "qwen3_5_moe"
    hf_class = "Qwen3_5MoeForConditionalGeneration"
    text_model_type = "qwen3_5_moe_text"
    fields = viewed_as("qwen3_5_moe_text")
