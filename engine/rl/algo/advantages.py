"""Advantages: group-relative (GRPO, Dr. GRPO, RLOO) and REINFORCE++ (docs/algorithms.md).

Layout contract: a rollout batch holds G prompts with n responses each, stored *group-major*:
responses ``[g*n, (g+1)*n)`` belong to prompt ``g``. Every function here takes the flat
per-response reward vector ``[G*n]`` plus ``group_size = n``. These are pure, local functions:
they see the whole rollout batch on one process and run no collective.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from engine.rl.algo.registry import registrar


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """View ``rewards [G*n]`` as ``[G, n]`` (floating point), validating the layout."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [G*n], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards has {rewards.numel()} entries, not a multiple of group_size={group_size}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.float32)
    return rewards.view(-1, group_size)


def zero_std_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Bool ``[G]``: True where all ``group_size`` rewards of group g are exactly equal.

    Such groups carry no learning signal under GRPO (every advantage is 0). A group of size 1 is
    always zero-std.
    """
    grouped = _grouped(rewards, group_size)
    return (grouped == grouped[:, :1]).all(dim=1)


def group_advantages(rewards: torch.Tensor, group_size: int, norm_by_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """Per-response advantages ``[G*n]`` from group-major rewards ``[G*n]``.

    - ``norm_by_std=True`` (GRPO): ``A = (r - mean_g) / (std_g + eps)`` where ``std_g`` is the
      *sample* standard deviation of the group (Bessel-corrected, divisor n-1, torch.std's
      default), as in the GRPO reference implementations (TRL, verl).
    - ``norm_by_std=False`` (Dr. GRPO): ``A = r - mean_g``.

    Groups whose rewards are all equal (see :func:`zero_std_groups`) get exactly 0 advantages in
    both modes (never NaN, also for group_size 1 where the sample std is undefined, and never a
    rounding residue of ``mean_g`` divided by ``eps``). The result is floating point (float32 for
    integer rewards, else the input dtype) and detached from any autograd graph.
    """
    grouped = _grouped(rewards.detach(), group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if norm_by_std:
        if group_size > 1:
            std = grouped.std(dim=1, keepdim=True)  # unbiased (n - 1)
        else:
            std = torch.zeros_like(centered)
        centered = centered / (std + eps)
    constant = zero_std_groups(grouped.reshape(-1), group_size)
    advantages = torch.where(constant[:, None], torch.zeros_like(centered), centered)
    return advantages.reshape(-1)


def leave_one_out_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO: ``A_i = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean_g)`` per group of
    ``n = group_size >= 2``; groups of equal rewards get exactly 0."""
    grouped = _grouped(rewards.detach(), group_size)
    if group_size < 2:
        raise ValueError("leave-one-out advantages need group_size >= 2")
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    advantages = grouped - others
    constant = zero_std_groups(grouped.reshape(-1), group_size)
    return torch.where(constant[:, None], torch.zeros_like(advantages), advantages).reshape(-1)


def token_whiten(values: torch.Tensor, lengths: torch.Tensor, eps: float = 1e-8
                 ) -> torch.Tensor:
    """Whiten per-response values ``[B]`` as if broadcast over each response's tokens (verl
    masked_whiten of the token matrix): with n_i = lengths[i] and N = sum n_i,
    mean = sum_i n_i v_i / N, var = sum_i n_i (v_i - mean)^2 / (N - 1) (Bessel), result
    (v_i - mean) / sqrt(var + eps). Token-weighted: a long response weighs as many times as it
    has tokens. Statistics over the WHOLE input (the rollout batch), never a part of it."""
    v = values.detach().to(torch.float64)
    n = lengths.detach().to(torch.float64)
    total = float(n.sum())
    if total <= 0:
        return torch.zeros_like(values, dtype=torch.float32)
    mean = (n * v).sum() / total
    var = (n * (v - mean) ** 2).sum() / (total - 1) if total > 1 else torch.zeros(())
    return ((v - mean) * torch.rsqrt(var + eps)).to(torch.float32)


def reinforce_pp_advantages(rewards: torch.Tensor, lengths: torch.Tensor,
                            group_size: int | None = None) -> torch.Tensor:
    """REINFORCE++ (Hu 2025) for outcome rewards, verl's definitions with gamma = 1: every
    response token's return is the response's reward r_i; advantages are the returns whitened
    over all response tokens of the batch (token_whiten). With ``group_size`` (the
    ``_baseline`` variant) the group mean is subtracted first (0 for groups of one)."""
    r = _grouped(rewards.detach(), group_size or 1)
    if group_size is not None and group_size > 1:
        r = r - r.mean(dim=1, keepdim=True)
    return token_whiten(r.reshape(-1), lengths)


# Advantage estimators by name (`advantage.estimator=...`): fn(rewards [G*n] group-major,
# group_size, advantage config, lengths [G*n] response token counts) -> advantages [G*n],
# computed on the whole rollout batch (rank 0, before any split). A new estimator is one
# registered function.
Estimator = Callable[[torch.Tensor, int, Any, torch.Tensor], torch.Tensor]
ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {}

register_advantage = registrar(ADVANTAGE_ESTIMATORS)


@register_advantage("grpo")
def grpo(rewards: torch.Tensor, group_size: int, cfg, lengths: torch.Tensor) -> torch.Tensor:
    """Group-normalised (GRPO), or Dr. GRPO with advantage.norm_by_std=false."""
    return group_advantages(rewards, group_size, norm_by_std=cfg.norm_by_std)


@register_advantage("rloo")
def rloo(rewards: torch.Tensor, group_size: int, cfg, lengths: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out baseline (Ahmadian et al. 2024)."""
    return leave_one_out_advantages(rewards, group_size)


@register_advantage("reinforce_plus_plus")
def reinforce_plus_plus(rewards: torch.Tensor, group_size: int, cfg,
                        lengths: torch.Tensor) -> torch.Tensor:
    """REINFORCE++: rewards whitened over every response token of the rollout batch (verl
    compute_reinforce_plus_plus_outcome_advantage, gamma 1)."""
    return reinforce_pp_advantages(rewards, lengths)


@register_advantage("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(rewards: torch.Tensor, group_size: int, cfg,
                                 lengths: torch.Tensor) -> torch.Tensor:
    """REINFORCE++-baseline: reward minus its group mean, then whitened over every response
    token of the rollout batch (verl compute_reinforce_plus_plus_baseline_outcome_advantage)."""
    return reinforce_pp_advantages(rewards, lengths, group_size)
