"""`model.shape` presets of the Qwen3.5 text models (models.families.qwen3_5.family): the `text_config`
of the published Qwen/Qwen3.5-9B, Qwen3.5-35B-A3B and Qwen3.5-122B-A10B config.json files,
as a text model (model_type qwen3_5_text / qwen3_5_moe_text, the config a conditional
checkpoint is read as: models.hf.conditional).

WRITTEN FROM THE PUBLISHED MODEL CARDS AND CONFIGS AS KNOWN, NOT DOWNLOADED (nothing may be
downloaded here); docs/qwen3_5.md lists which values are least certain. The recipes validate
against them; `--validate` with `model.hf_path` compares a real config.json against the preset
(models.families.presets.shape_mismatches) and names any difference. Only text-model fields are kept:
the vision tower and the conditional wrapper do not change the text model's counts.
"""
from __future__ import annotations

from models.families.base import wrapper_view


def _layer_types(layers: int) -> list[str]:
    """Three Gated DeltaNet layers per full-attention layer (full_attention_interval 4)."""
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]


def _text(model_type: str, hf_class: str, layers: int, hidden: int, heads: int, kv_heads: int,
          value_heads: int, **extra) -> dict:
    return dict(
        model_type=model_type, architectures=[hf_class], vocab_size=248320, hidden_size=hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=256, hidden_act="silu", attention_bias=False, attention_dropout=0.0,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=value_heads,
        layer_types=_layer_types(layers), full_attention_interval=4,
        max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000000,
                             partial_rotary_factor=0.25, mrope_section=[11, 11, 10],
                             mrope_interleaved=True),
        initializer_range=0.02, eos_token_id=248044, use_cache=True,
        mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False, **extra)


def _moe(layers: int, hidden: int, heads: int, value_heads: int, width: int) -> dict:
    return _text("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", layers, hidden, heads, 2,
                 value_heads, num_experts=256, num_experts_per_tok=8,
                 moe_intermediate_size=width, shared_expert_intermediate_size=width,
                 router_aux_loss_coef=0.001, output_router_logits=False)


DENSE_PRESETS = {
    "qwen3.5-9b": _text("qwen3_5_text", "Qwen3_5ForCausalLM", 32, 4096, 16, 4, 32,
                        intermediate_size=12288),
}
MOE_PRESETS = {
    "qwen3.5-35b-a3b": _moe(40, 2048, 16, 32, 512),
    "qwen3.5-122b-a10b": _moe(48, 3072, 32, 64, 1024),
}


# The published Qwen3.5-35B-A3B as the engines read it: the text view of its wrapper config
# (models.families.base.wrapper_view) with the vision tower, for recipes with images.
_VISION = dict(model_type="qwen3_5_moe", depth=27, hidden_size=1152, intermediate_size=4304,
               num_heads=16, in_channels=3, patch_size=16, spatial_merge_size=2,
               temporal_patch_size=2, num_position_embeddings=2304,
               hidden_act="gelu_pytorch_tanh")


def published_view(name: str, text: dict, model_type: str, hf_class: str) -> dict:
    """The text view of the conditional-generation config.json around `text`."""
    wrapper = dict(model_type=model_type, architectures=[hf_class],
                   text_config=dict(text, architectures=None),
                   vision_config=dict(_VISION, model_type=model_type,
                                      out_hidden_size=text["hidden_size"]),
                   image_token_id=248056, video_token_id=248057, vision_start_token_id=248053,
                   vision_end_token_id=248054, tie_word_embeddings=False)
    return {name: wrapper_view(wrapper, text["model_type"])}


MOE_PRESETS.update(published_view("qwen3.5-35b-a3b-vl", MOE_PRESETS["qwen3.5-35b-a3b"],
                                  "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration"))
