"""Generalized advantage estimation for PPO with a critic (`advantage.estimator=gae`;
docs/algorithms.md), as verl 0.9.1 computes it (core_algos.compute_gae_advantage_return and
torch_functional.masked_whiten).

Token-level, over a response of T positions with mask m_t (1 on sampled tokens; multi-turn
observation tokens 0), values V_t (the critic's value of the state before token t) and
rewards r_t (the response's reward on its last sampled token, 0 elsewhere), from the end:

    delta_t = r_t + gamma * V_next - V_t
    A_t     = delta_t + gamma * lam * A_next
    where m_t = 1 sets V_next = V_t and A_next = A_t for the position before; m_t = 0 keeps
    both (observation tokens are skipped: no value, no TD error).
    returns R_t = A_t + V_t (before whitening).

Advantages are then whitened over every sampled token of the WHOLE rollout batch:
(A - mean) / sqrt(var + 1e-8), var the unbiased (Bessel-corrected) masked variance. Every
rank holds the whole batch, so the result does not depend on the layout. No collective.
"""
from __future__ import annotations

import torch

# Token-level estimators: computed after the rollout from the critic's values (the collector
# leaves their advantages to the log-prob stage, engine.rl.policy.critic.attach_gae).
TOKEN_ESTIMATORS = ("gae",)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(values - mean) * rsqrt(var + 1e-8) over mask (unbiased variance; needs >= 2 tokens)."""
    count = mask.sum()
    if count < 2:
        raise ValueError(f"whitening needs at least 2 masked elements, got {int(count)}")
    mean = (values * mask).sum() / count
    var = (((values - mean) ** 2) * mask).sum() / count * (count / (count - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(whitened advantages, returns), both [B, T] like the inputs (module docstring)."""
    next_value = torch.zeros_like(values[:, 0])
    last = torch.zeros_like(values[:, 0])
    out = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * last
        m = mask[:, t]
        next_value = values[:, t] * m + (1 - m) * next_value
        last = running * m + (1 - m) * last
        out.append(last)
    advantages = torch.stack(out[::-1], dim=1)
    returns = advantages + values
    return masked_whiten(advantages, mask), returns


def token_rewards(rewards: list[float], masks: list[list[int]], width: int) -> torch.Tensor:
    """[B, width] float64: response b's reward on its last masked position, 0 elsewhere (a
    response without a sampled token gets none)."""
    out = torch.zeros(len(rewards), width, dtype=torch.float64)
    for b, (reward, mask) in enumerate(zip(rewards, masks)):
        last = max((t for t, m in enumerate(mask) if m), default=None)
        if last is not None:
            out[b, last] = reward
    return out
