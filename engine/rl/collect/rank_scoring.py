"""reward.fn scored on every rank of a colocated multi-rank run: each rank scores its share of
the rollout batch in its own reward pool (engine.rl.rewards.pool, sized to the CPUs that rank
may use: engine.rl.rewards.cpus), and rank 0 gets every score back in item order.

Rank 0 drives the rollout while the other ranks serve their engines
(engine.generation.pool.RolloutPool.serve), so the scoring is a pool command
(`RolloutPool.on_every_rank`, running `rank_op` on every rank):

- a whole batch (`score`): rank r scores the contiguous share `shares(len, world)[r]`;
- replies as they finish (`submit`, the step driver's overlapped scoring,
  engine.rl.collect.partial_scoring): reply k of the step goes to rank k mod world, which
  queues it in its pool at once and goes back to serving (no gather), so every rank scores
  while rank 0 generates; `wait` gathers the outcomes of the keys each rank holds.

Every item is one call of the same pickled function on the same arguments, in whichever
worker of whichever rank: the scores, and so the rewards, metrics and dumps, equal rank 0
scoring alone, bitwise. A failed item's Outcome (its kind and detail) comes back with it, so
rank 0 decides from the gathered outcomes which groups a failed call drops
(engine.rl.collect.failed_groups), the same decision on every layout. reward/timeouts and reward/failures count every rank's items;
time/reward_s sums every rank's scoring work; time/reward_wait_s is what rank 0 waited.
The judge and the reward model are not reward.fn and keep their own paths.
"""
from __future__ import annotations

import pickle
import time
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import torch.distributed as dist

from engine.rl.rewards.pool import Outcome, RewardPool, ScoreReport
from engine.rl.rewards.scorer import BatchScorer
from engine.rl.rewards.scoring import check_items

STATE_KEY = "reward"   # RolloutPool.rank_state's entry: {"pool", "fn", "error"}


def shares(count: int, world: int) -> list[range]:
    """Contiguous shares of `count` items over `world` ranks, sizes differing by at most 1,
    the larger ones first; together they cover range(count) once, in order."""
    base, extra = divmod(count, world)
    out, start = [], 0
    for r in range(world):
        size = base + (r < extra)
        out.append(range(start, start + size))
        start += size
    return out


def rank_op(rollout_pool, payload: tuple) -> Any:
    """One scoring command on this rank (module docstring); never raises (rank 0 waits for the
    others' answers): a failure comes back as ("error", description)."""
    op, arg = payload
    state = rollout_pool.rank_state.setdefault(STATE_KEY, {"pool": None, "error": None})
    rank, world = rollout_pool._rank, _world(rollout_pool)
    try:
        if op == "setup":
            fn_bytes, num_workers, timeout_s, failure_score = arg
            if state["pool"] is not None:
                state["pool"].close()
            state.update(pool=None, error=None)
            state["pool"] = RewardPool(pickle.loads(fn_bytes), num_workers, timeout_s,
                                       failure_score)
            return ("ok", state["pool"].num_workers)
        if state["error"] is not None:
            return ("error", state["error"])
        pool: RewardPool = state["pool"]
        if op == "score":
            keys = [("share", i) for i in shares(len(arg), world)[rank]]
            for key in keys:
                pool.submit(key, arg[key[1]])
            outcomes = pool.wait(keys)
            pool.forget(keys)
            return ("ok", outcomes)
        if op == "submit":
            owner, key, item = arg
            if owner == rank:
                pool.submit(key, item)
            return ("ok", None)
        if op == "wait":
            return ("ok", pool.wait(arg.get(rank, [])))
        if op == "forget":
            pool.forget(keep=set(arg))
            return ("ok", None)
        raise ValueError(f"unknown scoring command {op!r}")
    except Exception as exc:  # noqa: BLE001 - reported to rank 0 instead of hanging it
        state["error"] = f"rank {rank}: {type(exc).__name__}: {exc}"
        return ("error", state["error"])


def _world(rollout_pool) -> int:
    return dist.get_world_size() if rollout_pool._distributed else 1


def spreads(rollout_pool, scorer: BatchScorer) -> bool:
    """Whether reward.fn is scored on every rank: a multi-rank pool and a worker pool to score
    in (reward.num_workers != 0 and reward.fn is not `none`)."""
    return bool(getattr(rollout_pool, "_distributed", False)) and scorer.num_workers != 0


class RankScorer(BatchScorer):
    """BatchScorer (same metrics and calls) whose items are scored on every rank of
    `rollout_pool` (module docstring); rank 0 only."""

    def __init__(self, fn, reward: Any, rollout_pool) -> None:
        super().__init__(fn, reward)
        self.rollout_pool, self.world = rollout_pool, _world(rollout_pool)
        self.fn_bytes = pickle.dumps(fn)
        self._ready = False
        self._owner: dict[Hashable, int] = {}   # submitted key -> the rank scoring it

    @property
    def pool(self) -> None:
        """No pool in this process of its own: rank 0's share is in RolloutPool.rank_state."""
        return None

    def _call(self, op: str, arg: Any = None, gather: bool = True) -> list:
        """`op` on every rank (started on first use): the ranks' answers, RuntimeError naming
        the first rank that failed."""
        if not self._ready:
            self._ready = True
            self._call("setup", (self.fn_bytes, self.num_workers, self.timeout_s,
                                 self.failure_score))
        answers = self.rollout_pool.on_every_rank(rank_op, (op, arg), gather)
        bad = [a[1] for a in answers if a[0] == "error"]
        if bad:
            raise RuntimeError(f"reward scoring failed: {bad[0]}")
        return [a[1] for a in answers]

    def score(self, items: Sequence[Mapping[str, Any]]) -> ScoreReport:
        check_items(items)
        t0 = time.perf_counter()
        outcomes = [o for part in self._call("score", list(items)) for o in part]
        report = ScoreReport.of(outcomes)
        self._count(report, time.perf_counter() - t0)
        return report

    def submit(self, key: Hashable, item: Mapping[str, Any]) -> None:
        check_items([item])
        if key in self._owner:
            return
        owner = self._owner[key] = len(self._owner) % self.world
        self._call("submit", (owner, key, dict(item)), gather=False)

    def wait(self, keys: Iterable[Hashable]) -> ScoreReport:
        keys = list(keys)
        t0 = time.perf_counter()
        by_rank: dict[int, list] = {}
        for key in dict.fromkeys(keys):
            by_rank.setdefault(self._owner[key], []).append(key)
        found: dict[Hashable, Outcome] = {}
        for rank, outcomes in enumerate(self._call("wait", by_rank)):
            found.update(zip(by_rank.get(rank, []), outcomes))
        report = ScoreReport.of([found[k] for k in keys])
        self._count(report, time.perf_counter() - t0)
        return report

    def forget(self, keep: Iterable[Hashable] = ()) -> None:
        keep = [k for k in keep if k in self._owner]
        if self._owner:
            self._call("forget", keep, gather=False)
        self._owner = {k: self._owner[k] for k in keep}

    def close(self) -> None:
        """Nothing to stop here: each rank's pool ends with its process (a collective here
        could meet ranks that no longer serve)."""
