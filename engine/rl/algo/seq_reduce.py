"""Whole-sequence reductions inside one micro-batch, exact under CP sharding and packing.

A micro-batch holds whole sequences (the DP plan and the micro-batch split never cut one), but
with context parallelism each CP rank holds only its zigzag shard of every sequence. Sequence-
level quantities of the *current* forward (GSPO's mean token log-ratio, GMPO's geometric mean,
sequence-level rollout IS weights in bypass mode) therefore need the sum over the whole
sequence: `SequenceReducer` sums per-token values by sequence id on this shard and all-reduces
the per-sequence sums over the CP group (no other group: TP ranks hold identical values, PP
stages other than the last run no loss, DP ranks hold other sequences).

Results are detached (no autograd through the collective): every policy loss uses sequence
quantities only as constants times per-token terms whose gradient is local (engine.rl.
policy_loss_variants shows the algebra).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from engine.training.rank_batch import context_parallel_group as cp_group

# `cp_group` (this module's name for engine.training.rank_batch.context_parallel_group) is
# what engine.rl.policy.update calls; the invariance harness's negative control replaces it
# here to reproduce per-shard sums.


class SequenceReducer:
    """Per-sequence sums of per-token values over whole sequences.

    Args:
        seq_ids: [..., T] long, the token's sequence index in this rank's list (-1: padding),
            the micro-batch's `seq_ids` (same on every CP rank of a DP rank).
        loss_mask: [..., T] 0/1 float, trained tokens (the shard's part of each sequence).
        group: process group over which shards of one sequence are spread (the CP group), or
            None when this process holds whole sequences.
    Collective over `group` in the constructor and in every `sums` call (all CP ranks of the
    micro-batch call them in the same order).
    """

    def __init__(self, seq_ids: torch.Tensor, loss_mask: torch.Tensor, group=None):
        self.group = group if group is not None and dist.get_world_size(group) > 1 else None
        self.ids = seq_ids.reshape(-1).long()
        self.valid = self.ids >= 0
        self.mask = loss_mask.reshape(-1).to(torch.float64) * self.valid
        self.shape = seq_ids.shape
        self.device = seq_ids.device
        size = torch.tensor([int(self.ids.max()) + 1 if self.ids.numel() else 0],
                            dtype=torch.int64, device=self.device)
        if self.group is not None:
            dist.all_reduce(size, op=dist.ReduceOp.MAX, group=self.group)
        self.num = int(size)
        self.counts = self.sums(torch.ones(self.shape, device=self.device))[0]

    def _per_sequence(self, values: list[torch.Tensor]) -> torch.Tensor:
        """[num sequences, len(values)] float64: masked sums over whole sequences."""
        table = torch.zeros(max(self.num, 1), len(values), dtype=torch.float64,
                            device=self.device)
        safe = torch.where(self.valid, self.ids, torch.zeros_like(self.ids))
        for j, v in enumerate(values):
            flat = v.detach().reshape(-1).to(self.device, torch.float64)
            flat = torch.where(self.mask > 0, flat, torch.zeros_like(flat)) * self.mask
            table[:, j].index_add_(0, safe, flat)
        if self.group is not None:
            dist.all_reduce(table, group=self.group)
        return table

    def sums(self, *values: torch.Tensor) -> list[torch.Tensor]:
        """For each [..., T] tensor v: per token, sum over the token's whole sequence of
        v * loss_mask (float64, detached; 0 on padding). One all-reduce for all values."""
        table = self._per_sequence(list(values))
        safe = torch.where(self.valid, self.ids, torch.zeros_like(self.ids))
        out = []
        for j in range(len(values)):
            per_token = torch.where(self.valid, table[safe, j], torch.zeros_like(self.mask))
            out.append(per_token.reshape(self.shape))
        return out

    def means(self, *values: torch.Tensor) -> list[torch.Tensor]:
        """Per token, the masked mean over its whole sequence (0 for sequences without a trained
        token), float64, detached."""
        return [s / self.counts.clamp(min=1) for s in self.sums(*values)]

    def maxes(self, value: torch.Tensor) -> torch.Tensor:
        """Per token, the max of `value` over the trained tokens of its whole sequence (0 for
        sequences without one), float64, detached. One MAX all-reduce over the group."""
        table = torch.full((max(self.num, 1),), float("-inf"), dtype=torch.float64,
                           device=self.device)
        safe = torch.where(self.valid, self.ids, torch.zeros_like(self.ids))
        flat = value.detach().reshape(-1).to(self.device, torch.float64)
        flat = torch.where(self.mask > 0, flat, torch.full_like(flat, float("-inf")))
        table.scatter_reduce_(0, safe, flat, reduce="amax")
        if self.group is not None:
            dist.all_reduce(table, op=dist.ReduceOp.MAX, group=self.group)
        table = torch.where(torch.isinf(table), torch.zeros_like(table), table)
        return torch.where(self.valid, table[safe], torch.zeros_like(self.mask)).reshape(self.shape)
