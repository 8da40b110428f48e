"""Dynamic sampling (DAPO's `dapo.dynamic_sampling`): keep only groups whose rewards differ and
generate more batches until the step is full (docs/algorithms.md).

Rollout batches are group-major: ``group_size = n`` consecutive responses per prompt (see
engine/rl/algo/advantages.py). Everything here is local to one process; no collective runs.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from engine.rl.algo.advantages import zero_std_groups


def keep_groups_with_signal(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Bool ``[G]``: True for groups whose rewards are not all equal (the dynamic-sampling
    filter; all-equal groups have zero GRPO advantage and add nothing but cost)."""
    return ~zero_std_groups(rewards, group_size)


def _num_rows(value: Any, key: str) -> int:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise ValueError(f"batch[{key!r}] is a scalar tensor; need one row per response")
        return value.shape[0]
    if isinstance(value, list):
        return len(value)
    raise TypeError(f"batch[{key!r}] must be a torch.Tensor or a list (one entry per "
                    f"response), got {type(value).__name__}")


def _schema(value: Any, key: str) -> tuple:
    """What must agree across generation batches for ``key``: kind, and for tensors the trailing
    shape and dtype (they are concatenated along dim 0)."""
    _num_rows(value, key)
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape[1:]), str(value.dtype))
    return ("list",)


def select(value: torch.Tensor | list, rows: Sequence[int]) -> torch.Tensor | list:
    """`value`'s `rows` (a tensor along dim 0, or a list), in that order."""
    if isinstance(value, torch.Tensor):
        return value.index_select(0, torch.as_tensor(rows, dtype=torch.long,
                                                     device=value.device))
    return [value[i] for i in rows]


def group_rows(groups: Sequence[int], group_size: int) -> list[int]:
    """The item rows of `groups` (group-major items), in order."""
    return [g * group_size + j for g in groups for j in range(group_size)]


