"""The CPU tree attention: each token's keys split into its ancestors' and its own run's, each
part one flash-attention call, the parts merged by their log-sum-exps (prefix sharing,
parallel.tree_attention).

A run of the tree (a chain between branch points, engine.training.prefix_tree.RunSpan) attends
its ancestors' keys (every one visible: they all precede the run in each of its rows) and its
own keys (causal). Runs with the same ancestors (siblings: a GRPO group's replies, a DPO pair's
answers) stack their queries into ONE unmasked call over those ancestors' keys; each run's own
keys are one causal call. No mask is built or read, no key is computed twice, and the large
calls are the dense kind the CPU kernel runs fastest (measured: docs/benchmarks.md, "Prefix
sharing").

Merge (the online softmax of flash attention, done once between the parts): with part outputs
o1, o2 and log-sum-exps l1, l2, l = logaddexp(l1, l2) and o = o1 exp(l1 - l) + o2 exp(l2 - l),
which is softmax over the union of the keys. Backward: each part's gradients are the flash
backward of that part called with the MERGED output and log-sum-exp (the softmax
probabilities of a part's keys are exp(s - l) with the global l, and the row sum D = dO . O
uses the global O), accumulated into dq, dk, dv: what ring attention does per key block.

`split_tree_attention(q, k, v, params, scale)`: q [T, h, d], k/v [T, h, d'] (heads already
repeated), the tree's runs in `params.runs`; tokens past the runs (padding) attend causally
among themselves. The same contract as parallel.tree_attention.tree_attention (CPU only:
aten's `_scaled_dot_product_flash_attention_for_cpu` and its backward).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


# a set of sibling runs takes the split (stacked queries over the ancestors + each run's own
# causal call, merged) when their ancestors have at least this many keys; below it each run is
# one call over its keys with a lower-right causal mask (the kernel arithmetic of the run's own
# unshared row: its forward bitwise equal on the CPU). A row with no set to split runs
# parallel.tree_attention's per-run path (on short prefixes the split is slower: measured in
# docs/benchmarks.md, "The split tree attention's threshold"). tests/test_prefix_sharing.py
# runs its layouts split (PREFIX_SPLIT_MIN_KEYS)
SPLIT_MIN_KEYS = 256


@dataclass(frozen=True)
class _Piece:
    """One flash call: queries `q_spans`, keys `k_spans` (row spans, concatenated in order);
    kind "causal" (q_spans == k_spans, one span), "full" (every key visible) or "lower_right"
    (one query span, the last of its keys: query i sees every key up to len(keys) - n + i)."""
    q_spans: tuple[tuple[int, int], ...]
    k_spans: tuple[tuple[int, int], ...]
    kind: str


def split_plan(runs, row_length: int, min_keys: int | None = None
               ) -> tuple[list[_Piece], list[_Piece]]:
    """(whole pieces: every query token in exactly one, its output and log-sum-exp complete or,
    for a split run, its own keys' part; stacked pieces: the "full" calls of the split sets of
    runs, merged into their runs' parts). `min_keys`: SPLIT_MIN_KEYS."""
    min_keys = SPLIT_MIN_KEYS if min_keys is None else min_keys
    whole, groups = [], {}
    covered = 0
    for run in runs:
        covered = max(covered, run.end)
        ancestors = list(run.keys)
        a, b = ancestors.pop()           # the last span ends with the run itself
        if a < run.start:                # merged with the ancestors just before it
            ancestors.append((a, run.start))
        groups.setdefault(tuple(ancestors), []).append(run)
    stacked = []
    for ancestors, members in groups.items():
        split = bool(ancestors) and sum(b - a for a, b in ancestors) >= min_keys
        for run in members:
            own = ((run.start, run.end),)
            whole.append(_Piece(own, own, "causal") if split or not ancestors else
                         _Piece(own, tuple(run.keys), "lower_right"))
        if split:
            stacked.append(_Piece(merge_spans([(r.start, r.end) for r in members]), ancestors,
                                  "full"))
    if covered < row_length:
        whole.append(_Piece(((covered, row_length),), ((covered, row_length),), "causal"))
    return whole, stacked


def _mask(piece: _Piece, dtype, device, cache: dict):
    """The additive [1, 1, n, keys] mask of a lower_right piece (None for the others), built
    once per plan."""
    if piece.kind != "lower_right":
        return None
    key = (piece, dtype, str(device))
    if key not in cache:
        (a, b), = piece.q_spans
        n, nk = b - a, sum(e - s for s, e in piece.k_spans)
        i = torch.arange(n, device=device)[:, None]
        j = torch.arange(nk, device=device)[None, :]
        cache[key] = torch.zeros(n, nk, dtype=dtype, device=device).masked_fill_(
            j > i + (nk - n), float("-inf"))[None, None]
    return cache[key]


def merge_spans(spans) -> tuple[tuple[int, int], ...]:
    """Adjacent spans joined ((0, 4), (4, 9) -> (0, 9)): fewer pieces to concatenate."""
    out: list[tuple[int, int]] = []
    for a, b in spans:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


def _take(x: torch.Tensor, spans) -> torch.Tensor:
    """Rows `spans` of x [T, ...] (a view when one span)."""
    if len(spans) == 1:
        return x[spans[0][0]:spans[0][1]]
    return torch.cat([x[a:b] for a, b in spans])


def _put(x: torch.Tensor, spans, value: torch.Tensor, add: bool) -> None:
    """x[spans] = value (or += value), value's rows in span order."""
    at = 0
    for a, b in spans:
        part = value[at:at + b - a]
        if add:
            x[a:b] += part
        else:
            x[a:b] = part
        at += b - a


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)       # [n, h, d] -> [1, h, n, d] (a view)


