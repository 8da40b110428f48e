"""`model.shape` presets of Qwen3-VL (models.families.qwen3_vl.family): the published
Qwen/Qwen3-VL-8B-Instruct config.json as the engines read it, its text view (model_type
qwen3_vl_text: the text_config's fields) with the whole wrapper config riding under
models.families.base.ORIGINAL, so `--validate` sees the vision tower too
(models.estimate.vision).

WRITTEN FROM THE PUBLISHED CONFIG AS KNOWN, NOT DOWNLOADED (nothing may be downloaded here):
`--validate` with `model.hf_path` compares a real config.json against the preset's shape
(models.families.presets.shape_mismatches) and names any difference.
"""
from __future__ import annotations

from models.families.base import wrapper_view

_VISION = dict(model_type="qwen3_vl", depth=27, hidden_size=1152, intermediate_size=4304,
               num_heads=16, in_channels=3, patch_size=16, spatial_merge_size=2,
               temporal_patch_size=2, num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh",
               deepstack_visual_indexes=[8, 16, 24])


_TEXT_8B = dict(model_type="qwen3_vl_text", vocab_size=151936, hidden_size=4096,
                intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, hidden_act="silu", attention_bias=False,
                attention_dropout=0.0, max_position_embeddings=262144, rms_norm_eps=1e-6,
                tie_word_embeddings=False,
                rope_parameters=dict(rope_type="default", rope_theta=5000000,
                                     mrope_section=[24, 20, 20], mrope_interleaved=True))
QWEN3_VL_8B = dict(model_type="qwen3_vl", architectures=["Qwen3VLForConditionalGeneration"],
                   text_config=_TEXT_8B, vision_config=dict(_VISION, out_hidden_size=4096),
                   image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                   vision_end_token_id=151653, tie_word_embeddings=False)

PRESETS = {"qwen3-vl-8b": wrapper_view(QWEN3_VL_8B, "qwen3_vl_text")}
