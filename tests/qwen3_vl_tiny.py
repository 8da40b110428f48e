"""A tiny random Qwen3-VL (Qwen3VLForConditionalGeneration) made for images, built with
transformers' own config classes (no downloads): 4 decoder layers of Qwen3's kind with 32-dim
heads (16 RoPE frequencies, mrope_section [6, 5, 5]), a three-block vision tower on 4-pixel
patches merged 2 x 2 whose blocks 0 and 1 feed deepstack features into decoder layers 0 and 1
(both on the first stage at PP2), the vision tokenizer (last four ids) and the PIL image
processor."""
from __future__ import annotations

import os

import torch

from tools.tiny_models import build_tokenizer

TEXT = dict(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
            max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0,
            eos_token_id=3, bos_token_id=None,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[6, 5, 5],
                                 mrope_interleaved=True))
VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64,
              num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
PROCESSOR = dict(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=8 * 8,
                 max_pixels=32 * 32)


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           decoder_sparse_step=1, mlp_only_layers=[])


def build_qwen3_vl(out_dir: str, seed: int = 0, moe: bool = False) -> str:
    """Save the tiny Qwen3VLForConditionalGeneration (moe: Qwen3VLMoeForConditionalGeneration,
    4 experts of width 16, top-2, every layer sparse, its fused experts written as Qwen
    publishes them: gate_up_proj [E, H, 2I], down_proj [E, I, H], the transpose of what
    transformers 5 holds and saves) to `out_dir`; return it."""
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)
    from transformers.models.qwen3_vl import Qwen3VLConfig
    from transformers.models.qwen3_vl_moe import Qwen3VLMoeConfig

    os.makedirs(out_dir, exist_ok=True)
    vocab = TEXT["vocab_size"]
    config = (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(
        text_config=dict(TEXT, **(MOE if moe else {})), vision_config=VISION,
        tie_word_embeddings=False, vision_start_token_id=vocab - 4, vision_end_token_id=vocab - 3,
        image_token_id=vocab - 2, video_token_id=vocab - 1)
    config.architectures = [("Qwen3VLMoeForConditionalGeneration" if moe
                             else "Qwen3VLForConditionalGeneration")]
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():   # non-trivial norms and position grid
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):   # the router: not all ties
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(out_dir, safe_serialization=True)
    if moe:
        _publish_experts(os.path.join(out_dir, "model.safetensors"))
    build_tokenizer(out_dir, vocab, vision=True)
    Qwen2VLImageProcessorPil(**PROCESSOR).save_pretrained(out_dir)
    return out_dir


def _publish_experts(path: str) -> None:
    """Transpose the fused experts of a transformers-saved file to the published layout
    (transformers' own loader transposes them back: its qwen3_vl_moe conversion mapping)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith(("mlp.experts.gate_up_proj",
                                                   "mlp.experts.down_proj"))]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
