"""The DPO micro-batch loss: whole pairs meet in one loss term on every layout.

Layout contract (docs/preference.md, "What is exact"):
- The mini-batch is the sequence list [c_0, r_0, c_1, r_1, ...] (pair k = positions 2k, 2k+1)
  planned with units [[0, 1], [2, 3], ...] (engine.training.plan): both sides of a pair are in
  the SAME micro-batch of the SAME DP rank, whatever the DP size, micro-batch size, token
  budget or packing. `train.micro_batch_size` therefore counts pairs.
- Context parallelism spreads each side's tokens over the CP ranks: the per-sequence sums of
  the policy's completion log-probs are summed over the CP group (engine.preference.table.
  sequence_table: one all-reduce of a [2P, 2] float64 table per micro-batch).
- The pair loss is non-linear in those sums; its gradient is exact through the chain rule
  (engine.preference.table.coefficient_loss), g_side = dL/d(side's sum) from the detached
  sums (engine.dpo.pair_loss.pair_gradients).
- Reported values are sums over pairs of (value / P) with P the GLOBAL pair count, counted on
  CP rank 0 only (engine.preference.table.report_share): the mean over the pairs of the
  global batch once reduce_reports sums them over micro-batches and DP x CP.
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
  reports its share of the whole set's means, and the chunks' reports simply add up
  (engine.preference.evaluation).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.dpo.pair_loss import ORPO_EXTRAS, PairLossSettings, pair_gradients
from engine.preference.logits import side_mean_logits, token_mean_logits
from engine.preference.table import (coefficient_loss, present_pairs, report_share,
                                     sequence_table)
from engine.training.loss import aggregate
from engine.training.schedule import LossFn
from engine.training.token_losses import token_logprobs

REPORT_KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
               "rewards/margins", "logps/chosen", "logps/rejected", "nll", "logits/chosen",
               "logits/rejected")
ORPO_REPORT_KEYS = ("nll_loss",) + ORPO_EXTRAS    # TRL's ORPOTrainer names, besides REPORT_KEYS


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


def dpo_loss_fn(batch: PairBatch, vocab_size: int) -> LossFn:
    """Loss function (engine.training.schedule contract) of one step, reporting
    report_keys(batch.settings)."""
    s, n, size = batch.settings, batch.num_pairs, batch.counts.numel()
    scale = 1.0 / n if n else 0.0
    pair_sum = report_share(batch.report_pairs)
    tokens_c, tokens_r = batch.report_tokens()

    def loss_fn(logits, mb):
        logp = token_logprobs(logits, mb.labels, vocab_size)
        mask = mb.loss_mask.to(logp.dtype)
        table = sequence_table(logp, mask, mb.seq_ids, size)
        _, c, r = present_pairs(table, "engine.dpo.loss_fn")
        counts = batch.counts.to(table.device)
        ref = batch.ref.to(table.device) if batch.ref is not None else None
        terms, g_c, g_r = pair_gradients(
            s, table[c, 0], table[r, 0], None if ref is None else ref[c],
            None if ref is None else ref[r], counts[c], counts[r], scale)
        nll = aggregate(-logp, mb.token_weights)
        loss = (coefficient_loss(logp, mask, torch.cat([c, r]), torch.cat([g_c, g_r]),
                                 mb.seq_ids, size) + batch.rpo_alpha * nll)
        extra = {}
        if batch.sequence_nll_weights is not None:   # orpo: + the chosen sequences' NLL
            seq_nll = sequence_nll(logp, mb.seq_ids, batch.sequence_nll_weights)
            loss = loss + seq_nll
            extra["nll_loss"] = seq_nll.detach().to(torch.float64)
        mean_logits = token_mean_logits(logits, vocab_size)
        ids = mb.seq_ids.long()
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
            "logits/chosen": side_mean_logits(mean_logits, mask, (ids >= 0) & (ids % 2 == 0),
                                              tokens_c),
            "logits/rejected": side_mean_logits(mean_logits, mask, (ids >= 0) & (ids % 2 == 1),
                                                tokens_r)}
        return loss, reports

    # ORPO's NLL reads every label of the chosen rows, the prompt's too (TRL's ORPOTrainer):
    # the last layer must run there (engine.training.schedule.run_micro_batches)
    loss_fn.reads_unmasked_positions = batch.sequence_nll_weights is not None
    return loss_fn
