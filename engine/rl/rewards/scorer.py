"""A collector's reward scoring as `reward.*` says: the process pool of reward.num_workers
(engine.rl.rewards.pool; started on first use, kept across steps), or with num_workers=0 the
in-process thread scorer. Counts timeouts, worker crashes and time between `take_metrics`
calls: time/reward_s (the scoring work: the calls' seconds summed; with num_workers=0 the
scoring's wall time) and time/reward_wait_s (the time the collector blocked waiting for scores:
all of the scoring when it starts after generation, only the tail when replies were submitted
as they finished). `score` may be called from several threads at once (env.fn=tools scores
each episode's final answer from its environment step's thread).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

from engine.rl.rewards.pool import RewardPool, ScoreReport
from engine.rl.rewards.math_match import no_reward
from engine.rl.rewards.registry import RewardFn
from engine.rl.rewards.scoring import check_items, score_in_process


class BatchScorer:
    """Scores items with ``fn`` under the settings of ``reward`` (an RL config's `reward`:
    num_workers, timeout_s, failure_score; a failed item scores failure_score, or NaN when it
    is None, and its report names the failure: engine.rl.rewards.outcome).

    ``score(items)`` scores a batch; ``submit(key, item)`` / ``wait(keys)`` let items be
    submitted as they are ready (replies finishing while others generate) and collected
    later. Either way each item is one call of ``fn``: the scores do not depend on the path.
    """

    def __init__(self, fn: RewardFn, reward: Any) -> None:
        # reward.fn=none has nothing to score: no worker processes for it
        self.fn, self.num_workers = fn, 0 if fn is no_reward else reward.num_workers
        self.timeout_s = reward.timeout_s
        self.failure_score = (None if reward.failure_score is None
                              else float(reward.failure_score))
        self._pool: RewardPool | None = None
        self._held: dict[Hashable, Mapping[str, Any]] = {}   # num_workers=0: scored at wait
        self._lock = threading.Lock()   # the pool's start and the counts, across threads
        self.reset_counts()

    @property
    def pool(self) -> RewardPool | None:
        """The worker pool (started on first use), None with num_workers=0."""
        with self._lock:
            if self._pool is None and self.num_workers != 0:
                self._pool = RewardPool(self.fn, self.num_workers, self.timeout_s,
                                        self.failure_score)
            return self._pool

    def reset_counts(self) -> None:
        """Start counting afresh (a step's first call)."""
        self.timeouts = self.failures = 0
        self.reward_s = self.wait_s = 0.0

    def take_metrics(self) -> dict[str, float]:
        """reward/timeouts, reward/failures, time/reward_s and time/reward_wait_s since the last
        reset; resets."""
        out = {"reward/timeouts": float(self.timeouts), "reward/failures": float(self.failures),
               "time/reward_s": self.reward_s, "time/reward_wait_s": self.wait_s}
        self.reset_counts()
        return out

    def score(self, items: Sequence[Mapping[str, Any]]) -> ScoreReport:
        """Every item's score in item order, with the batch's failure counts."""
        t0 = time.perf_counter()
        report = (self._in_process(items) if self.pool is None else self.pool.score(items))
        self._count(report, time.perf_counter() - t0)
        return report

    def submit(self, key: Hashable, item: Mapping[str, Any]) -> None:
        """Start scoring one item now (in the pool); ``wait`` reads its result. A key already
        submitted (and not forgotten) is not scored again: a key must name the item's content."""
        check_items([item])
        if self.pool is None:
            self._held.setdefault(key, item)
        elif not self.pool.knows(key):
            self.pool.submit(key, item)

    def wait(self, keys: Iterable[Hashable]) -> ScoreReport:
        """The submitted items of ``keys`` in that order (a key may repeat), waiting for those
        still running; the time blocked here counts in time/reward_wait_s."""
        keys = list(keys)
        t0 = time.perf_counter()
        if self.pool is None:
            report = self._in_process([self._held[k] for k in keys])
        else:
            report = ScoreReport.of(self.pool.wait(keys))
        self._count(report, time.perf_counter() - t0)
        return report

    def forget(self, keep: Iterable[Hashable] = ()) -> None:
        """Drop every submitted item's result but those of ``keep`` (a step's end: the
        finished replies of groups carried to the next step are kept, not scored again)."""
        keep = set(keep)
        self._held = {k: v for k, v in self._held.items() if k in keep}
        if self._pool is not None:
            self._pool.forget(keep=keep)

    def close(self) -> None:
        """Stop the pool's workers (a later call starts a fresh pool)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def _in_process(self, items: Sequence[Mapping[str, Any]]) -> ScoreReport:
        t0 = time.perf_counter()
        report = score_in_process(self.fn, items, self.timeout_s,
                                  failure_score=self.failure_score)
        report.work_s = time.perf_counter() - t0
        return report

    def _count(self, report: ScoreReport, waited_s: float) -> None:
        with self._lock:
            self.timeouts += report.timeouts
            self.failures += report.failures
            self.reward_s += report.work_s
            self.wait_s += waited_s
