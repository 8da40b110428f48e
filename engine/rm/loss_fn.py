"""The reward model's micro-batch loss (Bradley-Terry): whole pairs meet in one loss term.

The score r of a sequence is the score head (models.layers.heads.value, no bias) applied to the
final-norm hidden state of its LAST token. Sequences enter as engine.rm.training.score_sequence
makes them: tokens = the side's ids up to its last trained (end-of-turn) token, loss_mask = 1
on the last position only, so r = sum_t value_t * loss_mask_t.

Per pair k (chosen c, rejected r, the row's margin m_k, 0 when the row has none; c_center =
rm.center_rewards_coefficient, 0 when off), as TRL's RewardTrainer:

    loss_k = -logsigmoid(r_c - r_r - m_k) + c_center * (r_c + r_r)^2,   loss = mean_k loss_k

Layout contract (the same as DPO's, the preference core's: engine.preference.table): the
mini-batch is [c_0, r_0, c_1, ...] planned with pair units, so a pair's sides share a
micro-batch of one DP rank; under CP each sequence's score is summed over the CP group
(sequence_table; only the CP rank holding the last token contributes); TP ranks hold the same
scores (the head all-reduces over TP); the last pipeline stage computes the loss. The loss is
non-linear in the scores, so the micro-batch's differentiable loss is
sum_t g(seq(t)) * value_t * loss_mask_t (coefficient_loss) with g = d(loss / P)/d(score) from
the detached scores (engine.preference.gradients), P the GLOBAL pair count: megatron's
per-token loss contract sums it over micro-batches, CP and DP unchanged. Reports are sums over
pairs of value / Q, counted on CP rank 0 only (report_share), Q = P in training; evaluation in
chunks passes the whole eval set's pair count (RewardBatch.total_pairs), so the chunks'
reports add up (engine.preference.evaluation).

Metric names are TRL 1.16 RewardTrainer's: `accuracy`, `margin` (mean r_c - r_r),
`mean_reward`, `min_reward`, `max_reward` (over both sides of every pair), plus
`rewards/chosen` and `rewards/rejected` (each side's mean score; TRL logs no name for them).
min and max are not sums: the loss function also writes every score into
RewardBatch.scores (TP rank 0, CP rank 0 of the last stage), and `score_extremes` sums that
table over the world once the step's passes are done.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps

from engine.preference.gradients import float64_gradients
from engine.preference.table import (coefficient_loss, cp_share, present_pairs, report_share,
                                     sequence_table)
from engine.training.schedule import LossFn

REPORT_KEYS = ("loss", "accuracy", "margin", "mean_reward", "rewards/chosen", "rewards/rejected")
EXTREME_KEYS = ("min_reward", "max_reward")


@dataclass
class RewardBatch:
    """What every micro-batch's loss needs about the whole global batch (same on all ranks).

    margins: [P] float64, each pair's margin (0 where its row has none); center: the
    center_rewards coefficient (0: off); scores: [2P] float64, filled by the loss function
    ([c_0, r_0, c_1, ...], this rank's pairs only; score_extremes sums it over the world);
    total_pairs: the Q pairs the reports average over (None: this batch's P; evaluation in
    chunks passes the whole eval set's)."""

    margins: torch.Tensor
    center: float = 0.0
    scores: torch.Tensor | None = None
    total_pairs: int | None = None

    def __post_init__(self) -> None:
        if self.scores is None:
            self.scores = torch.zeros(2 * self.margins.numel(), dtype=torch.float64)

    @property
    def num_pairs(self) -> int:
        return self.margins.numel()

    @property
    def report_pairs(self) -> int:
        """Q: the pairs the reports are averaged over."""
        return self.num_pairs if self.total_pairs is None else self.total_pairs


def pair_losses(chosen: torch.Tensor, rejected: torch.Tensor, margins: torch.Tensor,
                center: float) -> torch.Tensor:
    """[P] Bradley-Terry losses of scores `chosen`, `rejected` [P] (module docstring)."""
    loss = -F.logsigmoid(chosen - rejected - margins)
    if center:
        loss = loss + center * (chosen + rejected) ** 2
    return loss


def score_gradients(chosen: torch.Tensor, rejected: torch.Tensor, margins: torch.Tensor,
                    center: float, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(losses [P], d(scale * sum loss)/d chosen, .../d rejected), float64, detached."""
    def loss_of(c, r):
        loss = pair_losses(c, r, margins.to(torch.float64), center)
        return loss, loss

    loss, (g_c, g_r) = float64_gradients(loss_of, (chosen, rejected), scale)
    return loss.detach(), g_c, g_r


def score_extremes(batch: RewardBatch) -> dict[str, float]:
    """{min_reward, max_reward} over every score of the batch's pairs (both sides), after the
    step's forward passes filled batch.scores; collective over the world (every rank gets the
    same numbers)."""
    table = batch.scores.clone()
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(table)
    if table.numel() == 0:
        return dict.fromkeys(EXTREME_KEYS, 0.0)
    return {"min_reward": float(table.min()), "max_reward": float(table.max())}


def rm_loss_fn(batch: RewardBatch, head) -> LossFn:
    """Loss function (engine.training.schedule contract; it takes hidden states) of one step,
    reporting REPORT_KEYS; `head`: this rank's score head (the last stage's)."""
    n, size = batch.num_pairs, 2 * batch.margins.numel()
    scale = 1.0 / n if n else 0.0
    total = report_share(batch.report_pairs)

    def loss_fn(output, mb):
        values = head(output.hidden)
        mask = mb.loss_mask.to(values.dtype)
        table = sequence_table(values, mask, mb.seq_ids, size)
        pairs, c, r = present_pairs(table, "engine.rm.loss_fn")
        scores = table[:, 0]
        losses, g_c, g_r = score_gradients(scores[c], scores[r],
                                           batch.margins.to(table.device)[pairs],
                                           batch.center, scale)
        loss = coefficient_loss(values, mask, torch.cat([c, r]), torch.cat([g_c, g_r]),
                                mb.seq_ids, size)
        if cp_share() and ps.get_tensor_model_parallel_rank() == 0:
            seen = torch.cat([c, r])
            batch.scores[seen.cpu()] = scores[seen].detach().to(torch.float64).cpu()
        reports = {"loss": total(losses),
                   "accuracy": total((scores[c] > scores[r]).to(torch.float64)),
                   "margin": total(scores[c] - scores[r]),
                   "mean_reward": total(scores[c] + scores[r]) / 2,
                   "rewards/chosen": total(scores[c]),
                   "rewards/rejected": total(scores[r])}
        return loss, reports

    return loss_fn
