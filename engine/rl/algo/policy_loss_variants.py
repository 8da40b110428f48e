"""Policy losses beyond PPO's clipped surrogate, registered by verl's names (docs/algorithms.md):
gspo, geo_mean (GMPO), cispo, sapo; plus the REINFORCE loss of rollout_correction's bypass
mode. Import POLICY_LOSSES from here: it is the complete table.

Every function returns a *per-token* loss whose weighted token sum (GlobalLossNormalizer weights,
engine.training.loss) is the loss, for every aggregation mode. Sequence-level quantities come
from ``ctx.seqs`` (engine.rl.algo.seq_reduce: detached sums over the WHOLE sequence, exact under CP
sharding and packing), never from the local shard. A sequence-level objective L_i(theta) is
written per token so that value and gradient are exact:

    l_t = sg(L_i) * (1 + g_t - sg(g_t))    with  sum_t dg_t = n_i dL_i / sg(L_i)

(value L_i on each of the sequence's n_i tokens; gradient n_i dL_i): e.g. GMPO's
L_i = -A_i exp(mean_t c_t) has dL_i = L_i * sum_t dc_t / n_i, so g_t = c_t.
"""
from __future__ import annotations

import torch

from engine.rl.algo.policy_loss import (MAX_LOG_RATIO, POLICY_LOSSES, PolicyLossContext,
                                        PolicyLossTerms, check_same_shape, apply_is_weights,
                                        register_policy_loss)

__all__ = ["POLICY_LOSSES", "reinforce_loss"]

# GSPO's clamp of the per-token log of the sequence ratio (verl compute_policy_loss_gspo).
GSPO_MAX_LOG_RATIO = 10.0


def _terms(loss, ratio, low=None, high=None) -> PolicyLossTerms:
    zeros = torch.zeros_like(ratio)
    f = ratio.dtype
    return PolicyLossTerms(loss=loss, clipped_low=zeros if low is None else low.to(f),
                           clipped_high=zeros if high is None else high.to(f),
                           dual_clipped=zeros, ratio=ratio.detach())


@register_policy_loss("gspo")
def gspo(logprobs, old_logprobs, advantages, settings, ctx: PolicyLossContext):
    """GSPO (Zheng et al. 2025): sequence ratio s_i = exp(mean_t (logp - old)) over the whole
    sequence, token ratio s_it = sg(s_i) * pi_t / sg(pi_t) (log clamped at 10), loss
    max(-A s_it, -A clip(s_it, 1 - eps_low, 1 + eps_high)) times the rollout IS weight. No dual
    clip. loss.agg_mode applies, as verl 0.9.1 applies its loss_agg_mode (all five modes give
    verl's numbers; the GSPO paper and verl's GSPO example scripts use seq-mean-token-mean)."""
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    adv = advantages.detach().to(logprobs.dtype)
    (seq_log_ratio,) = ctx.seqs.means(logprobs - old_logprobs.detach())
    log_s = (logprobs - logprobs.detach() + seq_log_ratio.to(logprobs.dtype)).clamp(
        max=GSPO_MAX_LOG_RATIO)
    s = torch.exp(log_s)
    loss = torch.maximum(-adv * s, -adv * s.clamp(1.0 - settings.eps_low, 1.0 + settings.eps_high))
    r = s.detach()
    return _terms(apply_is_weights(loss, ctx), r, (adv < 0) & (r < 1.0 - settings.eps_low),
                  (adv > 0) & (r > 1.0 + settings.eps_high))


