"""Zigzag sharding of sequences over context-parallel ranks (megatron's CP convention).

A sequence of length L (a multiple of 2*cp) is cut into 2*cp equal chunks; CP rank r holds
chunks r and 2*cp-1-r, in that order. For packed rows ("thd"), every sequence of the row is cut
this way separately and the rank's pieces are concatenated sequence by sequence, which is what
megatron's rotary embedding assumes under CP.
"""
from __future__ import annotations

import torch


def local_positions(seq_lengths: list[int], cp: int, rank: int) -> torch.Tensor:
    """Indices (into the unsharded row) of the tokens CP rank `rank` holds, in local order.

    `seq_lengths`: lengths of the sequences packed in the row (one entry for an unpacked row);
    each must be divisible by 2*cp.
    """
    out = []
    start = 0
    for length in seq_lengths:
        if length % (2 * cp):
            raise ValueError(f"sequence length {length} is not divisible by 2*cp={2 * cp}")
        chunk = length // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            out.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
        start += length
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def gathered_to_natural(seq_lengths: list[int], cp: int) -> torch.Tensor:
    """Permutation p such that natural = gathered[p], where `gathered` is the concatenation of
    every CP rank's local tokens in rank order (what a Ulysses all-to-all produces)."""
    gathered = torch.cat([local_positions(seq_lengths, cp, r) for r in range(cp)])
    return torch.argsort(gathered)


def shard(x: torch.Tensor, seq_lengths: list[int], cp: int, rank: int, dim: int = 1
          ) -> torch.Tensor:
    """The CP-local part of `x` along `dim` (the token dimension)."""
    if cp == 1:
        return x
    return x.index_select(dim, local_positions(seq_lengths, cp, rank).to(x.device))


def unshard(pieces: list[torch.Tensor], seq_lengths: list[int], cp: int, dim: int = 1
            ) -> torch.Tensor:
    """Inverse of `shard`: rebuild the full row from every rank's local part (rank order)."""
    if cp == 1:
        return pieces[0]
    gathered = torch.cat(pieces, dim=dim)
    return gathered.index_select(dim, gathered_to_natural(seq_lengths, cp).to(gathered.device))
