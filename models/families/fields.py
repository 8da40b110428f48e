"""Config-field rows shared by the Llama, Qwen2 and Qwen3 tables (models.families.*).

Every check receives a transformers config object, so both spellings of RoPE settings work
(transformers >= 5 folds legacy `rope_scaling` and top-level `rope_theta` /
`partial_rotary_factor` into `rope_parameters`). A check returns None when the value maps
exactly, else one sentence naming the field, its value and what is supported.
"""
from __future__ import annotations

from typing import Any

from models.families.base import ACTIVATIONS, FieldRule, field, head_dim, original_config

# RoPE types whose inverse frequencies are fixed at build time: transformers' own function
# computes them and models.layers.attention.rope installs them in megatron (attention_factor -> softmax scale).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_ROPE_WHY = {
    "dynamic": "its frequencies change with the length of each batch",
    "longrope": "it switches between two frequency sets with the length of each batch",
}


def rope_parameters(cfg: Any) -> dict:
    params = field(cfg, "rope_parameters", {}) or {}
    return params if isinstance(params, dict) else {}


def _rope_type(cfg: Any) -> str | None:
    kind = rope_parameters(cfg).get("rope_type", rope_parameters(cfg).get("type", "default"))
    if kind in STATIC_ROPE_TYPES:
        return None
    why = _ROPE_WHY.get(kind, "the bridge does not implement it")
    return (f"rope_parameters.rope_type={kind!r} (config.json rope_scaling/rope_parameters) is "
            f"not supported: {why}; supported: {', '.join(STATIC_ROPE_TYPES)}")


def _partial_rotary(cfg: Any) -> str | None:
    factor = rope_parameters(cfg).get("partial_rotary_factor",
                                      field(cfg, "partial_rotary_factor", 1.0))
    if float(factor) == 1.0:
        return None
    return (f"partial_rotary_factor={factor!r} is not supported: this architecture rotates the "
            "whole head dimension; supported: 1.0")


def _hidden_act(cfg: Any) -> str | None:
    act = field(cfg, "hidden_act", "silu")
    if act in ACTIVATIONS:
        return None
    return f"hidden_act={act!r} is not supported; supported: {', '.join(ACTIVATIONS)}"


def _attention_dropout(cfg: Any) -> str | None:
    p = float(field(cfg, "attention_dropout", 0.0))
    if p == 0.0:
        return None
    return (f"attention_dropout={p!r} is not supported (the bridge's attention has no "
            "dropout); supported: 0.0")


def _sliding_window(cfg: Any) -> str | None:
    """HF Qwen2/Qwen3: layer i uses a sliding window when use_sliding_window and
    i >= max_window_layers (transformers records this in `layer_types`)."""
    types = list(field(cfg, "layer_types", []) or [])
    window = field(cfg, "sliding_window")
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if not sliding or window is None:
        return None
    return (f"use_sliding_window={field(cfg, 'use_sliding_window')!r} with "
            f"sliding_window={window} and max_window_layers={field(cfg, 'max_window_layers')} "
            f"gives layers {sliding[0]}..{sliding[-1]} sliding-window attention "
            "(layer_types), which the bridge does not implement; supported: "
            "use_sliding_window=false, or max_window_layers >= num_hidden_layers")


def layer_kinds_problem(kinds: list[str], layers: int, allowed: tuple[str, ...]) -> str | None:
    """None when `kinds` (a config's layer_types) has one entry per layer (`layers`), each
    one of `allowed`; else the sentence refusing it (hybrid families: Qwen3.5, gpt-oss)."""
    other = sorted({k for k in kinds if k not in allowed})
    if len(kinds) == layers and not other:
        return None
    return (f"layer_types={kinds!r} is not supported: one entry per layer "
            f"(num_hidden_layers={layers}) from {', '.join(allowed)}")


ROPE = FieldRule("rope_parameters.rope_type / rope_scaling.rope_type (rope_theta anywhere)",
                 "default, linear, llama3 (any factor/low_freq_factor/high_freq_factor/"
                 "original_max_position_embeddings), yarn (any parameters): transformers' "
                 "inverse frequencies installed in megatron, attention_factor folded into the "
                 "softmax scale; refused: dynamic, longrope, others", _rope_type)
PARTIAL_ROTARY = FieldRule("partial_rotary_factor (top level or in rope_parameters)",
                           "1.0; refused: anything else", _partial_rotary)
HIDDEN_ACT = FieldRule("hidden_act", f"{', '.join(ACTIVATIONS)} -> the same torch function "
                       "in the gated MLP; refused: others", _hidden_act)
ATTENTION_DROPOUT = FieldRule("attention_dropout", "0.0; refused: anything else",
                              _attention_dropout)
HEAD_DIM = FieldRule("head_dim", "any (default hidden_size // num_attention_heads) -> "
                     "kv_channels")
