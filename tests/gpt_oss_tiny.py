"""A tiny random gpt-oss model built with transformers' own GptOssConfig (no downloads), and
its MXFP4 form as published (experts as *_blocks + *_scales).

4 layers [sliding, full, sliding, full] with sliding_window 8 (the test sequences are 6..70
tokens, so windows cut), 8 query heads and 2 KV heads of 16 (TP2 x CP2 divides them), q/k/v/o
biases, random sinks, YaRN (factor 4 over 64 positions: attention factor 1.139), 4 experts of
width 32, top-2, random router and expert biases, swiglu_limit 2 (the published 7 would rarely
clamp at this scale: here both halves of the clamp are hit). Hidden 64 and width 32 are
multiples of MXFP4's 32-value groups."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tools.tiny_models import build_tokenizer, save_random_model

CONFIG = dict(vocab_size=200, hidden_size=64, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, head_dim=16, intermediate_size=32, num_local_experts=4,
              num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256,
              rms_norm_eps=1e-5, swiglu_limit=2.0, attention_bias=True,
              tie_word_embeddings=False, pad_token_id=0, eos_token_id=3, bos_token_id=None,
              initializer_range=0.2, router_aux_loss_coef=0.9, output_router_logits=False,
              rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0,
                                   beta_fast=32.0, beta_slow=1.0, truncate=False,
                                   original_max_position_embeddings=64))
# Norm weights around 1, every bias and the sinks visible (HF initialises biases to zero),
# router logits spread. Suffix -> standard deviation; the first match wins.
_SCALES = {"sinks": 0.5, "router.bias": 0.5, "router.weight": 0.3, "bias": 0.1}


def build_gpt_oss(out_dir: str, seed: int = 0, tokenizer: bool = True, **extra) -> str:
    """Save a tiny GptOssForCausalLM (fp32 safetensors) to `out_dir`; return it."""
    from transformers import GptOssConfig

    config = GptOssConfig(**dict(CONFIG, **extra))
    config.architectures = ["GptOssForCausalLM"]
    save_random_model(out_dir, config, seed, scales=_SCALES)
    if tokenizer:
        build_tokenizer(out_dir, config.vocab_size)
    return out_dir


def quantize_experts(src_dir: str, out_dir: str) -> tuple[str, str]:
    """The MXFP4 form of a tiny gpt-oss folder, and its reference.

    `out_dir/mxfp4`: every layer's gate_up_proj / down_proj stored as *_blocks + *_scales
    (models.formats.mxfp4.quantize, the published layout) and quantization_config mxfp4 as published;
    every other tensor as in `src_dir`. `out_dir/reference`: the same model unquantized, its
    experts dequantized by transformers' own convert_moe_packed_tensors (fp32)."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from models.formats.mxfp4 import quantize

    tensors = load_file(str(Path(src_dir) / "model.safetensors"))
    config = json.loads((Path(src_dir) / "config.json").read_text())
    quantized, reference = {}, {}
    for name, tensor in tensors.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            blocks, scales = quantize(tensor)
            quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
            reference[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            quantized[name] = reference[name] = tensor
    paths = []
    for kind, weights, cfg in (
            ("mxfp4", quantized, dict(config, quantization_config={
                "modules_to_not_convert": ["model.layers.*.self_attn",
                                           "model.layers.*.mlp.router", "model.embed_tokens",
                                           "lm_head"], "quant_method": "mxfp4"})),
            ("reference", reference, config)):
        path = Path(out_dir) / kind
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in weights.items()},
                  str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
        for f in Path(src_dir).iterdir():
            if f.name not in ("model.safetensors", "config.json") and f.is_file():
                (path / f.name).write_bytes(f.read_bytes())
        paths.append(str(path))
    return paths[0], paths[1]
