"""Attention over a prefix tree: the attention input of prefix sharing, beside packed_seqs.

A micro-batch whose rows share prefixes runs as one packed ("thd") row of tree nodes in
depth-first order (engine.training.prefix_tree): every node follows its ancestors, and node b
is an ancestor-or-self of node a exactly when b <= a < subtree_end[b]. `TreeAttentionParams`
is megatron's PackedSeqParams (a subclass of parallel.packed_seqs.HostPackedSeqParams, so every
layer passes it along unchanged) plus the tree:

- `subtree_end` [T] (host ints): the ancestor structure of the full row (natural order);
- `runs`: the chains between branch points, each with the spans of its keys (its ancestors and
  itself), host ints; the attention runs one SDPA per run over those keys with a lower-right
  causal mask: the work of the tree, no more (a dense [T, T] mask would cost T^2 however
  little is shared);
- `positions`: the RoPE position of each of this rank's tokens (its depth: its position in its
  own row), attached to the cu_seqlens tensor megatron hands to RoPE
  (models.layers.attention.packed_rope reads it with `tree_positions`);
- `host_cu_seqlens` / cu_seqlens: the bounds the row is sharded by (one span at cp > 1: the
  whole tree row is zigzag-sharded as one sequence; the root subtrees at cp 1), max_seqlen the
  longest, which also sizes megatron's rotary table (>= the deepest node + 1).

Contract of `tree_attention(q, k, v, params, scale)` (q [T, h, d], k/v [T, h, d'] with K/V
already repeated to h heads, T the full row in natural order): out[a] = softmax over the keys
b with b <= a < subtree_end[b] (its ancestors and itself) of q[a].k[b] * scale, times v[b] --
the attention token a gets in its own unshared row. `dense_tree_mask` is the same rule as a
[T, T] bool matrix (the reference the tests compare with); on CUDA the row runs one
FlexAttention call (parallel.tree_attention_flex: `flex_mask_mod` the same rule).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from parallel.packed_seqs import HostPackedSeqParams
from parallel.tree_attention_flex import (flex_block_mask, flex_mask_mod,
                                          flex_tree_attention, uses_flex)
from parallel.tree_attention_split import split_tree_attention, splits


@dataclass
class TreeAttentionParams(HostPackedSeqParams):
    """PackedSeqParams of a tree row (module docstring)."""

    subtree_end: tuple[int, ...] = ()
    runs: tuple = ()                    # engine.training.prefix_tree.RunSpan-like: start, end, keys
    positions: torch.Tensor | None = None   # [T_local] long, this rank's tokens' depths
    row_length: int = 0                 # T: tokens of the full tree row (padding included)

    def attach_positions(self) -> None:
        """Hang `positions` on the cu_seqlens tensors megatron passes to RoPE (call again after
        moving them: a moved tensor is a new object)."""
        for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
                     "cu_seqlens_kv_padded"):
            cu = getattr(self, name)
            if cu is not None:
                cu.tree_positions = self.positions

    def to_device(self, device) -> None:
        """Move the cu_seqlens tensors and positions to `device` (one tensor object shared by
        the four names, as built), positions attached again."""
        moved: dict = {}
        for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
                     "cu_seqlens_kv_padded"):
            cu = getattr(self, name)
            if cu is not None:
                if id(cu) not in moved:
                    moved[id(cu)] = cu.to(device)
                setattr(self, name, moved[id(cu)])
        if self.positions is not None:
            self.positions = self.positions.to(device)
        self.attach_positions()


def tree_positions(cu_seqlens) -> torch.Tensor | None:
    """The per-token RoPE positions a tree row's cu_seqlens carries, or None (a plain row)."""
    return getattr(cu_seqlens, "tree_positions", None)


def is_tree(packed_seq_params) -> bool:
    return isinstance(packed_seq_params, TreeAttentionParams)


def tree_params(shard_bounds: list[int], subtree_end: list[int], runs, positions: torch.Tensor,
                longest: int) -> TreeAttentionParams:
    """Parameters of a tree row: `shard_bounds` the row's packing bounds (module docstring),
    `subtree_end` and `runs` of the full row, `positions` this rank's depths (long),
    `longest` >= the deepest node + 1 and >= the longest span (megatron sizes RoPE by it)."""
    bounds = [int(b) for b in shard_bounds]
    cu = torch.tensor(bounds, dtype=torch.int32)
    p = TreeAttentionParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                            cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                            max_seqlen_q=int(longest), max_seqlen_kv=int(longest),
                            host_cu_seqlens=tuple(bounds),
                            subtree_end=tuple(int(e) for e in subtree_end), runs=tuple(runs),
                            positions=positions.to(torch.long), row_length=bounds[-1])
    p.attach_positions()
    return p


def dense_tree_mask(subtree_end, device=None) -> torch.Tensor:
    """[T, T] bool: mask[a, b] = b is an ancestor-or-self of a (b <= a < subtree_end[b])."""
    end = torch.as_tensor(list(subtree_end), dtype=torch.long, device=device)
    idx = torch.arange(end.numel(), device=device)
    return (idx[None, :] <= idx[:, None]) & (idx[:, None] < end[None, :])


def _lower_right(q_len: int, kv_len: int, device) -> torch.Tensor:
    """[q_len, kv_len] bool: query i sees keys j <= i + kv_len - q_len."""
    i = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(kv_len, device=device)[None, :]
    return j <= i + (kv_len - q_len)


