"""KTO's per-example loss (TRL 1.16 KTOTrainer, loss_type="kto") and its derivatives
(docs/preference.md, "KTO").

For example i with completion log-prob SUM s_i under the policy and ref_i under the frozen
reference, the log-ratio is z_i = s_i - ref_i and, with the batch's KL reference point kl
(engine.kto.loss_fn; a detached number >= 0):

    desirable (label true)      w_d * (1 - sigmoid(beta * (z_i - kl)))
    undesirable (label false)   w_u * (1 - sigmoid(beta * (kl - z_i)))

the rewards (`rewards/*`) are beta * z_i and `logps/*` are s_i. Float64 on small [n] tensors;
`example_gradients` gives d(scale * sum of losses)/d(s_i): the per-token coefficients of the
exact gradient (the reference point is detached, as TRL's `.detach()`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.preference.gradients import float64_gradients


@dataclass(frozen=True)
class KTOLossSettings:
    """kto.* keys the loss reads (engine.config.kto_settings validates them)."""

    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0


@dataclass
class ExampleTerms:
    """Per-example values [n] (float64)."""

    loss: torch.Tensor      # weighted loss
    rewards: torch.Tensor   # beta * (s - ref)
    logps: torch.Tensor     # s


def example_terms(s: KTOLossSettings, sums: torch.Tensor, ref: torch.Tensor,
                  labels: torch.Tensor, kl: torch.Tensor) -> ExampleTerms:
    """Losses and metrics of n examples from the policy's log-prob SUMS `sums` [n], the
    reference's `ref` [n], the boolean `labels` [n] and the reference point `kl` (a number)."""
    z = sums - ref
    desirable = 1 - torch.sigmoid(s.beta * (z - kl))
    undesirable = 1 - torch.sigmoid(s.beta * (kl - z))
    loss = torch.where(labels, s.desirable_weight * desirable,
                       s.undesirable_weight * undesirable)
    return ExampleTerms(loss, s.beta * z.detach(), sums.detach())


def example_gradients(s: KTOLossSettings, sums: torch.Tensor, ref: torch.Tensor,
                      labels: torch.Tensor, kl: torch.Tensor, scale: float
                      ) -> tuple[ExampleTerms, torch.Tensor]:
    """(example_terms, g): g = d(scale * sum_i loss_i) / d(sums) per example, float64 [n]
    (engine.preference.gradients; works inside torch.no_grad)."""
    def loss_of(leaf):
        terms = example_terms(s, leaf, ref.to(torch.float64), labels,
                              kl.detach().to(torch.float64))
        return terms.loss, terms

    terms, (g,) = float64_gradients(loss_of, (sums,), scale)
    terms.loss = terms.loss.detach()
    return terms, g