class DynamicSampler:
    """Collects rollout groups with learning signal until a training step is full (DAPO).

    Usage, once per training step::

        sampler = DynamicSampler(group_size=n, target_groups=prompts_per_step,
                                 max_gen_batches=cfg.max_gen_batches)
        while sampler.needs_more():
            batch, acc = generate_and_score(next_prompts())  # one generation batch
            sampler.add(batch, acc)
        step_batch = sampler.result()        # exactly target_groups * n responses
        log(sampler.stats())

    ``add(batch, rewards)``: ``batch`` maps names to per-response data, each a tensor whose
    dim 0 is the response (trailing dims must agree across batches, since they are
    concatenated) or a list (use lists for ragged data such as token id sequences); every value
    has ``len(rewards) = G*n`` rows, group-major. ``rewards`` are the scores the filter looks at
    (DAPO filters on task accuracy; whether the overlong penalty is included is the caller's
    choice). Groups whose rewards are all equal are dropped, and so are the groups ``failed``
    marks (a reward call failed: they have no rewards to filter on,
    engine.rl.collect.failed_groups); the others are kept in arrival order. Every ``add``
    counts as one generation batch.

    ``result()`` returns the first ``target_groups`` kept groups (surplus trimmed from the end,
    deterministically) as one batch dict with the same keys. If the budget of
    ``max_gen_batches`` ran out first, it raises RuntimeError, or with ``allow_partial=True``
    returns all kept groups (fewer than the target); with no group kept at all it always
    raises, since an empty step cannot be trained.
    """

    def __init__(self, group_size: int, target_groups: int, max_gen_batches: int,
                 allow_partial: bool = False) -> None:
        if group_size < 1 or target_groups < 1 or max_gen_batches < 1:
            raise ValueError(
                f"group_size, target_groups, max_gen_batches must be >= 1, got {group_size}, "
                f"{target_groups}, {max_gen_batches}")
        self.group_size = group_size
        self.target_groups = target_groups
        self.max_gen_batches = max_gen_batches
        self.allow_partial = allow_partial
        self.num_gen_batches = 0
        self.num_groups_generated = 0
        self._schema: dict[str, tuple] | None = None  # key -> _schema() of the first batch
        self._parts: list[dict[str, torch.Tensor | list]] = []  # kept rows of each batch
        self._kept_groups = 0

    @property
    def num_groups_kept(self) -> int:
        """Groups with signal collected so far (before trimming to the target)."""
        return self._kept_groups

    def is_full(self) -> bool:
        """True once at least ``target_groups`` groups with signal are collected."""
        return self._kept_groups >= self.target_groups

    def needs_more(self) -> bool:
        """True while the step is not full and another generation batch is allowed."""
        return not self.is_full() and self.num_gen_batches < self.max_gen_batches

    def add(self, batch: Mapping[str, torch.Tensor | list], rewards: torch.Tensor,
            failed: torch.Tensor | None = None) -> int:
        """Filter one generation batch and keep its groups with signal, none of ``failed``
        (Bool ``[G]``; None: none failed); returns how many groups were kept from it. Raises
        RuntimeError once ``max_gen_batches`` batches were added."""
        if self.num_gen_batches >= self.max_gen_batches:
            raise RuntimeError(f"DynamicSampler: max_gen_batches={self.max_gen_batches} "
                               "generation batches were already added")
        rewards = torch.as_tensor(rewards)
        num_rows = rewards.numel()
        schema = {key: _schema(value, key) for key, value in batch.items()}
        if self._schema is not None and schema != self._schema:
            raise ValueError(f"batch layout {schema} differs from the first batch's "
                             f"{self._schema}; keys, value kinds and trailing tensor shapes "
                             "must agree (pass ragged data as lists)")
        for key, value in batch.items():
            if _num_rows(value, key) != num_rows:
                raise ValueError(f"batch[{key!r}] has {_num_rows(value, key)} rows, rewards "
                                 f"has {num_rows}; need one row per response")
        keep = keep_groups_with_signal(rewards.reshape(-1), self.group_size)
        if failed is not None:
            if tuple(failed.shape) != tuple(keep.shape):
                raise ValueError(f"failed has shape {tuple(failed.shape)}; need one flag per "
                                 f"group, {tuple(keep.shape)}")
            keep = keep & ~failed.to(torch.bool)
        self._schema = schema
        self.num_gen_batches += 1
        self.num_groups_generated += keep.numel()
        kept = [int(g) for g in torch.nonzero(keep).flatten()]
        if kept:
            rows = group_rows(kept, self.group_size)
            self._parts.append({k: select(v, rows) for k, v in batch.items()})
            self._kept_groups += len(kept)
        return len(kept)

    def result(self) -> dict[str, torch.Tensor | list]:
        """The step's batch: ``target_groups * group_size`` rows (or fewer, see class doc)."""
        if not self.is_full():
            missing = (f"DynamicSampler: only {self._kept_groups} of {self.target_groups} groups "
                       f"with reward variance after {self.num_gen_batches} generation batches "
                       f"(max_gen_batches={self.max_gen_batches})")
            if self.num_gen_batches < self.max_gen_batches:
                raise RuntimeError(missing + "; call add() while needs_more() is True")
            if not self.allow_partial or self._kept_groups == 0:
                raise RuntimeError(missing + "; raise max_gen_batches, use allow_partial, or "
                                   "check the reward function / prompt difficulty")
        rows = min(self._kept_groups, self.target_groups) * self.group_size
        out: dict[str, torch.Tensor | list] = {}
        for key in self._schema or {}:
            values = [part[key] for part in self._parts]
            if isinstance(values[0], torch.Tensor):
                out[key] = torch.cat(values, dim=0)[:rows]
            else:
                out[key] = [x for v in values for x in v][:rows]
        return out

    def stats(self) -> dict[str, float]:
        """Metrics for logging: generation batches used, groups generated and kept."""
        generated = max(self.num_groups_generated, 1)
        return {
            "dynamic_sampling/gen_batches": float(self.num_gen_batches),
            "dynamic_sampling/groups_generated": float(self.num_groups_generated),
            "dynamic_sampling/groups_with_signal": float(self._kept_groups),
            "dynamic_sampling/signal_fraction": self._kept_groups / generated,
        }