def _thd(x: torch.Tensor) -> torch.Tensor:
    return x[0].transpose(0, 1)                 # [1, h, n, d] -> [n, h, d]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


class _SplitTreeAttention(torch.autograd.Function):
    """Module docstring; plan = split_plan(...) of the row."""

    @staticmethod
    def forward(ctx, q, k, v, plan, scale):
        whole, stacked = plan[0]
        masks = plan[1]
        acc = _acc_dtype(q.dtype)
        out = q.new_empty(*q.shape[:-1], v.shape[-1], dtype=acc)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=acc, device=q.device)   # [h, T]
        for p in whole:
            (a, b), = p.q_spans
            o, l = _FWD(_bhsd(q[a:b]), _bhsd(_take(k, p.k_spans)), _bhsd(_take(v, p.k_spans)),
                        0.0, p.kind == "causal", attn_mask=_mask(p, q.dtype, q.device, masks),
                        scale=scale)
            out[a:b] = _thd(o)
            lse[:, a:b] = l[0]
        for p in stacked:
            o, l = _FWD(_bhsd(_take(q, p.q_spans)), _bhsd(_take(k, p.k_spans)),
                        _bhsd(_take(v, p.k_spans)), 0.0, False, scale=scale)
            o, l = _thd(o).double(), l[0].double()   # merged in float64: one rounding
            own_o = _take(out, p.q_spans).double()
            own_l = torch.cat([lse[:, a:b] for a, b in p.q_spans], dim=1).double()
            both = torch.logaddexp(own_l, l)
            w_own = torch.exp(own_l - both).t().unsqueeze(-1)     # [n, h, 1]
            w_anc = torch.exp(l - both).t().unsqueeze(-1)
            _put(out, p.q_spans, (own_o * w_own + o * w_anc).to(acc), add=False)
            both = both.to(acc)
            at = 0
            for a, b in p.q_spans:
                lse[:, a:b] = both[:, at:at + b - a]
                at += b - a
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale = plan, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        (whole, stacked), masks = ctx.plan
        acc = _acc_dtype(q.dtype)
        dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v))
        for p in reversed(whole + stacked):
            qs, ks = p.q_spans, p.k_spans
            lp = lse[:, qs[0][0]:qs[0][1]] if len(qs) == 1 else torch.cat(
                [lse[:, a:b] for a, b in qs], dim=1)
            gq, gk, gv = _BWD(_bhsd(_take(grad, qs)), _bhsd(_take(q, qs)), _bhsd(_take(k, ks)),
                              _bhsd(_take(v, ks)), _bhsd(_take(out, qs)), lp.unsqueeze(0),
                              0.0, p.kind == "causal",
                              attn_mask=_mask(p, q.dtype, q.device, masks), scale=ctx.scale)
            _put(dq, qs, _thd(gq), add=True)
            _put(dk, ks, _thd(gk), add=True)
            _put(dv, ks, _thd(gv), add=True)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def split_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params,
                         scale: float) -> torch.Tensor:
    """Each token's attention over its ancestors and itself on the CPU (module docstring);
    [T, h, d] -> [T, h, d_v]. The plan is built once per micro-batch (cached on params).
    The CPU flash kernel needs one head size: with d_v != d (MLA: DeepSeek-V3's 192 / 128)
    the smaller side is zero-padded (v, or q and k: a zero dim adds 0 to q.k, `scale` is
    explicit) and the output sliced to d_v, the same numbers, gradients through the pad."""
    d, dv = q.shape[-1], v.shape[-1]
    if dv < d:
        v = torch.nn.functional.pad(v, (0, d - dv))
    elif dv > d:
        q, k = (torch.nn.functional.pad(x, (0, dv - d)) for x in (q, k))
    out = _SplitTreeAttention.apply(q, k, v, _plan_of(params, q.shape[0]), scale)
    return out if dv == out.shape[-1] else out[..., :dv]


def _plan_of(params, n: int):
    cache = params.__dict__.setdefault("_split_plan", {})
    if n not in cache:
        cache[n] = (split_plan(params.runs, n), {})   # (pieces, their masks)
    return cache[n]


def splits(params, n: int) -> bool:
    """Whether a tree row of `n` tokens has a set of sibling runs worth splitting
    (SPLIT_MIN_KEYS); without one parallel.tree_attention runs its per-run path."""
    return bool(_plan_of(params, n)[0][1])


__all__ = ["split_plan", "split_tree_attention", "splits"]
