"""Scoring a batch in the calling process: one item through a reward function (the checks
every path shares), and the thread-based scorer of `reward.num_workers=0` (per-call timeouts,
no parallelism for pure-Python functions; `score_in_process`, whose report names each failed
item as the pool's does). engine.rl.rewards.pool scores in processes.
"""
from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from engine.rl.rewards.outcome import Outcome, ScoreReport, failed_score
from engine.rl.rewards.registry import RewardFn

logger = logging.getLogger(__name__)

REQUIRED_KEYS = ("prompt", "response", "answer")


def call_reward(fn: RewardFn, item: Mapping[str, Any]) -> float:
    """Call fn on one item (``prompt``, ``response``, ``answer``, the other keys as keyword
    fields); the score must be a finite number, else ValueError."""
    extra = {k: v for k, v in item.items() if k not in REQUIRED_KEYS}
    score = float(fn(prompt=item["prompt"], response=item["response"], answer=item["answer"],
                     **extra))
    if not math.isfinite(score):
        raise ValueError(f"reward function returned a non-finite score {score}")
    return score


def check_items(items: Sequence[Mapping[str, Any]]) -> None:
    """ValueError naming the first item that lacks prompt, response or answer."""
    for i, item in enumerate(items):
        missing = [k for k in REQUIRED_KEYS if k not in item]
        if missing:
            raise ValueError(f"items[{i}] lacks required key(s) {missing}")


def score_responses(fn: RewardFn, items: Sequence[Mapping[str, Any]], timeout_s: float | None,
                    max_workers: int = 8, failure_score: float = 0.0) -> tuple[list[float], int]:
    """``(scores, num_errors)`` of `score_in_process` (its failed items score
    ``failure_score``)."""
    report = score_in_process(fn, items, timeout_s, max_workers, failure_score)
    return report.scores, report.errors


def score_in_process(fn: RewardFn, items: Sequence[Mapping[str, Any]], timeout_s: float | None,
                     max_workers: int = 8, failure_score: float | None = None) -> ScoreReport:
    """Score every item with ``fn(prompt=..., response=..., answer=..., **extra_fields)``.

    Returns the ScoreReport, scores in item order. A call that raises or returns something that
    is not a finite number (an "error"), or runs longer than ``timeout_s`` seconds (measured
    from the moment it starts, not from submission; a "timeout") fails: it scores
    ``failure_score`` (None: NaN, no score), counts as an error and is named in
    ``report.failed``.

    ``timeout_s=None`` calls fn sequentially in the calling thread (no timeout). Otherwise calls
    run on a pool of ``max_workers`` daemon threads. Python cannot kill a thread: a call that
    timed out keeps running in the background (its result is discarded) and a fresh worker
    replaces it, so hung calls never stall the rest. The pool is built from daemon threads
    rather than ``concurrent.futures.ThreadPoolExecutor`` because that executor joins its
    workers at interpreter exit, so one reward function that never returns would keep the
    training process from exiting. The GIL still applies: threads bound the wait, they do not
    speed up pure-Python reward functions.
    """
    check_items(items)
    outcomes: list[Outcome | None] = [None] * len(items)
    failed = failed_score(failure_score)
    if timeout_s is None:
        for i, item in enumerate(items):
            t0 = time.monotonic()
            try:
                outcomes[i] = Outcome(call_reward(fn, item), seconds=time.monotonic() - t0)
            except Exception as exc:  # a user function may raise anything
                outcomes[i] = Outcome(failed, "error", repr(exc), time.monotonic() - t0)
    else:
        if timeout_s <= 0 or max_workers < 1:
            raise ValueError(f"need timeout_s > 0 and max_workers >= 1, got {timeout_s}, "
                             f"{max_workers}")
        _score_with_timeout(fn, items, timeout_s, max_workers, outcomes, failed)
    report = ScoreReport.of(outcomes)
    if report.errors:
        first = next(i for i, f in enumerate(report.failed) if f is not None)
        logger.warning("reward function failed on %d of %d items; first: items[%d]: %s",
                       report.errors, len(items), first, report.failed[first])
    return report


def _score_with_timeout(fn: RewardFn, items: Sequence[Mapping[str, Any]], timeout_s: float,
                        max_workers: int, outcomes: list, failed: float) -> None:
    """Fill ``outcomes`` using daemon workers and per-call deadlines (see caller)."""
    tasks: queue.SimpleQueue = queue.SimpleQueue()   # item index, or None to stop a worker
    results: queue.SimpleQueue = queue.SimpleQueue()  # (index, score or None, error or None)
    started: dict[int, float] = {}  # index -> monotonic start time, while the call runs

    def worker() -> None:
        while (index := tasks.get()) is not None:
            started[index] = time.monotonic()
            try:
                outcome = (index, call_reward(fn, items[index]), None)
            except Exception as exc:
                outcome = (index, None, repr(exc))
            started.pop(index, None)
            results.put(outcome)

    def spawn() -> None:
        threading.Thread(target=worker, name="reward-fn", daemon=True).start()

    for index in range(len(items)):
        tasks.put(index)
    num_workers = min(max_workers, len(items))
    for _ in range(num_workers):
        spawn()

    pending = set(range(len(items)))
    while pending:
        now = time.monotonic()
        for index, t0 in started.copy().items():
            if index in pending and now - t0 >= timeout_s:
                pending.discard(index)
                outcomes[index] = Outcome(failed, "timeout", f"timed out after {timeout_s:g} s",
                                          now - t0)
                spawn()  # the hung worker is lost; keep the pool at full strength
                num_workers += 1
        if not pending:
            break
        deadlines = [t0 + timeout_s for i, t0 in started.copy().items() if i in pending]
        wait = (min(deadlines) if deadlines else now + timeout_s) - now
        try:
            index, score, error = results.get(timeout=max(wait, 0.0))
        except queue.Empty:
            continue
        if index in pending:  # else it already timed out
            pending.discard(index)
            outcomes[index] = (Outcome(score) if error is None
                               else Outcome(failed, "error", error))
    for _ in range(num_workers):
        tasks.put(None)  # one per worker; hung ones read theirs if their call ever returns
