"""Tree attention on CUDA: one FlexAttention call per tree row with a block mask built once per
micro-batch (prefix sharing, parallel.tree_attention).

The rule (the same as parallel.tree_attention.dense_tree_mask): query a sees key b exactly when
b is an ancestor-or-self of a, b <= a < subtree_end[b] (`flex_mask_mod`). Tokens past the
params' subtree_end (none when engine.training.tree_batch built the row: its padding tail has
subtree_end = T) see keys under the same rule with subtree_end[b] = T: the padding tail
attends causally among itself, as `per_run_attention` does.

The block mask (`tree_block_mask`) is computed from subtree_end directly, not from a dense
[T, T] mask: the queries that see key b are the interval [b, subtree_end[b]), so query block
i sees key block j (i >= j) when the largest subtree_end of block j exceeds block i's first
query, and sees every pair of it when j < i and block j's smallest subtree_end reaches block
i's end (never for a last, partial block: create_block_mask pads it with invisible pairs).
O(T + (T / block)^2) work; the same BlockMask as FlexAttention's create_block_mask of the
mask_mod (`flex_block_mask`, the reference the tests compare with). It is built once per
micro-batch and device (cached on the params, as `_run_masks`), shared by every layer.

`flex_tree_attention(q, k, v, params, scale)`: q [T, h, d], k/v [T, h_kv, d] / [T, h_kv, d_v]
(h a multiple of h_kv: FlexAttention's enable_gqa; the callers already repeat K/V), ->
[T, h, d_v]. On CUDA it calls `compiled_flex()` (torch.compile'd once, dynamic=True:
a new row length or a new micro-batch's mask_mod closure does not recompile; dynamo matches a
closure by its code); elsewhere eager flex_attention (forward only: FlexAttention has no CPU
backward in torch 2.13; the tests' path). `uses_flex(q, k, v)` is the dispatch rule of
parallel.tree_attention: CUDA, bf16/fp16/fp32, and head dims FlexAttention's CUDA kernels
take (q/k and v each in [16, 256]: tl.dot needs >= 16, the tuned configs stop at 256; MLA's
192 / 128 qualify); anything else takes tree_attention's other paths (per_run_attention off
the CPU). Layers with sinks or a window never get here (parallel.tree_attention_sinks).
"""
from __future__ import annotations

from functools import cache

import torch
from torch.nn.attention.flex_attention import (BlockMask, create_block_mask,
                                               flex_attention)

BLOCK_SIZE = 128                      # FlexAttention's default sparse block
FLEX_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


@cache
def compiled_flex():
    """flex_attention torch.compile'd with dynamic=True, made once per process (at the first
    CUDA call: importing this module does not import dynamo)."""
    return torch.compile(flex_attention, dynamic=True)


def on_cuda(x: torch.Tensor) -> bool:
    """Whether `x` lives on a CUDA device (the dispatch's device check)."""
    return x.device.type == "cuda"


def uses_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a tree row's attention runs `flex_tree_attention` (module docstring's rule)."""
    return (on_cuda(q) and q.dtype in FLEX_DTYPES
            and all(MIN_HEAD_DIM <= x.shape[-1] <= MAX_HEAD_DIM for x in (q, v)))


def _row_ends(subtree_end, n: int, device) -> torch.Tensor:
    """subtree_end of an n-token row as a long tensor on `device`: tokens past the given ends
    (a padding tail) end at n, so they attend causally among themselves."""
    ends = [int(e) for e in subtree_end][:n]
    return torch.tensor(ends + [n] * (n - len(ends)), dtype=torch.long, device=device)


def flex_mask_mod(subtree_end: torch.Tensor):
    """FlexAttention's mask_mod(b, h, q_idx, kv_idx) of a tree row: kv_idx an ancestor-or-self
    of q_idx. `subtree_end` [T] long on the device the block mask is built on."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < subtree_end[kv_idx])
    return mask_mod


def flex_block_mask(params, device, block_size: int = BLOCK_SIZE) -> BlockMask:
    """The reference BlockMask of a tree row: create_block_mask over the mask_mod (it
    evaluates a dense [T, T] mask; `tree_block_mask` is the one the engine builds)."""
    end = torch.tensor(params.subtree_end, dtype=torch.long, device=device)
    n = len(params.subtree_end)
    return create_block_mask(flex_mask_mod(end), None, None, n, n, device=str(device),
                             BLOCK_SIZE=block_size)


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks per row, block indices visible first) of a [nq, nk] 0/1 block matrix, as
    FlexAttention orders them, shaped [1, 1, nq] and [1, 1, nq, nk] int32."""
    dense = dense.to(torch.int32)[None, None]
    order = torch.argsort(dense, dim=-1, descending=True, stable=True)
    return dense.sum(dim=-1).to(torch.int32), order.to(torch.int32).contiguous()


def tree_block_mask(subtree_end, n: int, device, block_size: int = BLOCK_SIZE) -> BlockMask:
    """BlockMask of an n-token tree row from its subtree ends (module docstring), on
    `device`, with `flex_mask_mod` for the partial blocks."""
    end = _row_ends(subtree_end, n, device)
    nb = -(-n // block_size)
    padded = torch.zeros(nb * block_size, dtype=torch.long, device=device)
    padded[:n] = end                            # keys past n: seen by nobody
    big = torch.full_like(padded, torch.iinfo(torch.long).max)
    big[:n] = end
    max_end = padded.view(nb, block_size).amax(dim=1)      # [nb] per key block
    min_end = big.view(nb, block_size).amin(dim=1)
    starts = torch.arange(nb, device=device) * block_size  # block i's first query
    stops = starts + block_size
    i, j = starts[:, None], starts[None, :]
    any_pair = (j <= i) & (max_end[None, :] > i)
    full = (j < i) & (min_end[None, :] >= stops[:, None])   # ends <= n: never a last block
    partial = any_pair & ~full
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx,
                                    BLOCK_SIZE=(block_size, block_size),
                                    mask_mod=flex_mask_mod(padded), seq_lengths=(n, n))


def row_block_mask(params, n: int, device) -> BlockMask:
    """The params' BlockMask for an n-token row on `device`, built once per micro-batch
    (cached on the params: every layer of the micro-batch reuses it)."""
    cache = params.__dict__.setdefault("_flex_block_masks", {})
    key = (n, str(device))
    if key not in cache:
        cache[key] = tree_block_mask(params.subtree_end, n, device)
    return cache[key]


def flex_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params,
                        scale: float) -> torch.Tensor:
    """Each token's attention over its ancestors and itself as one FlexAttention call
    (module docstring); [T, h, d] -> [T, h, d_v]."""
    n = q.shape[0]
    mask = row_block_mask(params, n, q.device)
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))   # [1, h, T, d]
    kernel = compiled_flex() if q.is_cuda else flex_attention   # eager: forward only
    out = kernel(qs, ks, vs, block_mask=mask, scale=scale,
                 enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


__all__ = ["on_cuda", "uses_flex", "flex_tree_attention", "tree_block_mask", "row_block_mask",
           "flex_mask_mod", "flex_block_mask", "compiled_flex"]
