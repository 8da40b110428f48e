"""One micro-batch of a per-sequence objective: the sequence-sum table, the CP share, the
per-token coefficients (docs/preference.md, "What is exact").

A preference loss is non-linear in per-sequence sums S_i = sum_t v_t * mask_t (a completion's
log-probs for DPO and KTO, a score for a reward model). Its gradient is exact through the chain
rule: d L / d theta = sum_i g_i * d S_i / d theta with g_i = d L / d S_i taken at the detached
sums (engine.preference.gradients). The micro-batch's differentiable loss is therefore the plain
weighted token sum

    sum_t g(seq of t) * v_t * mask_t                       (coefficient_loss)

which megatron's per-token-loss contract sums over micro-batches, CP shards and DP ranks
(engine.training.loss) unchanged. Context parallelism spreads a sequence's tokens over the CP
ranks, so the sums are all-reduced over the CP group (`sequence_table`; no other group: TP ranks
hold the same values, PP stages other than the last run no loss, DP ranks hold other
sequences). Reports are sums of per-sequence values divided by a GLOBAL count, counted on CP
rank 0 only (`report_share`: every CP rank knows every sum); reduce_reports sums them over
micro-batches and DP x CP.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# the CP group summing a sequence's shards; the invariance harnesses' negative controls replace
# this module's name for it (per-shard sums)
from engine.training.rank_batch import context_parallel_group as cp_group


def sequence_table(values: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor,
                   size: int) -> torch.Tensor:
    """[size, 2] float64, detached: per mini-batch position, the sum of values * mask over the
    whole sequence and the number of its (non-padding) tokens, summed over the CP group."""
    ids = seq_ids.reshape(-1).long()
    valid = ids >= 0
    safe = torch.where(valid, ids, torch.zeros_like(ids))
    table = torch.zeros(size, 2, dtype=torch.float64, device=values.device)
    sums = (values.detach().reshape(-1).to(torch.float64)
            * mask.reshape(-1).to(torch.float64) * valid)
    table[:, 0].index_add_(0, safe, sums)
    table[:, 1].index_add_(0, safe, valid.to(torch.float64))
    group = cp_group()
    if group is not None:
        dist.all_reduce(table, group=group)
    return table


def present_pairs(table: torch.Tensor, where: str
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pairs, chosen positions, rejected positions) of the pairs [c_0, r_0, c_1, ...] whose
    sequences are in this micro-batch (`table` from sequence_table); raises when a pair's sides
    were planned into different micro-batches (`where` names the loss)."""
    present = table[:, 1] > 0
    if not bool((present[0::2] == present[1::2]).all()):
        raise RuntimeError("a preference pair's sides are in different micro-batches: plan "
                           f"the mini-batch with units ({where})")
    pairs = torch.nonzero(present[0::2], as_tuple=True)[0]
    return pairs, 2 * pairs, 2 * pairs + 1


def token_coefficients(coef: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """Each token's sequence coefficient coef[seq of t] (0 on padding, seq_ids < 0)."""
    ids = seq_ids.long()
    return torch.where(ids >= 0, coef[ids.clamp(min=0)], torch.zeros_like(coef[:1]))


def coefficient_loss(values: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                     grads: torch.Tensor, seq_ids: torch.Tensor, size: int) -> torch.Tensor:
    """sum_t g(seq of t) * values_t * mask_t, differentiable in `values`: the micro-batch's
    share of the exact gradient (module docstring); `grads` [k] float64 are d L / d S at the
    mini-batch `positions` [k] (every other sequence: 0)."""
    coef = torch.zeros(size, dtype=torch.float64, device=grads.device)
    coef[positions] = grads
    token_coef = token_coefficients(coef, seq_ids)
    return (values * mask * token_coef.to(values.dtype)).sum()


def cp_share() -> float:
    """1.0 on CP rank 0 (or without model parallelism), else 0.0: per-sequence values known to
    every CP rank are counted once."""
    group = cp_group()
    return 1.0 if group is None or dist.get_rank(group) == 0 else 0.0


def report_share(total: float):
    """v -> v.sum() / total on CP rank 0 (0 elsewhere), float64 and detached: this micro-batch's
    share of a mean over `total` sequences (or pairs) of the global batch (0 when total is 0)."""
    scale = cp_share() / total if total else 0.0
    return lambda v: v.sum().detach().to(torch.float64) * scale
