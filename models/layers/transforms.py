"""Pure tensor transforms between HF and Megatron weight layouts.

Megatron fuses Q, K and V per query group: for each of the `ng` KV groups, the rows of its
`heads/ng` query heads, then its key head, then its value head. TP splits the fused tensor along
rows into `tp` contiguous blocks of whole groups. `linear_fc1` fuses gate and up *per TP rank*:
rank r holds [gate rows of rank r; up rows of rank r].
"""
from __future__ import annotations

import torch


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int,
              num_kv_heads: int) -> torch.Tensor:
    """HF q [h*d, ...], k/v [g*d, ...] -> Megatron fused qkv [g*(h/g+2)*d, ...].
    Works for weights (2-D) and biases (1-D)."""
    d = q.shape[0] // num_heads
    per_group = num_heads // num_kv_heads
    rest = q.shape[1:]
    qg = q.reshape(num_kv_heads, per_group * d, *rest)
    kg = k.reshape(num_kv_heads, d, *rest)
    vg = v.reshape(num_kv_heads, d, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `merge_qkv`."""
    per_group = num_heads // num_kv_heads
    d = qkv.shape[0] // (num_kv_heads * (per_group + 2))
    rest = qkv.shape[1:]
    grouped = qkv.reshape(num_kv_heads, (per_group + 2) * d, *rest)
    q, k, v = torch.split(grouped, [per_group * d, d, d], dim=1)
    return (q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(),
            v.reshape(-1, *rest).contiguous())


def merge_gate_up(gate: torch.Tensor, up: torch.Tensor, tp: int = 1) -> list[torch.Tensor]:
    """HF gate/up [f, hidden] -> the `tp` Megatron linear_fc1 shards [2*f/tp, hidden]."""
    return [torch.cat([g, u], dim=0) for g, u in zip(gate.chunk(tp, 0), up.chunk(tp, 0))]


def split_gate_up(shards: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `merge_gate_up`: per-rank fc1 shards -> full HF gate and up."""
    gates, ups = zip(*(s.chunk(2, dim=0) for s in shards))
    return torch.cat(gates, 0), torch.cat(ups, 0)


def pad_vocab(weight: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """Append zero rows up to `padded_rows` (embedding / output layer)."""
    extra = padded_rows - weight.shape[0]
    if extra < 0:
        raise ValueError(f"cannot pad {weight.shape[0]} rows down to {padded_rows}")
    if extra == 0:
        return weight
    return torch.cat([weight, weight.new_zeros(extra, *weight.shape[1:])], dim=0)


def unpad_vocab(weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return weight[:vocab_size].contiguous()
