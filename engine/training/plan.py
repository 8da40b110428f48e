"""Plan a global mini-batch over DP ranks and micro-batches (docs/design/architecture.md, docs/design/loss-math.md).

Every rank computes the same plan from the lengths of the whole global mini-batch, so the
micro-batch count is agreed across DP without communication: ranks with fewer micro-batches
get fully masked dummy micro-batches (zero weight, zero gradient).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.training.batching import micro_batches_by_count, micro_batches_by_token_budget
from engine.training.partition import (imbalance, partition_balanced, partition_contiguous,
                              sequence_work)


@dataclass
class MiniBatchPlan:
    ranks: list[list[list[int]]]   # ranks[dp_rank][micro_batch] -> indices into the mini-batch
    dp_imbalance: float            # max/mean estimated work over DP ranks

    @property
    def num_micro_batches(self) -> int:
        return len(self.ranks[0]) if self.ranks else 0


def plan_mini_batch(lengths: list[int], dp: int, balance: bool, micro_batch_size: int,
                    max_tokens_per_micro_batch: int | None,
                    units: list[list[int]] | None = None,
                    unit_lengths: list[int] | None = None) -> MiniBatchPlan:
    """Partition sequence indices 0..n-1 over `dp` ranks (balanced by a*L + b*L^2 work, or
    contiguous), then into the same number of micro-batches on every rank: by count
    (`micro_batch_size` sequences at most) or by token budget.

    `units` (e.g. the two sides of a preference pair, engine.dpo): groups of sequence indices
    that must land in ONE micro-batch of one rank. The plan is then made over the units (a
    unit's length is the sum of its sequences', `micro_batch_size` counts units) and each
    unit is expanded to its sequences, in the unit's order. `unit_lengths`: the tokens each
    unit runs, when not the sum of its sequences' (prefix sharing: its tree's nodes)."""
    if units is not None:
        sizes = unit_lengths or [sum(lengths[i] for i in u) for u in units]
        unit_plan = plan_mini_batch(sizes, dp, balance,
                                    micro_batch_size, max_tokens_per_micro_batch)
        return MiniBatchPlan([[[i for u in mb for i in units[u]] for mb in rank]
                              for rank in unit_plan.ranks], unit_plan.dp_imbalance)
    works = [sequence_work(n) for n in lengths]
    groups = partition_balanced(works, dp) if balance else partition_contiguous(works, dp)
    if max_tokens_per_micro_batch:
        per_rank = [micro_batches_by_token_budget(g, [lengths[i] for i in g],
                                                  max_tokens_per_micro_batch)
                    if g else [] for g in groups]
        count = max(1, max(len(m) for m in per_rank))
        per_rank = [micro_batches_by_token_budget(g, [lengths[i] for i in g],
                                                  max_tokens_per_micro_batch,
                                                  min_count=min(count, len(g)))
                    if g else [] for g in groups]
    else:
        count = max(1, max(-(-len(g) // micro_batch_size) for g in groups))
        per_rank = [micro_batches_by_count(g, min(count, len(g))) if g else [] for g in groups]
    ranks = [m + [[] for _ in range(count - len(m))] for m in per_rank]
    return MiniBatchPlan(ranks=ranks, dp_imbalance=imbalance(works, groups))
