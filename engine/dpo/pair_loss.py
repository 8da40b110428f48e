"""The per-pair preference losses (TRL's formulas) and their derivatives (docs/preference.md).

For pair k with chosen side c and rejected side r, s_c and s_r are the policy's log-probs of the
sides' completion tokens: their SUM, or their MEAN (sum / completion tokens) for `ipo`,
`simpo` and `orpo`, as TRL computes them; ref_c and ref_r the same for the frozen reference
(the same sum/mean rule). With the log-ratio difference

    delta = (s_c - ref_c) - (s_r - ref_r)         (ipo: of the means)

and beta, label smoothing eps, gamma:

    sigmoid   -(1 - eps) logsigmoid(beta delta) - eps logsigmoid(-beta delta)  (cDPO if eps > 0)
    robust    (-(1 - eps) logsigmoid(beta delta) + eps logsigmoid(-beta delta)) / (1 - 2 eps)
    hinge     relu(1 - beta delta)
    ipo       (delta - 1 / (2 beta))^2
    simpo     z = beta (s_c - s_r) - gamma (reference-free; TRL's CPOTrainer, cpo_alpha=0):
              -(1 - eps) logsigmoid(z) - eps logsigmoid(-z)
    orpo      -beta logsigmoid(log_odds),
              log_odds = (s_c - s_r) - (log1mexp(s_c) - log1mexp(s_r)),
              log1mexp(x) = log(1 - exp(x)) (reference-free; TRL's experimental
              ORPOTrainer.odds_ratio_loss, beta its lambda). ORPO's other term, the NLL of
              the chosen sequences, is a token loss (engine.dpo.loss_fn), not a pair term.

Rewards (the logged `rewards/*`): beta (s - ref) per side, beta s for simpo and orpo;
`logps/*` are s_c, s_r; orpo also gives TRL's per-pair `log_odds_ratio`
(logsigmoid(log_odds)) and `log_odds_chosen` (log_odds) in PairTerms.extras. Everything here
is float64 on small [P] tensors; `pair_gradients` gives d(sum of losses)/d(policy SUMS), the
per-token coefficients of the exact gradient (engine.dpo.loss_fn).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.preference.gradients import float64_gradients

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo", "orpo")
MEAN_TYPES = ("ipo", "simpo", "orpo")  # log-probs are per-token means, not sums
REFERENCE_FREE = ("simpo", "orpo")     # no reference model at all
ORPO_EXTRAS = ("log_odds_ratio", "log_odds_chosen")   # PairTerms.extras of orpo (TRL's names)
SMOOTHED = ("sigmoid", "robust", "simpo")  # types that take label_smoothing


@dataclass(frozen=True)
class PairLossSettings:
    """dpo.* keys the loss reads (engine.config.dpo_settings validates them)."""

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5

    @property
    def uses_reference(self) -> bool:
        return self.loss_type not in REFERENCE_FREE

    @property
    def uses_means(self) -> bool:
        return self.loss_type in MEAN_TYPES


@dataclass
class PairTerms:
    """Per-pair values [P] (float64)."""

    loss: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor     # s_c (sum or mean, as the loss type uses it)
    rejected_logps: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)   # ORPO_EXTRAS for orpo


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -ln 2 (TRL's orpo log1mexp)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)),
                       torch.log(-torch.expm1(x)))


def _orpo(beta: float, pc: torch.Tensor, pr: torch.Tensor) -> PairTerms:
    log_odds = (pc - pr) - (log1mexp(pc) - log1mexp(pr))
    ratio = F.logsigmoid(log_odds)
    return PairTerms(-beta * ratio, beta * pc.detach(), beta * pr.detach(), pc.detach(),
                     pr.detach(), {"log_odds_ratio": ratio.detach(),
                                   "log_odds_chosen": log_odds.detach()})


def _smoothed(z: torch.Tensor, eps: float) -> torch.Tensor:
    return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)


def pair_terms(s: PairLossSettings, sum_c: torch.Tensor, sum_r: torch.Tensor,
               ref_c: torch.Tensor | None, ref_r: torch.Tensor | None,
               n_c: torch.Tensor, n_r: torch.Tensor) -> PairTerms:
    """Losses and metrics of P pairs from the policy's log-prob SUMS `sum_c`, `sum_r` [P],
    the reference's SUMS `ref_c`, `ref_r` [P] (None for reference-free types) and the
    completion token counts `n_c`, `n_r` [P] (a side with no token counts as 1, as TRL's
    clamp(min=1))."""
    if s.uses_means:
        pc, pr = sum_c / n_c.clamp(min=1), sum_r / n_r.clamp(min=1)
    else:
        pc, pr = sum_c, sum_r
    if s.loss_type == "simpo":
        z = s.beta * (pc - pr) - s.simpo_gamma
        return PairTerms(_smoothed(z, s.label_smoothing), s.beta * pc.detach(),
                         s.beta * pr.detach(), pc.detach(), pr.detach())
    if s.loss_type == "orpo":
        return _orpo(s.beta, pc, pr)
    if s.uses_means:
        rc, rr = ref_c / n_c.clamp(min=1), ref_r / n_r.clamp(min=1)
    else:
        rc, rr = ref_c, ref_r
    delta = (pc - rc) - (pr - rr)
    eps = s.label_smoothing
    if s.loss_type == "sigmoid":
        loss = _smoothed(s.beta * delta, eps)
    elif s.loss_type == "robust":
        loss = (-(1 - eps) * F.logsigmoid(s.beta * delta)
                + eps * F.logsigmoid(-s.beta * delta)) / (1 - 2 * eps)
    elif s.loss_type == "hinge":
        loss = torch.relu(1 - s.beta * delta)
    elif s.loss_type == "ipo":
        loss = (delta - 1 / (2 * s.beta)) ** 2
    else:
        raise ValueError(f"dpo.loss_type={s.loss_type!r} is not valid; choose one of "
                         f"{', '.join(LOSS_TYPES)}")
    return PairTerms(loss, s.beta * (pc - rc).detach(), s.beta * (pr - rr).detach(),
                     pc.detach(), pr.detach())


def pair_gradients(s: PairLossSettings, sum_c: torch.Tensor, sum_r: torch.Tensor,
                   ref_c, ref_r, n_c: torch.Tensor, n_r: torch.Tensor, scale: float
                   ) -> tuple[PairTerms, torch.Tensor, torch.Tensor]:
    """(pair_terms, g_c, g_r): g = d(scale * sum_k loss_k) / d(policy sum) per pair, float64
    [P] (engine.preference.gradients; works inside torch.no_grad)."""
    def loss_of(leaf_c, leaf_r):
        terms = pair_terms(s, leaf_c, leaf_r, ref_c, ref_r, n_c.to(torch.float64),
                           n_r.to(torch.float64))
        return terms.loss, terms

    terms, (g_c, g_r) = float64_gradients(loss_of, (sum_c, sum_r), scale)
    terms.loss = terms.loss.detach()
    return terms, g_c, g_r