# a run reads its keys as one contiguous slice (masking the sibling subtrees in between) when
# that slice is at most this many times its keys; else it concatenates its key spans
MAX_SLICE_WASTE = 1.5


def _run_keys(run, device, dtype, cache: dict):
    """(first key, last key + 1, mask or None, key spans or None) of a run: keys [a, b) of
    the row (or the spans concatenated); mask [n_q, n_k] additive in `dtype` (0 visible, -inf
    not: SDPA would convert a bool mask in every call; None: plain causal over the run alone);
    built once per micro-batch (`cache`: the params' own, shared by every layer)."""
    key = (run.start, str(device), dtype)
    if key not in cache:
        cache[key] = _additive(run_key_mask(run, device), dtype)
    return cache[key]


def _additive(entry, dtype):
    first, last, mask, spans = entry
    if mask is not None:
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
            ~mask, float("-inf"))
    return first, last, mask, spans


def run_key_mask(run, device):
    """_run_keys with a bool mask (True: visible): (first, last, mask or None, spans or None)."""
    spans = run.keys
    needed = sum(b - a for a, b in spans)
    first, last = spans[0][0], spans[-1][1]
    if len(spans) == 1 and spans[0] == (run.start, run.end):
        return first, last, None, None
    if last - first <= MAX_SLICE_WASTE * needed:   # one slice, siblings masked out
        cols = torch.zeros(last - first, dtype=torch.bool, device=device)
        for a, b in spans:   # the ancestors (the run's own columns: causal, below)
            cols[a - first:b - first] = True
        cols[run.start - first:] = False
        return (first, last,
                cols[None, :] | _shifted_causal(run.end - run.start, last - first, device), None)
    # the key spans concatenated: lower-right causal over them
    return first, last, _lower_right(run.end - run.start, needed, device), spans


def _shifted_causal(q_len: int, kv_len: int, device) -> torch.Tensor:
    """[q_len, kv_len] bool: the run's own keys (the last q_len columns), causal."""
    return _lower_right(q_len, kv_len, device) & (
        torch.arange(kv_len, device=device)[None, :] >= kv_len - q_len)


# calls of `tree_attention` by the path that ran ("flex", "split", "per_run"): what a benchmark
# reports (tools.bench.prefix_sharing)
PATHS_RUN: Counter = Counter()


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   params: TreeAttentionParams, scale: float) -> torch.Tensor:
    """Each token's attention over its ancestors and itself (module docstring); [T, h, d] ->
    [T, h, d_v]. Tokens past the tree's runs (padding) attend causally among themselves (they
    carry no loss). On the CPU, a row whose sibling runs share long ancestors:
    parallel.tree_attention_split (ancestors and own keys in separate calls, merged); else
    `per_run_attention`. On CUDA (bf16/fp16/fp32, head dims 16-256): one FlexAttention call
    (parallel.tree_attention_flex)."""
    if uses_flex(q, k, v):
        PATHS_RUN["flex"] += 1
        return flex_tree_attention(q, k, v, params, scale)
    if q.device.type == "cpu" and splits(params, q.shape[0]):
        PATHS_RUN["split"] += 1
        return split_tree_attention(q, k, v, params, scale)
    PATHS_RUN["per_run"] += 1
    return per_run_attention(q, k, v, params, scale)


def run_keys_values(k: torch.Tensor, v: torch.Tensor, first: int, last: int, spans):
    """A run's keys and values as [1, h, m, d] (run_key_mask's first, last and spans): the
    row's nodes [first, last), or the key spans concatenated when spans is not None."""
    if spans is None:
        return tuple(x[first:last].transpose(0, 1).unsqueeze(0) for x in (k, v))
    return tuple(torch.cat([x[a:b] for a, b in spans]).transpose(0, 1).unsqueeze(0)
                 for x in (k, v))


def per_run_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      params: TreeAttentionParams, scale: float) -> torch.Tensor:
    """tree_attention as one SDPA per run of the tree over its keys (a mask where the keys
    are not one causal block): the path off the CPU."""
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    covered = 0
    cache = params.__dict__.setdefault("_run_masks", {})
    for run in params.runs:
        start, end = run.start, run.end
        first, last, mask, spans = _run_keys(run, q.device, q.dtype, cache)
        qs = q[start:end].transpose(0, 1).unsqueeze(0)        # [1, h, n, d]
        ks, vs = run_keys_values(k, v, first, last, spans)
        if mask is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        out[start:end] = o[0].transpose(0, 1)
        covered = max(covered, end)
    if covered < q.shape[0]:   # the row's padding tail: its own causal chain
        seg = [x[covered:].transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
        out[covered:] = F.scaled_dot_product_attention(*seg, is_causal=True,
                                                       scale=scale)[0].transpose(0, 1)
    return out


def dense_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         subtree_end, scale: float) -> torch.Tensor:
    """The same attention with one dense [T, T] mask (the tests' reference; T^2 work)."""
    mask = dense_tree_mask(subtree_end, q.device)
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask,
                                          scale=scale)[0].transpose(0, 1)


__all__ = ["TreeAttentionParams", "tree_params", "tree_positions", "is_tree", "tree_attention",
           "PATHS_RUN", "per_run_attention", "run_key_mask", "run_keys_values",
           "dense_tree_attention", "dense_tree_mask", "flex_mask_mod", "flex_block_mask"]
