"""What scoring returns: one item's Outcome, a batch's ScoreReport (engine.rl.rewards.pool,
the thread scorer of engine.rl.rewards.scoring, engine.rl.collect.rank_scoring).

A failed call (it raised, returned a non-finite value, crashed its worker, or ran past
reward.timeout_s) has no score. With reward.failure_score set it scores that number; unset
(null, the default) its score is NaN and the collectors drop its group from the update
(docs/rewards.md#failed-reward-calls). Either way the failure is named: `ScoreReport.failed`
holds "<kind>: <detail>" per failed item ("timeout: timed out after 30 s", "crash: the worker
died (exit status -9)", "error: ValueError('...')"), which the rollout dumps record.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

FAILURE_KINDS = ("error", "crash", "timeout")   # raised or non-finite; worker died; too late


def failed_score(failure_score: float | None) -> float:
    """The score a failed item gets: `failure_score`, or NaN (no score) when it is None."""
    return math.nan if failure_score is None else float(failure_score)


@dataclass
class Outcome:
    """One item's result: its score, and how it failed (None: scored)."""
    score: float
    failure: str | None = None       # one of FAILURE_KINDS
    detail: str = ""
    seconds: float = 0.0             # from the call's dispatch to its result

    def describe(self) -> str | None:
        """"<kind>: <detail>" of a failed item (what a dump record's `error` says), else None."""
        return None if self.failure is None else f"{self.failure}: {self.detail}"


@dataclass
class ScoreReport:
    """A batch's scores in item order and its failure counts (every failed item also counts
    in `errors`, the metric reward/errors). `failed`: per item, Outcome.describe() (None for a
    scored item); empty when built without per-item outcomes."""
    scores: list[float]
    errors: int = 0
    timeouts: int = 0
    failures: int = 0                # worker crashes
    details: list[str] = field(default_factory=list)
    work_s: float = 0.0              # the calls' seconds, summed (time/reward_s)
    failed: list[str | None] = field(default_factory=list)

    @classmethod
    def of(cls, outcomes: Sequence[Outcome]) -> "ScoreReport":
        kinds = [o.failure for o in outcomes]
        return cls([o.score for o in outcomes], errors=sum(k is not None for k in kinds),
                   timeouts=kinds.count("timeout"), failures=kinds.count("crash"),
                   details=[o.detail for o in outcomes if o.failure is not None],
                   work_s=sum(o.seconds for o in outcomes),
                   failed=[o.describe() for o in outcomes])

    def per_item_failures(self) -> list[str | None]:
        """`failed`, or all None when the report carries no per-item outcomes."""
        return self.failed or [None] * len(self.scores)
