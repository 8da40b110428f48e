"""Failed reward calls never train (docs/rewards.md#failed-reward-calls): with
reward.failure_score null (the default), a group (the rollout.n replies of one prompt) holding
a reply whose reward.fn call failed (raised, returned a non-finite value, crashed its worker,
ran past reward.timeout_s; engine.rl.rewards.outcome) leaves the update: its replies get no
advantage, no loss and no place in the loss normalisation's counts; reward/dropped_groups
counts such groups. With reward.failure_score set, the failed replies score that number and
train as scored ones (nothing is dropped).

The decision is made on rank 0 from the batch's gathered scores (every rank's share is back in
item order before it: engine.rl.collect.rank_scoring), and the kept batch is what every rank
receives (engine.rl.collect.transport): it is the same on every layout.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.rl.algo.dynamic_sampling import group_rows, select


def failed_groups(failed: Sequence[str | None], group_size: int, drops: bool) -> torch.Tensor:
    """Bool ``[G]`` of group-major items (`failed`: per item its failure, None when scored):
    True for the groups holding a failed item when `drops` (reward.failure_score null), else
    all False."""
    flags = torch.tensor([f is not None for f in failed], dtype=torch.bool)
    if not drops or not len(flags):
        return torch.zeros(len(flags) // group_size, dtype=torch.bool)
    return flags.reshape(-1, group_size).any(dim=1)


def kept_rows(dropped: torch.Tensor, group_size: int) -> list[int]:
    """The item rows of the groups not in `dropped` (Bool [G]), in order."""
    return group_rows([g for g in range(len(dropped)) if not dropped[g]], group_size)


def select_rows(data: dict, rows: list[int]) -> dict:
    """`data` (per item: tensors along dim 0, or lists) restricted to `rows`, in that order."""
    return {k: select(v, rows) for k, v in data.items()}


def dropped_message(dropped: int, groups: int, first: str | None, skipped: bool) -> str:
    """The run log's line for a step whose groups left the update (`dropped` of the `groups`
    generated; `skipped`: no group is left to train)."""
    rest = ("no group is left to train: this step's update is skipped (train/update_skipped)"
            if skipped else "the step trains on the rest")
    return (f"[rl] warning: {dropped} of {groups} groups left the update (reward/dropped_groups):"
            f" a reward.fn call failed (first: {first}); {rest}. Set reward.failure_score to a "
            "number to score such calls instead")
