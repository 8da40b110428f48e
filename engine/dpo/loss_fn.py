"""The DPO micro-batch loss: whole pairs meet in one loss term on every layout.

Layout contract (docs/preference.md, "What is exact"):
- The mini-batch is the sequence list [c_0, r_0, c_1, r_1, ...] (pair k = positions 2k, 2k+1)
  planned with units [[0, 1], [2, 3], ...] (engine.training.plan): both sides of a pair are in
  the SAME micro-batch of the SAME DP rank, whatever the DP size, micro-batch size, token
  budget or packing. `train.micro_batch_size` therefore counts pairs.
- Context parallelism spreads each side's tokens over the CP ranks: the per-sequence sums of
  the policy's completion log-probs are summed over the CP group (one all-reduce of a [2P, 2]
  float64 table per micro-batch; no other group: TP ranks hold the same values, PP stages
  other than the last run no loss, DP ranks hold other pairs).
- The pair loss is non-linear in those sums. Its gradient is exact through the chain rule:
  d L / d theta = sum over sides of g_side * d(sum of the side's token log-probs) / d theta,
  with g_side = dL/d(side's sum) computed from the detached sums (engine.dpo.pair_loss.
  pair_gradients). The micro-batch's differentiable loss is therefore the plain weighted
  token sum sum_t g_side(t) * logp_t, which megatron's per-token-loss contract sums over
  micro-batches, CP shards and DP ranks (engine.training.loss), unchanged.
- Reported values are sums over pairs of (value / P) with P the GLOBAL pair count, counted on
  CP rank 0 only (every CP rank knows every pair's value); reduce_reports sums them over
  micro-batches and DP x CP: the mean over the pairs of the global batch.
- The chosen-side NLL (`nll`, RPO's term when dpo.rpo_alpha is set) is a token loss with the
  per-sequence weights of loss.agg_mode over the chosen completions of the global batch
  (mb.token_weights; 0 on rejected sides): a plain weighted sum, exact by construction.
- ORPO's NLL (`nll_loss`, weight 1 in the loss; dpo.loss_type=orpo) is TRL's: the NLL of
  EVERY label of the chosen sequences (prompt and completion, TRL's ORPOTrainer
  cross-entropy over the chosen rows), aggregated with per-sequence weights
  (PairBatch.sequence_nll_weights, loss.agg_mode over the chosen sides' full lengths of the
  global batch: token-mean divides by all their tokens): again a plain weighted token sum
  over the real tokens (seq_ids >= 0), exact on every layout; never a micro-batch mean.
- `logits/chosen`, `logits/rejected` (TRL 1.16's DPOTrainer metrics): the mean over the
  vocabulary of the policy's logits at each completion token (label position), averaged
  over all completion tokens of that side in the global batch: a token sum over this
  micro-batch's tokens divided by the global token count, so it sums over micro-batches, CP
  shards and DP ranks like `nll` (the vocabulary mean is all-reduced over TP first).
- Evaluation over more pairs than one batch (engine.dpo.training.evaluate) passes the whole
  set's completion counts as `PairBatch.report_counts` and its NLL weights: each chunk then
  reports its share of the whole set's means, and the chunks' reports simply add up.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from engine.dpo.pair_loss import ORPO_EXTRAS, PairLossSettings, pair_gradients
from engine.training.loss import aggregate
from engine.training.loss_head import HiddenStates
# the CP group summing a sequence's shards; the invariance harness's negative control replaces
# this module's name for it (per-shard sums)
from engine.training.rank_batch import context_parallel_group as cp_group
from engine.training.schedule import LossFn
from engine.training.token_losses import token_logprobs

REPORT_KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
               "rewards/margins", "logps/chosen", "logps/rejected", "nll", "logits/chosen",
               "logits/rejected")
ORPO_REPORT_KEYS = ("nll_loss",) + ORPO_EXTRAS    # TRL's ORPOTrainer names, besides REPORT_KEYS
_ROW_CHUNK = 4096   # vocabulary rows (or tokens) per float64 chunk of token_mean_logits


@dataclass
class PairBatch:
    """What every micro-batch's loss needs about the whole global batch (same on all ranks).

    counts: [2P] completion tokens per sequence (float64); ref: [2P] the reference's
    completion log-prob sums (None for reference-free loss types); rpo_alpha: weight of the
    chosen NLL in the loss (0: logged only); report_counts: [2Q] the completion counts of
    the Q pairs the reports average over, this batch among them (None: this batch, Q = P;
    evaluation in chunks passes the whole eval set's); sequence_nll_weights: [2P] orpo's
    per-sequence weights of the NLL over every label of a sequence (0 on rejected sides;
    None for the other loss types)."""

    settings: PairLossSettings
    counts: torch.Tensor
    ref: torch.Tensor | None
    rpo_alpha: float = 0.0
    report_counts: torch.Tensor | None = None
    sequence_nll_weights: torch.Tensor | None = None

    @property
    def num_pairs(self) -> int:
        return self.counts.numel() // 2

    @property
    def report_pairs(self) -> int:
        """Q: the pairs the per-pair reports are averaged over."""
        if self.report_counts is None:
            return self.num_pairs
        return self.report_counts.numel() // 2

    def report_tokens(self) -> tuple[float, float]:
        """(chosen, rejected) completion tokens the per-token reports are averaged over."""
        counts = self.counts if self.report_counts is None else self.report_counts
        return float(counts[0::2].sum()), float(counts[1::2].sum())


def report_keys(settings: PairLossSettings) -> tuple[str, ...]:
    """The keys dpo_loss_fn reports for this loss type."""
    return REPORT_KEYS + (ORPO_REPORT_KEYS if settings.loss_type == "orpo" else ())


def sequence_nll(logp: torch.Tensor, seq_ids: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
    """sum over real tokens t (seq_ids >= 0) of -logp_t * weights[seq of t]: the micro-batch's
    share of a per-sequence weighted NLL over EVERY label (loss mask ignored), differentiable
    in logp. The invariance harness's negative control replaces it (a micro-batch mean)."""
    ids = seq_ids.long()
    w = torch.where(ids >= 0, weights.to(logp.device)[ids.clamp(min=0)],
                    torch.zeros((), dtype=weights.dtype, device=logp.device))
    return -(logp * w.to(logp.dtype)).sum()


def _cp_rank() -> int:
    return ps.get_context_parallel_rank() if ps.model_parallel_is_initialized() else 0


def sequence_table(logp: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor,
                   size: int) -> torch.Tensor:
    """[size, 2] float64, detached: per mini-batch position, the sum of logp * mask over the
    whole sequence and the number of its (non-padding) tokens, summed over the CP group."""
    ids = seq_ids.reshape(-1).long()
    valid = ids >= 0
    safe = torch.where(valid, ids, torch.zeros_like(ids))
    table = torch.zeros(size, 2, dtype=torch.float64, device=logp.device)
    values = (logp.detach().reshape(-1).to(torch.float64)
              * mask.reshape(-1).to(torch.float64) * valid)
    table[:, 0].index_add_(0, safe, values)
    table[:, 1].index_add_(0, safe, valid.to(torch.float64))
    group = cp_group()
    if group is not None:
        dist.all_reduce(table, group=group)
    return table


def _vocab_rows(local: int, vocab_size: int, device) -> torch.Tensor:
    """[local] bool: which of this TP rank's vocabulary rows are real (not megatron's
    padding)."""
    start = ps.get_tensor_model_parallel_rank() * local if ps.model_parallel_is_initialized() \
        else 0
    return torch.arange(start, start + local, device=device) < vocab_size


def _tp_sum(t: torch.Tensor) -> torch.Tensor:
    if ps.model_parallel_is_initialized():
        group = ps.get_tensor_model_parallel_group()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(t, group=group)
    return t


def token_mean_logits(logits: torch.Tensor | HiddenStates, vocab_size: int) -> torch.Tensor:
    """[b, s] float64, no gradient: the mean of the logits over the real vocabulary (the first
    `vocab_size` ids, the HF model's) at every position, TRL's `mean_logits`. From
    vocab-parallel logits [b, s, V/tp], or from the chunked head's HiddenStates as the hidden
    state times the mean of the output weight's real rows (the logits are never built).
    Float64 in chunks of _ROW_CHUNK rows or tokens. Collective over the TP group."""
    chunked = isinstance(logits, HiddenStates)
    with torch.no_grad():
        if chunked:   # sum_v (h . w_v) / V = h . (sum_v w_v / V), summed over TP first
            w = logits.weight
            keep = _vocab_rows(w.shape[0], vocab_size, w.device)
            mean_row = torch.zeros(w.shape[1], dtype=torch.float64, device=w.device)
            for i in range(0, w.shape[0], _ROW_CHUNK):
                mean_row += (w[i:i + _ROW_CHUNK].double() * keep[i:i + _ROW_CHUNK, None]).sum(0)
            vec, source = _tp_sum(mean_row) / vocab_size, logits.hidden
        else:         # this rank's share of the mean, summed over TP after
            keep = _vocab_rows(logits.shape[-1], vocab_size, logits.device)
            vec, source = keep.to(torch.float64) / vocab_size, logits
        flat = source.reshape(-1, source.shape[-1])
        out = torch.zeros(flat.shape[0], dtype=torch.float64, device=flat.device)
        for i in range(0, flat.shape[0], _ROW_CHUNK):
            out[i:i + _ROW_CHUNK] = flat[i:i + _ROW_CHUNK].double() @ vec
        if not chunked:
            out = _tp_sum(out)
        return out.reshape(source.shape[:-1])


def dpo_loss_fn(batch: PairBatch, vocab_size: int) -> LossFn:
    """Loss function (engine.training.schedule contract) of one step, reporting
    report_keys(batch.settings)."""
    s, n, size = batch.settings, batch.num_pairs, batch.counts.numel()
    scale = 1.0 / n if n else 0.0
    q = batch.report_pairs
    report_scale = 1.0 / q if q else 0.0
    tokens_c, tokens_r = batch.report_tokens()

    def loss_fn(logits, mb):
        logp = token_logprobs(logits, mb.labels, vocab_size)
        mask = mb.loss_mask.to(logp.dtype)
        table = sequence_table(logp, mask, mb.seq_ids, size)
        present = table[:, 1] > 0
        pairs = torch.nonzero(present[0::2], as_tuple=True)[0]
        if not bool((present[0::2] == present[1::2]).all()):
            raise RuntimeError("a preference pair's sides are in different micro-batches: plan "
                               "the mini-batch with units (engine.dpo.loss_fn)")
        c, r = 2 * pairs, 2 * pairs + 1
        counts = batch.counts.to(table.device)
        ref = batch.ref.to(table.device) if batch.ref is not None else None
        terms, g_c, g_r = pair_gradients(
            s, table[c, 0], table[r, 0], None if ref is None else ref[c],
            None if ref is None else ref[r], counts[c], counts[r], scale)
        coef = torch.zeros(size, dtype=torch.float64, device=table.device)
        coef[c], coef[r] = g_c, g_r
        ids = mb.seq_ids.long()
        token_coef = torch.where(ids >= 0, coef[ids.clamp(min=0)], torch.zeros_like(coef[:1]))
        nll = aggregate(-logp, mb.token_weights)
        loss = (logp * mask * token_coef.to(logp.dtype)).sum() + batch.rpo_alpha * nll
        extra = {}
        if batch.sequence_nll_weights is not None:   # orpo: + the chosen sequences' NLL
            seq_nll = sequence_nll(logp, mb.seq_ids, batch.sequence_nll_weights)
            loss = loss + seq_nll
            extra["nll_loss"] = seq_nll.detach().to(torch.float64)
        once = 1.0 if _cp_rank() == 0 else 0.0
        pair_sum = (lambda v: v.sum().detach().to(torch.float64) * (report_scale * once))
        mean_logits = token_mean_logits(logits, vocab_size) * mask.to(torch.float64)
        chosen_token = (ids >= 0) & (ids % 2 == 0)
        rejected_token = (ids >= 0) & (ids % 2 == 1)
        value = pair_sum(terms.loss) + extra.get("nll_loss", 0.0)
        extra.update({k: pair_sum(v) for k, v in terms.extras.items()})
        reports = {
            **extra,
            "loss": value + batch.rpo_alpha * nll.detach().to(torch.float64),
            "rewards/chosen": pair_sum(terms.chosen_rewards),
            "rewards/rejected": pair_sum(terms.rejected_rewards),
            "rewards/accuracies": pair_sum((terms.chosen_rewards > terms.rejected_rewards)
                                           .to(torch.float64)),
            "rewards/margins": pair_sum(terms.chosen_rewards - terms.rejected_rewards),
            "logps/chosen": pair_sum(terms.chosen_logps),
            "logps/rejected": pair_sum(terms.rejected_logps),
            "nll": nll.detach(),
            "logits/chosen": mean_logits[chosen_token].sum() / max(tokens_c, 1.0),
            "logits/rejected": mean_logits[rejected_token].sum() / max(tokens_r, 1.0)}
        return loss, reports

    return loss_fn
