"""Config-field rows of the DeepSeek-V3 table (models.families.deepseek_v3.family) besides the shared
routing rows (models.families.sigmoid_routed.ROUTING_FIELDS). Each check receives a transformers
config object and returns None when the value maps exactly, else one sentence naming the field,
its value and what is supported."""
from __future__ import annotations

from typing import Any

from models.families.base import FieldRule, field
from models.families.fields import (ATTENTION_DROPOUT, HIDDEN_ACT, PARTIAL_ROTARY, ROPE, TIE,
                                    rope_parameters)
from models.families.sigmoid_routed import MTP_LAYERS
from models.formats.quantized import quant_method, quantization_problem


def _positive(name: str, even: bool = False):
    def check(cfg: Any) -> str | None:
        value = field(cfg, name)
        if isinstance(value, int) and value >= 1 and (not even or value % 2 == 0):
            return None
        kind = "a positive even integer" if even else "a positive integer"
        return f"{name}={value!r} is not supported; supported: {kind}"
    return check


def _q_lora_rank(cfg: Any) -> str | None:
    rank = field(cfg, "q_lora_rank")
    if rank is None or (isinstance(rank, int) and rank >= 1):
        return None
    return f"q_lora_rank={rank!r} is not supported; supported: null (q_proj) or >= 1"


def _kv_heads(cfg: Any) -> str | None:
    heads = field(cfg, "num_attention_heads")
    kv = field(cfg, "num_key_value_heads", heads)
    if kv == heads:
        return None
    return (f"num_key_value_heads={kv} is not supported: HF's MLA builds keys and values for "
            f"all num_attention_heads={heads} heads (kv_b_proj) and its attention then expects "
            "as many; supported: num_key_value_heads = num_attention_heads")


def _attention_bias(cfg: Any) -> str | None:
    if not field(cfg, "attention_bias", False):
        return None
    return ("attention_bias=true is not supported: megatron's MLA down projections "
            "(q_a_proj, kv_a_proj_with_mqa) have no bias; supported: false")


def _rope_mscale(cfg: Any) -> str | None:
    params = rope_parameters(cfg)
    if params.get("rope_type", "default") == "default" or not params.get("mscale_all_dim"):
        return None
    if params.get("factor") is None:
        return (f"rope_parameters mscale_all_dim={params['mscale_all_dim']!r} without a "
                "factor is not supported (HF's softmax scale needs it); supported: a factor")
    return None


def _quantization(cfg: Any) -> str | None:
    method = quant_method(cfg)
    if method not in (None, "fp8"):
        return (f"quantization_config.quant_method={method!r} is not supported for "
                "deepseek_v3; supported: none, fp8 (the published block-scaled weights)")
    return quantization_problem(cfg)


def _moe_layer_freq(cfg: Any) -> str | None:
    freq = field(cfg, "moe_layer_freq", 1)
    if freq == 1:
        return None
    return (f"moe_layer_freq={freq!r} is not supported: transformers ignores it (every layer "
            "from first_k_dense_replace on is MoE), DeepSeek's own code would not; "
            "supported: 1")


DEEPSEEK_FIELDS = (
    ROPE, PARTIAL_ROTARY, HIDDEN_ACT, ATTENTION_DROPOUT, TIE,
    FieldRule("rope_parameters mscale / mscale_all_dim (rope_scaling, YaRN)", "any: "
              "transformers' attention_factor multiplies cos/sin of the rope dims "
              "(models.layers.mla.module.HFRotary); the softmax scale is qk_head_dim^-0.5 x "
              "mscale(factor, mscale_all_dim)^2 as HF (models.layers.mla.module.hf_softmax_scale)",
              _rope_mscale),
    FieldRule("rope_interleave", "true (default) -> megatron MLA's pairwise RoPE, weights as "
              "stored; false -> the same with the rope rows of q_b_proj / q_proj and "
              "kv_a_proj_with_mqa permuted on load and back on export (models.layers.mla.mapping)"),
    FieldRule("q_lora_rank", "null -> linear_q_proj (q_proj); >= 1 -> q_lora_rank "
              "(q_a_proj, q_a_layernorm, q_b_proj)", _q_lora_rank),
    FieldRule("kv_lora_rank", ">= 1 -> kv_lora_rank", _positive("kv_lora_rank")),
    FieldRule("qk_nope_head_dim", ">= 1 -> qk_head_dim", _positive("qk_nope_head_dim")),
    FieldRule("qk_rope_head_dim", "even, >= 2 -> qk_pos_emb_head_dim",
              _positive("qk_rope_head_dim", even=True)),
    FieldRule("v_head_dim", ">= 1 -> v_head_dim (and kv_channels)", _positive("v_head_dim")),
    FieldRule("head_dim / qk_head_dim", "ignored: transformers recomputes them "
              "(qk_rope_head_dim, qk_nope_head_dim + qk_rope_head_dim)"),
    FieldRule("num_key_value_heads", "= num_attention_heads (MLA has one key/value per "
              "head); refused: others", _kv_heads),
    FieldRule("attention_bias", "false; refused: true", _attention_bias),
    FieldRule("rms_norm_eps", "any -> layernorm_epsilon of the layer and final norms; the "
              "latent norms q_a_layernorm / kv_a_layernorm use 1e-6 as HF builds them"),
    FieldRule("intermediate_size", "any -> ffn_hidden_size of the dense layers"),
    FieldRule("moe_layer_freq (original config.json)", "1; refused: others",
              _moe_layer_freq),
    MTP_LAYERS,
    FieldRule("quantization_config", "absent, or quant_method fp8 (fmt e4m3, dynamic "
              "activations, fp32 scales, any weight_block_size) -> dequantized exactly on load "
              "(models.formats.fp8); refused: other methods and values", _quantization),
    FieldRule("aux_loss_alpha / seq_aux (original config.json)", "training only, not in "
              "transformers' forward: moe.aux_loss_coeff defaults to 0"),
    FieldRule("ep_size / pretraining_tp", "no effect in transformers (a layout hint; unused)"),
    FieldRule("max_position_embeddings", "any -> max_sequence_length (YaRN's own original "
              "length comes from rope_parameters)"),
    FieldRule("initializer_range / use_cache / pad_token_id / bos_token_id / eos_token_id",
              "no effect on the forward pass"),
)
