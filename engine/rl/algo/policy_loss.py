"""Per-token policy-gradient terms for GRPO / DAPO (docs/design/rl.md).

Everything here is *per token*: each function returns a tensor with the shape of its log-prob
inputs (``[..., T]``, any leading shape) and never reduces. Aggregation over tokens and sequences
happens in the loss layer with per-sequence weights (docs/design/loss-math.md), the same weights for the
policy loss, the KL penalty and the entropy bonus. No function here runs a collective.

Constants of the old policy (``old_logprobs``, ``ref_logprobs``, ``advantages``) are detached
inside, so gradients flow only into ``logprobs`` / ``logits``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from engine.rl.algo.registry import registrar

# |log ratio| is clamped to this before exp(): exp(20) ~ 4.9e8 is far beyond any clip range, and
# the clamp keeps garbage log-probs on masked tokens (advantage 0) from producing inf * 0 = NaN.
MAX_LOG_RATIO = 20.0

KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass
class PolicyLossTerms:
    """Per-token outputs of :func:`clipped_surrogate`; every field has the shape of ``logprobs``.

    The three indicator fields are float 0/1 and mutually exclusive. Each marks a token whose
    loss is a constant of ``logprobs`` (zero gradient) because a clip was selected:

    - ``clipped_low``: ``A < 0`` and ``ratio < 1 - eps_low``; the min() picked the clipped branch
      ``(1 - eps_low) * A``.
    - ``clipped_high``: ``A > 0`` and ``ratio > 1 + eps_high``; the min() picked the clipped
      branch ``(1 + eps_high) * A``.
    - ``dual_clipped``: dual clip enabled, ``A < 0`` and ``ratio > dual_c``; the loss was capped
      at ``dual_c * |A|``.

    ``loss`` carries the autograd graph; the indicators and ``ratio`` (for metrics) are detached.
    """

    loss: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor
    dual_clipped: torch.Tensor
    ratio: torch.Tensor


def check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"per-token inputs must have the same shape, got {shapes}")


def clipped_surrogate(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                      advantages: torch.Tensor, eps_low: float, eps_high: float,
                      dual_c: float | None = None) -> PolicyLossTerms:
    """PPO clipped surrogate per token, with asymmetric clip ("clip higher") and dual clip.

    ``ratio = exp(logprobs - old_logprobs)`` (log ratio clamped to +-MAX_LOG_RATIO);
    ``loss = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)``; with ``dual_c``
    (must be > 1), tokens with ``A < 0`` get ``loss = min(loss, dual_c * |A|)`` (Ye et al. 2020,
    dual-clip PPO). ``advantages`` is already broadcast per token (same shape as ``logprobs``).
    """
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    if eps_low < 0 or eps_high < 0 or eps_low >= 1:
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got eps_low={eps_low}, "
                         f"eps_high={eps_high}")
    if dual_c is not None and dual_c <= 1:
        raise ValueError(f"dual_c must be > 1 (or None to disable), got {dual_c}")
    old_logprobs = old_logprobs.detach()
    advantages = advantages.detach().to(logprobs.dtype)

    log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = torch.maximum(unclipped, clipped)  # = -min(ratio*A, clip(ratio)*A)

    with torch.no_grad():
        r = ratio.detach()
        negative = advantages < 0
        clipped_low = negative & (r < 1.0 - eps_low)
        clipped_high = (advantages > 0) & (r > 1.0 + eps_high)
        if dual_c is not None:
            dual_clipped = negative & (r > dual_c)
        else:
            dual_clipped = torch.zeros_like(negative)

    if dual_c is not None:
        loss = torch.where(negative, torch.minimum(loss, -dual_c * advantages), loss)

    as_float = logprobs.dtype if logprobs.is_floating_point() else torch.float32
    return PolicyLossTerms(loss=loss, clipped_low=clipped_low.to(as_float),
                           clipped_high=clipped_high.to(as_float),
                           dual_clipped=dual_clipped.to(as_float), ratio=ratio.detach())


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs (Schulman 2020).

    With ``d = logprobs - ref_logprobs``:

    - ``k1``: ``d`` (unbiased, can be negative);
    - ``k2``: ``0.5 * d^2`` (>= 0, biased, low variance);
    - ``k3``: ``exp(-d) + d - 1`` (= exp(ref - logp) - (ref - logp) - 1; unbiased, >= 0). ``d`` is
      clamped to +-MAX_LOG_RATIO first so exp() cannot overflow.

    Raises ValueError for any other estimator name.
    """
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    diff = logprobs - ref_logprobs.detach()
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff.square()
    if estimator == "k3":
        neg = (-diff).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # log(pi_ref / pi)
        return torch.exp(neg) - neg - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")


@dataclass
class PolicyLossContext:
    """What a policy loss may use besides the per-token log-probs and advantages.

    - ``loss_mask`` [..., T] 0/1: trained tokens of this shard (rejected tokens already 0);
    - ``seqs``: engine.rl.algo.seq_reduce.SequenceReducer of the micro-batch: detached sums / means
      over whole sequences, exact under CP sharding, packing and micro-batching;
    - ``is_weights`` [..., T] or None: detached rollout-correction IS weights (decoupled mode,
      engine.rl.algo.rollout_correction), applied by the loss the way verl applies them.
    """

    loss_mask: torch.Tensor
    seqs: Any
    is_weights: torch.Tensor | None = None


def apply_is_weights(loss: torch.Tensor, ctx: PolicyLossContext) -> torch.Tensor:
    """``loss * is_weights`` per token (verl's ``pg_losses * rollout_is_weights``), or ``loss``
    when rollout IS is off."""
    return loss if ctx.is_weights is None else loss * ctx.is_weights.to(loss.dtype)


# Policy losses by name (`policy_loss=...`): fn(logprobs, old_logprobs, advantages, settings,
# ctx) -> PolicyLossTerms, per token; `settings` is engine.rl.policy.update.PolicyLossSettings, `ctx` a
# PolicyLossContext (sequence structure, rollout IS weights). A new loss is one registered
# function; the full table (with engine.rl.algo.policy_loss_variants) is imported from there.
PolicyLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any, PolicyLossContext],
                      PolicyLossTerms]
POLICY_LOSSES: dict[str, PolicyLoss] = {}

register_policy_loss = registrar(POLICY_LOSSES)


@register_policy_loss("ppo_clip")
def ppo_clip(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
             settings, ctx: PolicyLossContext) -> PolicyLossTerms:
    """GRPO/DAPO's token-level clipped surrogate (clip_surrogate with the clip.* settings),
    times the rollout IS weight (verl compute_policy_loss_vanilla)."""
    terms = clipped_surrogate(logprobs, old_logprobs, advantages, settings.eps_low,
                              settings.eps_high, settings.dual_c)
    terms.loss = apply_is_weights(terms.loss, ctx)
    return terms
