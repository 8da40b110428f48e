"""The reward and length metrics of one step's trained replies, shared by the plain rollout
(collector.RolloutCollector) and partial rollouts (partial.PartialCollector)."""
from __future__ import annotations

import torch

from engine.rl.algo.advantages import zero_std_groups


def reward_length_metrics(scores: torch.Tensor, lengths: torch.Tensor, clipped: list[bool],
                          group_size: int) -> dict[str, float]:
    """reward/mean, reward/std (population), reward/frac_zero_std_groups (groups of
    `group_size` consecutive scores), response/length_mean, response/length_max and
    response/clip_ratio (replies ended by their length bound) of `scores` [N] and `lengths`
    [N] (tokens); all 0.0 for no replies."""
    if not len(scores):
        return {k: 0.0 for k in ("reward/mean", "reward/std", "reward/frac_zero_std_groups",
                                 "response/length_mean", "response/length_max",
                                 "response/clip_ratio")}
    return {"reward/mean": float(scores.mean()),
            "reward/std": float(scores.std(unbiased=False)),
            "reward/frac_zero_std_groups": float(zero_std_groups(scores, group_size).float()
                                                 .mean()),
            "response/length_mean": float(lengths.mean()),
            "response/length_max": float(lengths.max()),
            "response/clip_ratio": sum(clipped) / len(clipped)}
