"""RoPE inverse frequencies computed by transformers' own functions and installed in megatron.

Megatron's RotaryEmbedding knows only the default frequencies and llama3 scaling with fixed
parameters; transformers defines every rope type. For the static types (default, linear,
llama3, yarn) the frequencies do not depend on the batch, so the bridge computes them once
with `transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS` and replaces megatron's
`rotary_pos_emb.inv_freq`. HF multiplies cos and sin by an `attention_factor` (yarn); the
product q.k then grows by its square, which the bridge folds into the softmax scale.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from models.families.base import head_dim
from models.families.fields import rope_parameters
from models.hf.config import check_config, hf_config_object


@dataclass
class RopeFrequencies:
    inv_freq: torch.Tensor | None   # [head_dim / 2] fp32; None: megatron's default is exact
    attention_factor: float         # HF scales cos and sin by this


def rope_frequencies(hf_config: Any) -> RopeFrequencies:
    """The inverse frequencies and attention factor transformers uses for this config."""
    check_config(hf_config)
    cfg = hf_config_object(hf_config)
    kind = rope_parameters(cfg).get("rope_type", "default")
    if kind == "default":
        return RopeFrequencies(None, 1.0)
    inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    return RopeFrequencies(inv_freq.float(), float(factor))


def rope_theta(hf_config: Any) -> float:
    return float(rope_parameters(hf_config_object(hf_config)).get("rope_theta", 10000.0))


def softmax_scale(hf_config: Any) -> float | None:
    """Megatron's softmax scale: None (1/sqrt(head_dim)) unless HF scales cos/sin."""
    factor = rope_frequencies(hf_config).attention_factor
    if factor == 1.0:
        return None
    return factor * factor / math.sqrt(head_dim(hf_config))


def install_rope(model, hf_config: Any) -> None:
    """Replace the inverse frequencies of a GPTModel chunk's RotaryEmbedding (before its first
    forward: megatron caches the embedding per sequence length)."""
    freqs = rope_frequencies(hf_config)
    if freqs.inv_freq is None:
        return
    rotary = model.rotary_pos_emb
    if tuple(rotary.inv_freq.shape) != tuple(freqs.inv_freq.shape):
        raise ValueError(f"RoPE frequencies: transformers gives {tuple(freqs.inv_freq.shape)}, "
                         f"megatron holds {tuple(rotary.inv_freq.shape)}")
    rotary.inv_freq = freqs.inv_freq.to(rotary.inv_freq.device)
