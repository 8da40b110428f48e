"""Tiny random DeepSeek-V3 models (DeepseekV3ForCausalLM) built with transformers' own config
class (no downloads): 2 layers (layer 0 dense, layer 1 MoE: PP2 puts one on each stage), 4 heads,
MLA with q_lora_rank 32 (or null: q_proj), kv_lora_rank 16, nope/rope/v head dims 16/8/12; YaRN
(factor 4, mscale 1.0, mscale_all_dim 0.8: both the cos/sin factor and the softmax scale differ
from 1); 8 routed experts in 4 groups (2 kept, top-4: grouped routing exercised), one shared
expert, routed scaling 2.5, a random score-correction bias large enough to change the choice;
one MTP layer `model.layers.2.*` (a few tensors) that must pass through; the tests' word-level
tokenizer.

`build_fp8` turns such a folder into the published FP8 layout: every 2-D linear weight of the
decoder layers and of the MTP layer (not embeddings, lm_head, norms or routers) quantized to
float8_e4m3fn with fp32 `weight_scale_inv` blocks (block 16 x 16 here, so the tiny weights have
several blocks and ragged edges), `quantization_config` fp8; `dequantized_reference` is the
same folder with every FP8 weight replaced by fp8 x scale in fp32 (the reference HF loads).
"""
from __future__ import annotations

import json
import os
import shutil

import torch

from tools.tiny_models import append_full_mtp_layer, append_mtp_layer, build_tokenizer, save_random_model

CONFIG = dict(vocab_size=200, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
              q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=12, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
              n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
              norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=256,
              rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                   mscale=1.0, mscale_all_dim=0.8,
                                   original_max_position_embeddings=64),
              num_nextn_predict_layers=1, tie_word_embeddings=False, pad_token_id=0,
              eos_token_id=3, bos_token_id=None, initializer_range=0.2)
FP8_BLOCK = [16, 16]


def build_deepseek_v3(out_dir: str, seed: int = 0, tokenizer: bool = True,
                      mtp: bool | str = True, **extra) -> str:
    """Save a tiny DeepseekV3ForCausalLM (fp32 safetensors) to `out_dir`; return it. `mtp`:
    True: the few pass-through MTP tensors above; "full": a complete MTP layer
    (tools.tiny_models.append_full_mtp_layer); False: none."""
    from transformers.models.deepseek_v3 import DeepseekV3Config

    values = dict(CONFIG, **extra)
    if not mtp:
        values["num_nextn_predict_layers"] = 0
    config = DeepseekV3Config(**values)
    config.architectures = ["DeepseekV3ForCausalLM"]
    save_random_model(out_dir, config, seed, buffer_scales={"e_score_correction_bias": 0.3})
    if mtp == "full":
        append_full_mtp_layer(out_dir, config, seed)
    elif mtp:
        append_mtp_layer(out_dir, values, seed, "self_attn.kv_b_proj.weight",
                         (values["hidden_size"], 16))
    if tokenizer:
        build_tokenizer(out_dir, values["vocab_size"])
    return out_dir


def is_fp8_weight(name: str, tensor: torch.Tensor) -> bool:
    """The tensors DeepSeek-V3 publishes in FP8: 2-D linear weights of the decoder and MTP
    layers, not the embeddings, lm_head, norms, routers or the MTP's own projections."""
    return (name.startswith("model.layers.") and name.endswith("proj.weight")
            and tensor.dim() == 2 and ".mlp.gate." not in name and "eh_proj" not in name)


def build_fp8(src_dir: str, out_dir: str, block: list[int] = FP8_BLOCK) -> str:
    """A copy of the folder `src_dir` in the published FP8 layout (module docstring)."""
    from safetensors.torch import load_file, save_file

    from models.formats.fp8 import quantize

    shutil.copytree(src_dir, out_dir, dirs_exist_ok=True)
    tensors = load_file(os.path.join(src_dir, "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if is_fp8_weight(name, t):
            q, scale = quantize(t, tuple(block))
            out[name], out[name + "_scale_inv"] = q, scale
        else:
            out[name] = t.to(torch.bfloat16) if t.dim() >= 1 and "bias" not in name else t
    save_file(out, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg_path = os.path.join(out_dir, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3",
                                  "quant_method": "fp8", "weight_block_size": list(block)}
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return out_dir


def dequantized_reference(fp8_dir: str, out_dir: str) -> str:
    """The FP8 folder with every FP8 weight as fp8 x scale (fp32) and no quantization_config:
    what transformers loads as the reference (MTP tensors dropped: HF never runs them)."""
    from safetensors.torch import load_file, save_file

    from models.formats.fp8 import dequantize

    shutil.copytree(fp8_dir, out_dir, dirs_exist_ok=True)
    cfg = json.load(open(os.path.join(fp8_dir, "config.json")))
    block = tuple(cfg.pop("quantization_config")["weight_block_size"])
    layers = cfg["num_hidden_layers"]
    tensors = load_file(os.path.join(fp8_dir, "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv") or name.startswith(f"model.layers.{layers}."):
            continue
        scale = tensors.get(name + "_scale_inv")
        out[name] = dequantize(t, scale, block) if scale is not None else t.float()
    save_file(out, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 0
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return out_dir
