"""The KTO micro-batch loss: one example per planning unit, its loss exact on every layout.

Layout contract (docs/preference.md, "KTO"):
- The mini-batch is the global batch's examples [x_0, ..., x_{B-1}], each one sequence
  (prompt + completion) and one planning unit; `train.micro_batch_size` counts examples.
- The KL reference point is computed BEFORE this pass over the whole global batch
  (engine.kto.training.kl_reference_point): the mean over all B examples of the policy's minus
  the reference's completion log-prob sums on the mismatched sequences, clamped at 0 and
  detached. It is one number, the same on every rank, so no micro-batch, DP rank or CP shard
  ever estimates its own (`reference_point` is where the negative control swaps in a
  micro-batch estimate).
- Context parallelism spreads a sequence's tokens over the CP ranks: the per-sequence sums are
  summed over the CP group (engine.preference.table.sequence_table). The loss is non-linear in
  them; its gradient is exact through the chain rule (engine.preference.table.
  coefficient_loss, g = dL/d(sum) from the detached sums: engine.kto.loss.example_gradients).
- Reports are shares of global means: per-example values divided by the GLOBAL count of the
  examples they average (all B for `loss`; the desirable ones for `rewards/chosen`,
  `logps/chosen`; the undesirable ones for `*/rejected`), counted on CP rank 0 only
  (engine.preference.table.report_share); per-token values (`logits/*`, `entropy`) divided by
  the global completion-token counts. reduce_reports sums them over micro-batches and DP x CP.
  Evaluation in chunks passes the whole set's counts (ExampleBatch.report), so the chunks'
  reports add up. A side with no example in the batch (no token, for `logits/*`) reports 0
  here; `kto_metrics` then leaves its keys, and `rewards/margins`, out of the step's metrics
  (as TRL's KTOTrainer).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kto.loss import KTOLossSettings, example_gradients
from engine.preference.logits import side_mean_logits, token_mean_logits
from engine.preference.table import coefficient_loss, report_share, sequence_table
from engine.training.schedule import LossFn
from engine.training.token_losses import token_logprobs_and_entropy

REPORT_KEYS = ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected",
               "logits/chosen", "logits/rejected", "entropy")


@dataclass(frozen=True)
class ReportCounts:
    """The global counts the reports average over: examples, desirable and undesirable
    examples, and the completion tokens of the desirable, undesirable and all examples."""

    examples: float
    desirable: float
    undesirable: float
    desirable_tokens: float
    undesirable_tokens: float

    @classmethod
    def of(cls, counts: torch.Tensor, labels: torch.Tensor) -> "ReportCounts":
        d = labels.to(torch.bool)
        return cls(float(labels.numel()), float(d.sum()), float((~d).sum()),
                   float(counts[d].sum()), float(counts[~d].sum()))


@dataclass
class ExampleBatch:
    """What every micro-batch's loss needs about the whole global batch (same on all ranks).

    counts: [B] completion tokens (float64); ref: [B] the reference's completion log-prob
    sums; labels: [B] bool; kl: the reference point (float64 scalar, >= 0); kl_terms: [B] each
    example's policy-minus-reference sum on its mismatched sequence (kl = clamp(mean, 0));
    report: the counts the reports average over (None: this batch's)."""

    settings: KTOLossSettings
    counts: torch.Tensor
    ref: torch.Tensor
    labels: torch.Tensor
    kl: torch.Tensor
    kl_terms: torch.Tensor
    report: ReportCounts | None = None

    @property
    def num_examples(self) -> int:
        return self.counts.numel()

    def report_counts(self) -> ReportCounts:
        return self.report or ReportCounts.of(self.counts, self.labels)


def reference_point(batch: ExampleBatch, present: torch.Tensor) -> torch.Tensor:
    """The KL reference point the examples `present` (indices into the batch) use: the
    global batch's, whatever the micro-batch. The invariance harness's negative control
    replaces it (a mean over the micro-batch's own examples)."""
    return batch.kl


def kto_loss_fn(batch: ExampleBatch, vocab_size: int) -> LossFn:
    """Loss function (engine.training.schedule contract) of one step, reporting
    REPORT_KEYS."""
    s, size = batch.settings, batch.num_examples
    scale = 1.0 / size if size else 0.0
    r = batch.report_counts()
    per_example = report_share(r.examples)
    chosen, rejected = report_share(r.desirable), report_share(r.undesirable)

    def loss_fn(logits, mb):
        logp, entropy = token_logprobs_and_entropy(logits, mb.labels, vocab_size,
                                                   entropy_grad=False)
        mask = mb.loss_mask.to(logp.dtype)
        table = sequence_table(logp, mask, mb.seq_ids, size)
        idx = torch.nonzero(table[:, 1] > 0, as_tuple=True)[0]
        labels = batch.labels.to(table.device)[idx]
        kl = reference_point(batch, idx).to(table.device)
        terms, g = example_gradients(s, table[idx, 0], batch.ref.to(table.device)[idx],
                                     labels, kl, scale)
        loss = coefficient_loss(logp, mask, idx, g, mb.seq_ids, size)
        ids = mb.seq_ids.long()
        token_label = torch.where(ids >= 0, batch.labels.to(ids.device)[ids.clamp(min=0)],
                                  torch.zeros_like(ids, dtype=torch.bool))
        mean_logits = token_mean_logits(logits, vocab_size)
        total_tokens = r.desirable_tokens + r.undesirable_tokens
        reports = {
            "loss": per_example(terms.loss),
            "rewards/chosen": chosen(terms.rewards[labels]),
            "rewards/rejected": rejected(terms.rewards[~labels]),
            "logps/chosen": chosen(terms.logps[labels]),
            "logps/rejected": rejected(terms.logps[~labels]),
            "logits/chosen": side_mean_logits(mean_logits, mask, token_label,
                                              r.desirable_tokens),
            "logits/rejected": side_mean_logits(mean_logits, mask, ~token_label,
                                                r.undesirable_tokens),
            "entropy": (entropy.detach().to(torch.float64) * mask.to(torch.float64)).sum()
            / max(total_tokens, 1.0)}
        return loss, reports

    return loss_fn


def kto_metrics(out: dict, batch: ExampleBatch) -> dict[str, float]:
    """The step's (or evaluation's) KTO metrics from the reduced reports `out`: REPORT_KEYS,
    `kl` and `rewards/margins`, as TRL's KTOTrainer logs them: a side without an example
    (`logits/*`: without a completion token) in the batch has no `rewards/*`, `logps/*`,
    `logits/*` of its own, and `rewards/margins` needs both sides."""
    r = batch.report_counts()
    absent = [side for side, n in (("chosen", r.desirable), ("rejected", r.undesirable))
              if not n]
    absent_tokens = [side for side, n in (("chosen", r.desirable_tokens),
                                          ("rejected", r.undesirable_tokens)) if not n]
    drop = {f"{k}/{side}" for side in absent for k in ("rewards", "logps")}
    drop |= {f"logits/{side}" for side in absent_tokens}
    metrics = {**{k: out[k] for k in REPORT_KEYS if k not in drop}, "kl": float(batch.kl)}
    if not absent:
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return metrics
