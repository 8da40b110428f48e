"""The CPU tree attention: each token's keys split into its ancestors' and its own run's, each
part one flash-attention call, the parts merged by their log-sum-exps (prefix sharing,
parallel.tree_attention).

A run of the tree (a chain between branch points, engine.training.prefix_tree.RunSpan) attends
its ancestors' keys (every one visible: they all precede the run in each of its rows) and its
own keys (causal). Runs with the same ancestors (siblings: a GRPO group's replies, a DPO pair's
answers) stack their queries into ONE unmasked call over those ancestors' keys; each run's own
keys are one causal call. No mask is built or read, no key is computed twice, and the large
calls are the dense kind the CPU kernel runs fastest (a masked call per run ran at about half
the speed per attended pair).

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


@dataclass(frozen=True)
class _Piece:
    """One flash call: queries `q_spans`, keys `k_spans` (row spans, concatenated in order),
    causal (then q_spans == k_spans, one span) or every key visible."""
    q_spans: tuple[tuple[int, int], ...]
    k_spans: tuple[tuple[int, int], ...]
    causal: bool


def split_plan(runs, row_length: int) -> tuple[list[_Piece], list[_Piece]]:
    """(causal pieces: one per run and one for the padding tail; ancestor pieces: one per set
    of runs with the same ancestors, their queries stacked in run order). Every query token is
    in exactly one causal piece and at most one ancestor piece."""
    causal, groups = [], {}
    covered = 0
    for run in runs:
        causal.append(_Piece(((run.start, run.end),), ((run.start, run.end),), True))
        covered = max(covered, run.end)
        ancestors = list(run.keys)
        a, b = ancestors.pop()           # the last span ends with the run itself
        if a < run.start:                # merged with the ancestors just before it
            ancestors.append((a, run.start))
        if ancestors:
            groups.setdefault(tuple(ancestors), []).append((run.start, run.end))
    if covered < row_length:
        causal.append(_Piece(((covered, row_length),), ((covered, row_length),), True))
    stacked = [_Piece(_merge(q), k, False) for k, q in groups.items()]
    return causal, stacked


def _merge(spans):
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
        causal, stacked = plan
        acc = _acc_dtype(q.dtype)
        out = q.new_empty(*q.shape[:-1], v.shape[-1], dtype=acc)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=acc, device=q.device)   # [h, T]
        for p in causal:
            (a, b), = p.q_spans
            o, l = _FWD(_bhsd(q[a:b]), _bhsd(k[a:b]), _bhsd(v[a:b]), 0.0, True, scale=scale)
            out[a:b] = _thd(o)
            lse[:, a:b] = l[0]
        for p in stacked:
            o, l = _FWD(_bhsd(_take(q, p.q_spans)), _bhsd(_take(k, p.k_spans)),
                        _bhsd(_take(v, p.k_spans)), 0.0, False, scale=scale)
            o, l = _thd(o).to(acc), l[0].to(acc)
            own_o = _take(out, p.q_spans)
            own_l = torch.cat([lse[:, a:b] for a, b in p.q_spans], dim=1)
            both = torch.logaddexp(own_l, l)
            w_own = torch.exp(own_l - both).t().unsqueeze(-1)     # [n, h, 1]
            w_anc = torch.exp(l - both).t().unsqueeze(-1)
            _put(out, p.q_spans, own_o * w_own + o * w_anc, add=False)
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
        causal, stacked = ctx.plan
        acc = _acc_dtype(q.dtype)
        dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v))
        lse = lse.to(torch.float32) if q.dtype not in (torch.float32, torch.float64) else lse
        for p in causal + stacked:
            qs, ks = p.q_spans, p.k_spans
            lp = lse[:, qs[0][0]:qs[0][1]] if len(qs) == 1 else torch.cat(
                [lse[:, a:b] for a, b in qs], dim=1)
            gq, gk, gv = _BWD(_bhsd(_take(grad, qs)), _bhsd(_take(q, qs)), _bhsd(_take(k, ks)),
                              _bhsd(_take(v, ks)), _bhsd(_take(out, qs)), lp.unsqueeze(0),
                              0.0, p.causal, scale=ctx.scale)
            _put(dq, qs, _thd(gq), add=True)
            _put(dk, ks, _thd(gk), add=True)
            _put(dv, ks, _thd(gv), add=True)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def split_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params,
                         scale: float) -> torch.Tensor:
    """Each token's attention over its ancestors and itself on the CPU (module docstring);
    [T, h, d] -> [T, h, d_v]. The plan is built once per micro-batch (cached on params)."""
    cache = params.__dict__.setdefault("_split_plan", {})
    n = q.shape[0]
    if n not in cache:
        cache[n] = split_plan(params.runs, n)
    return _SplitTreeAttention.apply(q, k, v, cache[n], scale)


__all__ = ["split_plan", "split_tree_attention"]
