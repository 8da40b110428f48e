"""Attention sinks and sliding windows for the SDPA core attention (models.layers.attention.core),
as gpt-oss uses them: megatron's `softmax_type="learnable"` and `window_size` /
`window_attn_skip_freq`, which megatron's own local DotProductAttention implements only on
CUDA and without packed sequences.

- Sinks: one learned logit per head, `softmax_offset` [heads / tp] (megatron's name; HF
  `self_attn.sinks`). Each query's softmax gets one more column holding the sink logit; the
  column is dropped after the softmax, so the weights of the real keys sum to less than one
  (HF GptOss eager_attention_forward: the same concatenation, max subtraction and softmax).
- Sliding window `window_size=(left, 0)`: query i sees keys i - left .. i (HF's
  sliding_window w is left = w - 1). Positions are those of the tensors handed in: the core
  attention calls `attend` per packed sequence and, under Ulysses CP, on the gathered whole
  sequence in natural order, so a window never reaches into another packed sequence and CP
  gives the unsharded result.

`attend(q, k, v, first_head)` works on [b, h, s, d] tensors whose KV heads are already
repeated; `first_head` is the index, among this TP rank's heads, of the first head given
(Ulysses CP hands each CP rank heads/cp of them), so the matching sink logits are used.
Without a sink and a window it is torch SDPA (the path of every other family, unchanged).
The sink/window path materialises the [b, h, s, s] scores (memory O(s^2) per head).

A prefix tree's row (parallel.tree_attention_sinks, train.prefix_sharing) has no causal order
to count a window along: `attend.masked(q, k, v, first_head, visible)` takes the query-by-key
visibility ([n, m] bool: ancestors, and the window counted by each token's position in its own
row, `window_visible`) and applies the same sinks and softmax.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group,
                                             is_layer_window_attention,
                                             make_sharded_tensors_for_checkpoint)

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def sink_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          window_left: int | None = None,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention on [b, h, s, d] tensors with an optional window (query i sees keys
    i - window_left .. i) and optional sink logits `sinks` [h]."""
    pos = torch.arange(q.shape[2], device=q.device)
    return sink_masked_attention(q, k, v, scale, window_visible(pos, pos, window_left), sinks)


def window_visible(q_pos: torch.Tensor, k_pos: torch.Tensor,
                   window_left: int | None) -> torch.Tensor:
    """[n, m] bool: key position k_pos[j] is visible to query position q_pos[i] (causal, and
    within the window: q - k <= window_left; None: no window)."""
    diff = q_pos[:, None] - k_pos[None, :]
    visible = diff >= 0
    return visible if window_left is None else visible & (diff <= window_left)


def sink_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          visible: torch.Tensor, sinks: torch.Tensor | None = None
                          ) -> torch.Tensor:
    """Attention of [b, h, n, d] queries over [b, h, m, d] keys where `visible` [n, m] is
    True, with optional sink logits `sinks` [h] (HF GptOss eager_attention_forward's
    concatenation, max subtraction and softmax). Every query must see at least one key."""
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(
            q.shape[0], -1, q.shape[2], 1)
        scores = torch.cat([scores, sink], dim=-1)
    scores = scores - scores.max(dim=-1, keepdim=True).values
    probs = F.softmax(scores, dim=-1, dtype=scores.dtype)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def layer_window(config, layer_number: int) -> int | None:
    """Left window size of layer `layer_number` (1-based), or None: full causal attention.
    Only (left, 0) windows exist in causal decoders; anything else is refused."""
    if not is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                     layer_number):
        return None
    left, right = config.window_size
    if right != 0 or left < 0:
        raise ValueError(f"window_size={config.window_size} is not supported by the SDPA core "
                         "attention; supported: (left >= 0, 0)")
    return int(left)


def make_sinks(config) -> torch.nn.Parameter | None:
    """This TP rank's sink logits (softmax_type learnable), or None (vanilla softmax).
    Tagged tensor-parallel along dim 0: each TP rank holds heads/tp of them."""
    if config.softmax_type == "vanilla":
        return None
    if config.softmax_type != "learnable":
        raise ValueError(f"softmax_type={config.softmax_type!r} is not supported by the SDPA "
                         "core attention; supported: vanilla, learnable")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    param = torch.nn.Parameter(torch.zeros(config.num_attention_heads // tp,
                                           dtype=config.params_dtype))
    set_tensor_model_parallel_attributes(param, True, 0, 1)
    return param


class SinkWindowAttend:
    """`attend(q, k, v, first_head)` for one layer (module docstring), and `masked` for rows
    without a causal order (a prefix tree). `window_left`, `sinks` and `scale` are read by the
    tree attention and the tests' negative controls."""

    def __init__(self, scale: float, window_left: int | None, sinks: torch.Tensor | None):
        self.scale, self.window_left, self.sinks = scale, window_left, sinks

    def _local(self, first_head: int, heads: int) -> torch.Tensor | None:
        return None if self.sinks is None else self.sinks[first_head:first_head + heads]

    def __call__(self, q, k, v, first_head: int = 0) -> torch.Tensor:
        if self.window_left is None and self.sinks is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return sink_window_attention(q, k, v, self.scale, self.window_left,
                                     self._local(first_head, q.shape[1]))

    def masked(self, q, k, v, first_head: int, visible: torch.Tensor) -> torch.Tensor:
        """[b, h, n, d] queries over [b, h, m, d] keys where `visible` [n, m] (the window
        already applied by the caller: `window_visible`), with this layer's sinks."""
        return sink_masked_attention(q, k, v, self.scale, visible,
                                     self._local(first_head, q.shape[1]))


def attend_fn(scale: float, window_left: int | None, sinks: torch.Tensor | None) -> Attend:
    """`attend(q, k, v, first_head)` for one layer (module docstring)."""
    return SinkWindowAttend(scale, window_left, sinks)


def sinks_sharded_state_dict(module, prefix: str, sharded_offsets, metadata) -> dict:
    """The core attention's own entries: `softmax_offset` split over TP along heads (as
    megatron's DotProductAttention saves it)."""
    state = module.state_dict(prefix="", keep_vars=True)
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    return make_sharded_tensors_for_checkpoint(
        state, prefix, {"softmax_offset": 0}, sharded_offsets,
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        dp_cp_group=metadata["dp_cp_group"])