@register_policy_loss("geo_mean")
def geo_mean(logprobs, old_logprobs, advantages, settings, ctx: PolicyLossContext):
    """GMPO (Zhao et al. 2025), verl compute_policy_loss_geo_mean: per token the log-ratio d_t
    clipped to [-eps_low, eps_high] on the side the advantage's sign selects,
    c_t = sign(A) min(sign(A) d_t, sign(A) clip(d_t)); sequence loss
    L_i = -mean_t(A) * exp(mean_t c_t) * exp(mean_t log(w_t + 1e-10)) (geometric mean of the
    rollout IS weights w); per token l_t = sg(L_i) (1 + c_t - sg(c_t)) (module docstring). With
    seq-mean-token-mean this is verl's mean over sequences; other modes weigh L_i as they weigh
    any per-token loss."""
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    adv = advantages.detach().to(logprobs.dtype)
    d = logprobs - old_logprobs.detach()
    sign = torch.sign(adv)
    d_clip = d.clamp(-settings.eps_low, settings.eps_high)
    c = sign * torch.minimum(sign * d, sign * d_clip)
    values = [c, adv] + ([torch.log(ctx.is_weights + 1e-10)] if ctx.is_weights is not None
                         else [])
    means = ctx.seqs.means(*values)
    seq_loss = -means[1] * torch.exp(means[0])
    if ctx.is_weights is not None:
        seq_loss = seq_loss * torch.exp(means[2])
    loss = seq_loss.to(logprobs.dtype) * (1.0 + c - c.detach())
    clipped = (d != d_clip).detach()
    return _terms(loss, torch.exp(d.detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)),
                  clipped & (adv < 0), clipped & (adv > 0))


@register_policy_loss("cispo")
def cispo(logprobs, old_logprobs, advantages, settings, ctx: PolicyLossContext):
    """CISPO (MiniMax-M1, 2025): loss -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp (a
    REINFORCE term with a clipped, stop-gradient IS weight; r's log clamped to +-20), times the
    rollout IS weight. clipped_low / clipped_high: r below / above the clip range (any sign of
    A, verl's pg_clipfrac counts both)."""
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    adv = advantages.detach().to(logprobs.dtype)
    r = torch.exp((logprobs - old_logprobs.detach()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    clipped = r.clamp(1.0 - settings.eps_low, 1.0 + settings.eps_high).detach()
    loss = -clipped * adv * logprobs
    rd = r.detach()
    return _terms(apply_is_weights(loss, ctx), rd, rd < 1.0 - settings.eps_low,
                  rd > 1.0 + settings.eps_high)


@register_policy_loss("sapo")
def sapo(logprobs, old_logprobs, advantages, settings, ctx: PolicyLossContext):
    """SAPO (Gao et al. 2025), verl compute_policy_loss_sapo: soft gate instead of a clip,
    f(r) = sigmoid(tau (r - 1)) * 4 / tau with tau = sapo.tau_pos where A > 0, else
    sapo.tau_neg; loss -f(r) * A (r's log clamped to +-20), times the rollout IS weight. No
    clip indicators (0). verl 0.9.1 aggregates sapo with seq-mean-token-mean whatever
    loss_agg_mode says; here loss.agg_mode applies (seq-mean-token-mean gives verl's numbers)."""
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    adv = advantages.detach().to(logprobs.dtype)
    r = torch.exp((logprobs - old_logprobs.detach()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    tau = torch.where(adv > 0, torch.full_like(adv, settings.tau_pos),
                      torch.full_like(adv, settings.tau_neg))
    gate = torch.sigmoid(tau * (r - 1.0)) * (4.0 / tau)
    return _terms(apply_is_weights(-gate * adv, ctx), r.detach())


def reinforce_loss(logprobs, advantages, ctx: PolicyLossContext) -> PolicyLossTerms:
    """Bypass mode's loss_type=reinforce (verl compute_policy_loss_reinforce): -A * logp * w
    with w the detached rollout IS weight of the current policy (1 without rollout IS). The
    reported ratio is w (1 without IS)."""
    adv = advantages.detach().to(logprobs.dtype)
    loss = apply_is_weights(-adv * logprobs, ctx)
    ratio = (ctx.is_weights.detach().to(logprobs.dtype) if ctx.is_weights is not None
             else torch.ones_like(logprobs))
    return _terms(loss, ratio)
