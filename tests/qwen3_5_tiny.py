"""Tiny random Qwen3.5 text models (dense and MoE) built with transformers' own config classes
(no downloads): 4 layers [GDN, GDN, GDN, attention] (full_attention_interval 4), 4 GDN key
heads and 8 value heads (TP2 x CP2 divides both), partial RoPE 0.25, zero-centred norms with
random weights, random A_log / dt_bias / routers, and the tests' word-level tokenizer."""
from __future__ import annotations

import os
import tempfile

import torch

from tools.tiny_models import build_tokenizer

COMMON = dict(vocab_size=200, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_key_heads=4,
              linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_conv_kernel_dim=4, max_position_embeddings=512, rms_norm_eps=1e-6,
              tie_word_embeddings=False, pad_token_id=0, eos_token_id=3, bos_token_id=None,
              rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                   partial_rotary_factor=0.25))
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48)


def build_qwen3_5(out_dir: str, moe: bool = False, seed: int = 0, tokenizer: bool = True,
                  mtp: str | None = None, **extra) -> str:
    """Save a tiny Qwen3_5ForCausalLM (moe: Qwen3_5MoeForCausalLM) to `out_dir`; return it.
    `mtp="full"`: with a complete MTP layer as published checkpoints store it (`append_mtp`)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    os.makedirs(out_dir, exist_ok=True)
    values = dict(COMMON, **(MOE if moe else dict(intermediate_size=128)), **extra)
    config = (Qwen3_5MoeTextConfig if moe else Qwen3_5TextConfig)(**values)
    config.architectures = ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model)
    model.save_pretrained(out_dir, safe_serialization=True)
    if mtp == "full":
        append_mtp(out_dir, config, seed)
    if tokenizer:
        build_tokenizer(out_dir, values["vocab_size"])
    return out_dir


def append_mtp(out_dir: str, config, seed: int, sharp: bool = False) -> None:
    """Add a complete MTP layer in Qwen3.5's layout (vLLM's qwen3_5_mtp) to `out_dir`:
    `mtp.layers.0.*` (a random full-attention decoder layer with the model's MLP, built by
    transformers for `config` with one more layer), `mtp.fc.weight` [h, 2h] and the zero-centred
    `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden` and `mtp.norm` (random offsets from
    one), fp32; and `mtp_num_hidden_layers: 1`, `mtp_use_dedicated_embeddings: false` in
    config.json (in its text_config for a conditional-generation wrapper). `config`: the text
    model's config. `sharp`: the layer's q/k norm weights near 3 (1 + w with w ~ 2): attention
    logits ~9x larger, so that the layer's output depends clearly on its positions (a random
    layer's near-uniform attention hides them)."""
    import copy
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    layers, hidden = int(config.num_hidden_layers), int(config.hidden_size)
    deeper = copy.deepcopy(config)
    deeper.num_hidden_layers = layers + 1
    deeper.layer_types = list(config.layer_types) + ["full_attention"]
    torch.manual_seed(seed + 7)
    model = AutoModelForCausalLM.from_config(deeper, dtype=torch.float32)
    _randomize(model)
    head = f"model.layers.{layers}."
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        extra = {"mtp.layers.0." + k[len(head):]: v
                 for k, v in load_file(os.path.join(tmp, "model.safetensors")).items()
                 if k.startswith(head)}
    if sharp:
        for name in ("q_norm", "k_norm"):
            extra[f"mtp.layers.0.self_attn.{name}.weight"] += 2.0
    gen = torch.Generator().manual_seed(seed + 11)
    extra.update({
        "mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=gen) * (2 * hidden) ** -0.5,
        **{f"mtp.{n}.weight": 0.1 * torch.randn(hidden, generator=gen)
           for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}})
    path = os.path.join(out_dir, "model.safetensors")
    save_file({**load_file(path), **extra}, path, metadata={"format": "pt"})
    config_path = os.path.join(out_dir, "config.json")
    with open(config_path) as f:
        values = json.load(f)
    fields = dict(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    (values["text_config"] if "text_config" in values else values).update(fields)
    with open(config_path, "w") as f:
        json.dump(values, f, indent=2)


def _randomize(model) -> None:
    """Non-trivial values where transformers' init is constant (norms, GDN decay, routers)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(1, 8)))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif "norm" in name and "visual" not in name:
                base = 1.0 if name.endswith("linear_attn.norm.weight") else 0.0
                p.copy_(base + 0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith("shared_expert_gate.weight"):
                p.copy_(0.2 * torch.randn_like(p))


VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64,
              num_position_embeddings=16)
# MTP tensors as the published checkpoints store them (transformers drops mtp.* on load)
MTP_TENSORS = {"mtp.fc.weight": ((64, 128), torch.float32),
               "mtp.layers.0.input_layernorm.weight": ((64,), torch.bfloat16),
               "mtp.norm.weight": ((64,), torch.float32)}


def build_qwen3_5_conditional(out_dir: str, moe: bool = False, seed: int = 0,
                              tie: bool = False) -> str:
    """Save a tiny Qwen3_5ForConditionalGeneration (moe: Qwen3_5MoeForConditionalGeneration)
    as published: the text model above under model.language_model.*, a one-block vision tower
    model.visual.*, and MTP_TENSORS added to its safetensors (one in bf16); `tie`: tied
    embeddings (top level and text_config, as Qwen3.5-0.8B; no lm_head.weight). Returns it."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen3_5 import Qwen3_5Config
    from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig

    os.makedirs(out_dir, exist_ok=True)
    text = dict(COMMON, **(MOE if moe else dict(intermediate_size=128)), tie_word_embeddings=tie)
    config = (Qwen3_5MoeConfig if moe else Qwen3_5Config)(text_config=text, vision_config=VISION,
                                                          tie_word_embeddings=tie)
    config.architectures = [("Qwen3_5MoeForConditionalGeneration" if moe
                             else "Qwen3_5ForConditionalGeneration")]
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    _randomize(model)
    model.save_pretrained(out_dir, safe_serialization=True)
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, (shape, dtype) in MTP_TENSORS.items():
        tensors[name] = torch.randn(shape, generator=gen).to(dtype)
    save_file(tensors, path, metadata={"format": "pt"})
    build_tokenizer(out_dir, text["vocab_size"])
    return out_dir


# A conditional model that takes images (models.vision): text heads of 32 dims with half of
# each rotated (8 frequencies, so M-RoPE's temporal, height and width sections all carry some:
# mrope_section [3, 3, 2]); a two-block vision tower of width 32 on 4-pixel patches, merged
# 2 x 2 (a 16 x 16 image is 4 tokens); the tokenizer's last four ids are the vision tokens.
VL_TEXT = dict(COMMON, intermediate_size=128, head_dim=32,
               rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                    partial_rotary_factor=0.5, mrope_section=[3, 3, 2],
                                    mrope_interleaved=True))
