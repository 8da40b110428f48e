"""Group-relative advantages for GRPO and Dr. GRPO (DESIGN section 9).

Layout contract: a rollout batch holds G prompts with n responses each, stored *group-major*:
responses ``[g*n, (g+1)*n)`` belong to prompt ``g``. Every function here takes the flat
per-response reward vector ``[G*n]`` plus ``group_size = n``. These are pure, local functions:
they see the whole rollout batch on one process and run no collective.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from engine.rl.registry import registrar


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


# Advantage estimators by name (`advantage.estimator=...`): fn(rewards [G*n] group-major,
# group_size, advantage config) -> advantages [G*n]. A new estimator is one registered function.
Estimator = Callable[[torch.Tensor, int, Any], torch.Tensor]
ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {}

register_advantage = registrar(ADVANTAGE_ESTIMATORS)


@register_advantage("grpo")
def grpo(rewards: torch.Tensor, group_size: int, cfg) -> torch.Tensor:
    """Group-normalised (GRPO), or Dr. GRPO with advantage.norm_by_std=false."""
    return group_advantages(rewards, group_size, norm_by_std=cfg.norm_by_std)


@register_advantage("rloo")
def rloo(rewards: torch.Tensor, group_size: int, cfg) -> torch.Tensor:
    """REINFORCE leave-one-out baseline (Ahmadian et al. 2024)."""
    return leave_one_out_advantages(rewards, group_size)
