"""Core attention on torch SDPA: the local-spec replacement for megatron's DotProductAttention.

Plugged into the layer spec (`ModuleSpec` extension point). It runs on CPUs and GPUs without
Transformer Engine, handles GQA, causal masking, packed ("thd") sequences and, with context
parallelism, the Ulysses all-to-all of `parallel.ulysses`. Packed rows at CP1 go through torch's
Flash-Attention varlen kernel in one call where `varlen.uses_varlen` says it covers them (CUDA,
fp16/bf16, no learned sinks: models.layers.attention.varlen), else through the per-segment loop
`packed_causal_attention`. A prefix tree's row (parallel.tree_attention.TreeAttentionParams,
train.prefix_sharing) attends each token to its ancestors (`tree_attention`; with sinks or a
sliding window `tree_sink_attention`, the window counted along each token's own row).

Shapes (per TP rank; h = heads/tp, g = kv groups/tp, d = head dim):
  sbhd: query [s, b, h, d], key/value [s, b, g, d]  ->  [s, b, h*d]
  thd:  query [t, h, d],    key/value [t, g, d]     ->  [t, h*d]   (cu_seqlens in packed_seq_params)
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from models.layers.attention.sinks import (Attend, attend_fn, layer_window, make_sinks,
                                      sinks_sharded_state_dict)
from models.layers.attention.varlen import uses_varlen, varlen_packed_attention
from parallel import ulysses
from parallel.packed_seqs import host_cu_seqlens
from parallel.tree_attention import is_tree, tree_attention
from parallel.tree_attention_sinks import tree_sink_attention


def _repeat_kv(x: torch.Tensor, times: int, head_dim_index: int) -> torch.Tensor:
    return x if times == 1 else x.repeat_interleave(times, dim=head_dim_index)


def causal_attention_bhsd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """Causal SDPA on [b, h, s, d] tensors; k and v may hold fewer heads than q (GQA: each kv
    head serves h / kv consecutive query heads, SDPA's own `enable_gqa`)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                          enable_gqa=bool(k.shape[1] != q.shape[1]))


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cu_seqlens: torch.Tensor | list[int], scale: float,
                            attend: Attend | None = None) -> torch.Tensor:
    """Causal attention per segment of [t, h, d] tensors; segments never see each other.
    `cu_seqlens`: the boundaries, as host ints (no device read) or a tensor.
    `attend`: sinks / sliding window (models.layers.attention.sinks), else plain causal SDPA."""
    bounds = cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else list(cu_seqlens)
    # the segments' outputs concatenated (positions past the last boundary, padding: zeros),
    # not written into a buffer slice by slice: each slice assignment's backward makes a
    # full-size zero gradient (16 segments x 4 layers: 0.4 s of a 4.7 s CPU GRPO update)
    fill = lambda n: q.new_zeros(n, *q.shape[1:-1], v.shape[-1])  # noqa: E731 (MLA: v's dim)
    parts = [fill(bounds[0])] if bounds and bounds[0] > 0 else []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end <= start:
            continue
        seg = [x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
        seg_out = causal_attention_bhsd(*seg, scale) if attend is None else attend(*seg, 0)
        parts.append(seg_out[0].transpose(0, 1))
    covered = sum(p.shape[0] for p in parts)
    if covered < q.shape[0] or not parts:
        parts.append(fill(q.shape[0] - covered))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


class SDPACoreAttention(MegatronModule):
    """Drop-in core attention (same constructor and forward signature as DotProductAttention)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                 pg_collection=None, k_channels=None, v_channels=None):
        super().__init__(config=config)
        # k_channels / v_channels: query-key and value head dims when they differ (MLA)
        self.head_dim = k_channels or config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(
            self.head_dim)
        self.cp_size = config.context_parallel_size
        # gpt-oss: learned sinks (softmax_type learnable) and sliding windows (window_size)
        self.window_left = layer_window(config, layer_number)
        self.register_parameter("softmax_offset", make_sinks(config))
        # GQA by SDPA itself instead of repeating K/V (set by models.build.compile_layers for
        # compiled layers; off, eager keeps its K/V repeat: the same forward, but K/V gradients
        # summed over each group in another order, so eager stays bitwise as it was)
        self.native_gqa = False
        # packed rows' attention (per-segment loop); a compiled layer never traces it:
        # models.build.compile_layers sends packed rows to this module's eager forward (the
        # loop over the host's segment bounds would be traced into a graph per set of bounds)
        self.packed_attention = packed_causal_attention

    def _kv_repeat(self, query, key, head_dim_index: int) -> int:
        """How many times to repeat each kv head: 1 when SDPA's own GQA will serve them."""
        if self.native_gqa and self._attend() is None:
            return 1
        return query.shape[head_dim_index] // key.shape[head_dim_index]

    def _attend(self) -> Attend | None:
        """The sink / window attention of this layer, or None: plain causal SDPA."""
        if self.window_left is None and self.softmax_offset is None:
            return None
        return attend_fn(self.scale, self.window_left, self.softmax_offset)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        if self.softmax_offset is None:
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return sinks_sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention does not support attention_bias")
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if self.cp_size > 1:
            return ulysses.ulysses_attention(query, key, value, self.scale, packed_seq_params,
                                             attend=self._attend())
        if packed and is_tree(packed_seq_params):   # prefix sharing: ancestors only
            rep = query.shape[1] // key.shape[1]
            key, value = _repeat_kv(key, rep, 1), _repeat_kv(value, rep, 1)
            attend = self._attend()   # sinks / window: parallel.tree_attention_sinks
            out = (tree_attention(query, key, value, packed_seq_params, self.scale)
                   if attend is None else
                   tree_sink_attention(query, key, value, packed_seq_params, attend, 0))
            return out.reshape(out.shape[0], -1)
        if packed:
            if uses_varlen(query, key, value, has_sinks=self.softmax_offset is not None):
                out = varlen_packed_attention(query, key, value,
                                              host_cu_seqlens(packed_seq_params, padded=False),
                                              self.scale, self.window_left,
                                              packed_seq_params.cu_seqlens_q)
                return out.reshape(out.shape[0], -1)
            rep = self._kv_repeat(query, key, 1)
            key, value = _repeat_kv(key, rep, 1), _repeat_kv(value, rep, 1)
            out = self.packed_attention(query, key, value,
                                        host_cu_seqlens(packed_seq_params, padded=False),
                                        self.scale, self._attend())
            return out.reshape(out.shape[0], -1)
        rep = self._kv_repeat(query, key, 2)
        key, value = _repeat_kv(key, rep, 2), _repeat_kv(value, rep, 2)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, h, s, d]
        attend = self._attend()
        out = causal_attention_bhsd(q, k, v, self.scale) if attend is None else attend(q, k, v, 0)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)