VL_VISION = dict(VISION, depth=2, hidden_size=32, intermediate_size=64, num_heads=2)
VL_PROCESSOR = dict(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=8 * 8,
                    max_pixels=32 * 32)


def build_qwen3_5_vl(out_dir: str, moe: bool = False, seed: int = 0,
                     mtp: str | None = None) -> str:
    """Save a tiny Qwen3_5ForConditionalGeneration (moe: the MoE one) made for images:
    VL_TEXT / VL_VISION, the vision tokenizer (tools.tiny_models.build_tokenizer(vision=True))
    and transformers' PIL image processor with VL_PROCESSOR (preprocessor_config.json).
    `mtp="full"`: with a complete MTP layer (`append_mtp`, its fields in text_config as the
    published checkpoints hold them)."""
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)
    from transformers.models.qwen3_5 import Qwen3_5Config
    from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig

    os.makedirs(out_dir, exist_ok=True)
    vocab = VL_TEXT["vocab_size"]
    ids = dict(vision_start_token_id=vocab - 4, vision_end_token_id=vocab - 3,
               image_token_id=vocab - 2, video_token_id=vocab - 1)
    text = dict(VL_TEXT, **(MOE if moe else {}))
    config = (Qwen3_5MoeConfig if moe else Qwen3_5Config)(
        text_config=text, vision_config=VL_VISION, tie_word_embeddings=False, **ids)
    config.architectures = [("Qwen3_5MoeForConditionalGeneration" if moe
                             else "Qwen3_5ForConditionalGeneration")]
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    _randomize(model)
    with torch.no_grad():   # non-trivial vision norms and position grid
        for name, p in model.named_parameters():
            if "visual" in name and "norm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir, safe_serialization=True)
    if mtp == "full":
        append_mtp(out_dir, model.config.text_config, seed, sharp=True)
    build_tokenizer(out_dir, vocab, vision=True)
    Qwen2VLImageProcessorPil(**VL_PROCESSOR).save_pretrained(out_dir)
    return out_dir


def write_png(path, h: int, w: int, seed: int):
    """A random RGB PNG of h x w pixels at `path` (an image for the VL models above; at their
    4-pixel patches merged 2 x 2, 16 x 16 pixels are 4 image tokens). Returns `path`."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")).save(path)
    return path
