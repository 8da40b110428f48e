"""Tree attention for layers with learned sinks or a sliding window (gpt-oss; Qwen2's
use_sliding_window): prefix sharing's attention (parallel.tree_attention) for a layer whose
`attend` (models.layers.attention.sinks.SinkWindowAttend) is not plain causal SDPA.

Contract of `tree_sink_attention(q, k, v, params, attend, first_head)` (q [T, h, d], k/v
[T, h, d'] with K/V repeated to h heads, the full tree row in natural order): out[a] is the
attention token a gets in its own unshared row from `attend`: over its ancestors and itself,
those keys b with depth(a) - depth(b) <= attend.window_left (the window counts positions along
the row, HF's sliding_window w being window_left = w - 1; none: every ancestor), and the
layer's sink logit per head in the softmax's denominator (the heads first_head .. first_head +
h of this rank's sinks; Ulysses CP hands each rank its own heads).

It runs one call per run of the tree (a chain between branch points) over the run's keys, as
`per_run_attention` does, with an explicit [n, m] bool visibility: the run's ancestor mask
(parallel.tree_attention.run_key_mask) AND the window by depth. A key's depth is its index
among the run's keys in ascending node order (the run's keys are exactly its row's first
tokens: `run_depths`), so the params' RoPE positions (only this rank's under CP) are not read.
The visibility is built once per micro-batch and window (cached on the params, shared by every
layer of that window). The CPU's split path stays with plain layers. Tokens past the runs
(padding, no loss) attend causally among themselves, with the layer's sinks and window.
"""
from __future__ import annotations

import torch

from parallel.tree_attention import TreeAttentionParams, run_key_mask, run_keys_values


def run_depths(run, nodes: torch.Tensor) -> torch.Tensor:
    """The depth (position in its own row) of each tree node in `nodes` [m] that is one of
    `run`'s keys; -1 for nodes that are not (siblings inside a key slice: masked anyway)."""
    depth = torch.full_like(nodes, -1)
    offset = 0
    for a, b in run.keys:
        depth = torch.where((nodes >= a) & (nodes < b), nodes - a + offset, depth)
        offset += b - a
    return depth


def _visible_keys(run, device, window_left: int | None, cache: dict):
    """(first key, last key + 1, visible [n, m] bool, key spans or None) of a run: the keys
    are nodes [first, last) of the row, or the spans concatenated when spans is not None."""
    key = (run.start, str(device), window_left)
    if key in cache:
        return cache[key]
    first, last, mask, spans = run_key_mask(run, device)
    n = run.end - run.start
    if spans is None:
        nodes = torch.arange(first, last, device=device)
    else:
        nodes = torch.cat([torch.arange(a, b, device=device) for a, b in spans])
    if mask is None:   # the run alone, a root chain: causal over itself
        mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    if window_left is not None:
        q_depth = run_depths(run, torch.arange(run.start, run.end, device=device))
        k_depth = run_depths(run, nodes)
        mask = mask & (q_depth[:, None] - k_depth[None, :] <= window_left)
    cache[key] = (first, last, mask, spans)
    return cache[key]


def tree_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        params: TreeAttentionParams, attend, first_head: int = 0
                        ) -> torch.Tensor:
    """Each token's attention over its ancestors within the layer's window, with its sinks
    (module docstring); [T, h, d] -> [T, h, d_v]."""
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    covered = 0
    cache = params.__dict__.setdefault("_sink_run_masks", {})
    for run in params.runs:
        first, last, visible, spans = _visible_keys(run, q.device, attend.window_left, cache)
        qs = q[run.start:run.end].transpose(0, 1).unsqueeze(0)        # [1, h, n, d]
        ks, vs = run_keys_values(k, v, first, last, spans)
        out[run.start:run.end] = attend.masked(qs, ks, vs, first_head, visible)[0].transpose(0, 1)
        covered = max(covered, run.end)
    if covered < q.shape[0]:   # the row's padding tail: its own causal chain
        seg = [x[covered:].transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
        out[covered:] = attend(*seg, first_head)[0].transpose(0, 1)
    return out


__all__ = ["tree_sink_attention", "run_depths"]
