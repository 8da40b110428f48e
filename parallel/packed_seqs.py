"""Packed ("thd") sequence boundaries known on the host, so that attention never reads them back
from the device.

Megatron's `PackedSeqParams` carries the boundaries `cu_seqlens` as tensors; with the micro-batch
on a GPU, every layer that needs them as Python ints (the per-segment attention loop, the
Ulysses segment list) would copy them to the host: a device-to-host copy that waits for the GPU,
once per layer per micro-batch. The engine builds its micro-batches on the host, where the
boundaries are Python ints already: `HostPackedSeqParams` keeps them next to the tensors
(`host_cu_seqlens`, the same values as `cu_seqlens_q_padded`: the full row's boundaries, before
any context-parallel sharding), and `host_cu_seqlens` hands them out.

Contract: `host_cu_seqlens(p, padded)` equals `p.cu_seqlens_q_padded.tolist()` (padded, the
boundaries megatron's RoPE reads) or `p.cu_seqlens_q.tolist()` (the core attention's), element for
element. `packed_seq_params(bounds)` builds them from one list, so both tensors and the host copy
agree by construction (the engine pads each sequence inside its own segment: its padded and
unpadded boundaries are the same). Parameters built elsewhere (a plain `PackedSeqParams`, e.g. in
forward-only tools) still work: their boundaries are read from the tensor, which is the one
device-to-host copy this module exists to avoid.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class HostPackedSeqParams(PackedSeqParams):
    """Megatron's PackedSeqParams plus the row's boundaries as host ints (module docstring)."""

    host_cu_seqlens: tuple[int, ...] | None = None


def packed_seq_params(bounds: list[int]) -> HostPackedSeqParams:
    """thd parameters of a row whose sequences span bounds[i]:bounds[i+1] (bounds[0] == 0,
    non-decreasing): every cu_seqlens tensor (int32, on the host until the caller moves it) and
    `host_cu_seqlens` hold `bounds`; max_seqlen_q/kv the longest span."""
    bounds = [int(b) for b in bounds]
    if not bounds or bounds[0] != 0 or any(b < a for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"packed boundaries must start at 0 and never decrease, got {bounds}")
    cu = torch.tensor(bounds, dtype=torch.int32)
    longest = max((b - a for a, b in zip(bounds[:-1], bounds[1:])), default=0)
    return HostPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                               cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                               max_seqlen_q=longest, max_seqlen_kv=longest,
                               host_cu_seqlens=tuple(bounds))


def host_cu_seqlens(packed_seq_params, padded: bool = True) -> list[int]:
    """The boundaries [0, end_1, ..., T] of the packed row of `packed_seq_params` as ints: the
    host copy when it carries one (HostPackedSeqParams), else read from cu_seqlens_q_padded
    (`padded`; cu_seqlens_q when that is None) or cu_seqlens_q, which copies from the device."""
    host = getattr(packed_seq_params, "host_cu_seqlens", None)
    if host is not None:
        return list(host)
    cu = packed_seq_params.cu_seqlens_q_padded if padded else None
    if cu is None:
        cu = packed_seq_params.cu_seqlens_q
    return [int(x) for x in cu.tolist()]