NORM = FieldRule("rms_norm_eps (norm type: RMSNorm, fixed by the architecture)",
                 "any -> layernorm_epsilon of every RMSNorm (q/k norms included)")
TIE = FieldRule("tie_word_embeddings", "true/false -> share_embeddings_and_output_weights")
SLIDING_WINDOW = FieldRule("use_sliding_window / sliding_window / max_window_layers "
                           "(layer_types)", "no layer with sliding-window attention; refused: "
                           "any sliding layer", _sliding_window)

COMMON_FIELDS = (ROPE, PARTIAL_ROTARY, HIDDEN_ACT, ATTENTION_DROPOUT, HEAD_DIM, NORM, TIE)


# ---- conditional-generation wrappers (models.hf.conditional) and their M-RoPE text models ----

def _mrope(cfg: Any) -> str | None:
    params = rope_parameters(cfg)
    kind = params.get("rope_type", params.get("type", "default"))
    factor = float(params.get("partial_rotary_factor", 1.0))
    rotary = head_dim(cfg) * factor
    if kind == "default" and rotary == int(rotary) and int(rotary) % 2 == 0 and rotary > 0:
        return None
    return (f"rope_parameters rope_type={kind!r} with partial_rotary_factor={factor!r} is not "
            "supported; supported: rope_type 'default' with head_dim x partial_rotary_factor "
            "a positive even integer")


MROPE = FieldRule(
    "rope_parameters / rope_scaling (rope_type, rope_theta, partial_rotary_factor, "
    "mrope_section, mrope_interleaved)", "rope_type default, any rope_theta -> rotary_base, "
    "partial_rotary_factor -> rotary_percent (the first head_dim x factor dimensions rotate); "
    "mrope_section -> interleaved M-RoPE over (temporal, height, width) positions "
    "(models.vision.rope; transformers interleaves whatever mrope_interleaved says): text "
    "tokens carry one position in all three, which is 1-D RoPE; refused: other rope types",
    _mrope)


def wrapper_problem(config: Any) -> str | None:
    """Why the wrapper fields of a view do not map exactly (None: they do, or not a view): a
    missing `text_config`; a top-level `quantization_config` (quantized wrappers are not
    built)."""
    original = original_config(config)
    if original is None:
        return None
    kind = original.get("model_type")
    if not isinstance(original.get("text_config"), dict):
        return (f"text_config is missing in a model_type={kind!r} config.json; the text "
                "model's fields are read from it")
    if original.get("quantization_config") is not None:
        return (f"quantization_config in a model_type={kind!r} (conditional-generation) "
                "config.json is not supported; supported: unquantized weights")
    return None


WRAPPER = FieldRule(
    "conditional-generation checkpoints: text_config, tie_word_embeddings, vision_config, "
    "image_token_id, video_token_id, vision_start_token_id, vision_end_token_id, "
    "quantization_config (top level)",
    "read as the text model (models.hf.conditional.text_view): text_config -> this table, "
    "the top-level tie_word_embeddings -> tie_word_embeddings (transformers' "
    "ForConditionalGeneration ties by it); vision_config -> the vision tower, image_token_id "
    "-> where image features go (models.vision, docs/vlm.md); video_token_id acts on video "
    "input only, which is not built; refused: a missing text_config, a top-level "
    "quantization_config", wrapper_problem)


def _no_attention_bias(cfg: Any) -> str | None:
    if not field(cfg, "attention_bias", False):
        return None
    return "attention_bias=true is not supported; supported: false"


NO_ATTENTION_BIAS = FieldRule("attention_bias", "false; refused: true (the published models "
                              "have none)", _no_attention_bias)

# The fields a wrapper's table names: all of them go through its text model's table.
WRAPPED_TEXT_FIELDS = ("every field through the text model's table (text_config: "
                       "rope_parameters, rope_scaling, rope_theta, partial_rotary_factor, "
                       "hidden_act, head_dim, rms_norm_eps, attention_bias, attention_dropout); "
                       "the top-level tie_word_embeddings")


def viewed_as(text_model_type: str) -> tuple[FieldRule, ...]:
    """The field table of a conditional-generation wrapper's own model_type, read as
    `text_model_type` (models.hf.conditional): one row, refusing a config not read through
    the view."""
    return (FieldRule(f"model_type ({WRAPPED_TEXT_FIELDS})",
                      f"read as {text_model_type} (models.hf.conditional)", not_viewed),)


def not_viewed(cfg: Any) -> str | None:
    """The refusal of a wrapper's config.json that reached the bridge without its text view."""
    return (f"model_type={field(cfg, 'model_type')!r}: a conditional-generation config.json is "
            "read as its text model (models.hf.conditional.text_view, applied by "
            "models.hf.io.read_config and models.bridge.checkpoint.read_hf_config); this config was "
            "not")
