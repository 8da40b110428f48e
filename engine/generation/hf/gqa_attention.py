"""Grouped-query attention without copied keys and values, for the HF backend on a CPU.

transformers' `sdpa` attention (transformers.integrations.sdpa_attention) passes
`enable_gqa=True` to torch's `scaled_dot_product_attention` only when there is no attention
mask, because CUDA's flash and cuDNN kernels take no mask with it. Otherwise it copies every
key/value head `num_attention_heads / num_key_value_heads` times (`repeat_kv`). A left-padded
batch always has a mask, so every decode step copied the whole KV cache of every layer: with
the `tools.bench trl` model (6 query heads over 2 KV heads, 16 rows, ~380 cached positions) the
copy took 3/4 of the attention's time. torch's CPU flash kernel takes a mask and `enable_gqa`
together and reads the shared heads in place: the same output, bitwise (torch 2.13,
tests/test_hf_gqa_attention.py).

`use_cpu_gqa(model)` switches a text model on the CPU from `sdpa` to `ATTENTION`, an
implementation registered through transformers' own AttentionInterface (with `sdpa`'s mask
function under the same name in AttentionMaskInterface). It computes what `sdpa` does (causal
flag, scale, dropout, output layout) with the heads shared instead of copied; every call that
has no grouped heads, is not on the CPU, or carries a keyword `sdpa` handles specially
(a position bias, a paged cache, attention sinks) is passed to transformers' `sdpa` unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "engine_cpu_gqa_sdpa"
# keywords of transformers' sdpa path that change what it computes: those calls go to it
_SDPA_ONLY = ("position_bias", "cache", "s_aux", "sinks")


def gqa_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
             scaling: float | None = None, is_causal: bool | None = None, **kwargs
             ) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature: query [b, heads, q, d], key and value
    [b, kv_heads, k, d], attention_mask [b, 1, q, k] boolean (True: attend) or None.
    Returns ([b, q, heads, d] contiguous, None), as `sdpa` does."""
    grouped = key.shape[1] != query.shape[1]
    if not grouped or query.device.type != "cpu" or any(
            kwargs.get(k) is not None for k in _SDPA_ONLY):
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, is_causal=is_causal,
                                      **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = query.shape[2] > 1 and attention_mask is None and causal
    if causal and key.shape[2] > query.shape[2]:   # an empty static cache's prefill (as sdpa)
        key, value = key[:, :, :query.shape[2]], value[:, :, :query.shape[2]]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                         dropout_p=dropout, scale=scaling, is_causal=causal,
                                         enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, gqa_sdpa)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def use_cpu_gqa(model: torch.nn.Module) -> bool:
    """Switch `model` (a transformers causal LM, already on its device) to ATTENTION when it
    runs `sdpa` on the CPU with grouped KV heads; True when it now runs it. Any other model
    (CUDA, eager or flash attention, no grouped heads, a class that cannot switch) is left as
    it is."""
    config = model.config
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    on_cpu = next(model.parameters()).device.type == "cpu"
    if not (on_cpu and config._attn_implementation == "sdpa" and heads and kv_heads < heads):
        return False
    model.set_attn_implementation(ATTENTION)
    return config._attn_implementation == ATTENTION
