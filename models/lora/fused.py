"""The local layout of a fused Megatron linear from its slices' parts (models.lora.adapters):
per-slice adapter outputs into the linear's output columns, per-slice merged deltas into its
weight rows. Plain tensor shuffling, no communication."""
from __future__ import annotations

import torch

from models.lora.slices import Slice


def fuse(parts: list[torch.Tensor], targeted: list[str], fused: list[Slice], tp: int,
         qkv_layout: tuple[int, int, int] | None, dim: int) -> torch.Tensor:
    """`parts` (one per `targeted` slice name, this TP rank's out_s / tp along `dim`) in the
    fused linear's local order along `dim`, zeros for the `fused` slices not targeted:
    concatenated ([gate; up] of this rank, Gated DeltaNet's in_proj), or with `qkv_layout`
    (local query groups, heads per group, head dim) interleaved per query group as
    linear_qkv holds q, k, v (models.layers.transforms.merge_qkv)."""
    if len(fused) == 1:
        return parts[0]
    by_name = dict(zip(targeted, parts))
    ref = parts[0]
    full = []
    for sl in fused:
        if sl.name in by_name:
            full.append(by_name[sl.name])
            continue
        shape = list(ref.shape)
        shape[dim] = sl.out_features // tp
        full.append(ref.new_zeros(shape))
    if qkv_layout is None:
        return torch.cat(full, dim=dim)
    groups, d = qkv_layout[0], dim % ref.dim()
    split = [p.reshape(*p.shape[:d], groups, p.shape[d] // groups, *p.shape[d + 1:])
             for p in full]
    return torch.cat(split, dim=d + 1).reshape(*ref.shape[:d], -1, *ref.shape[d + 1:])
