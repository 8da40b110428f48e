"""Colocated multi-rank scoring (engine.rl.collect.rank_scoring): on a 2-rank pool each rank
scores its share of reward.fn's items in its own reward pool, and rank 0 gets exactly the
scores and failure counts of scoring every item itself."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from engine.rl.collect.rank_scoring import shares
from engine.rl.rewards.scoring import call_reward
from tests.multirank.rank_scoring_check import items, logged_reward
from tests.partial_runs import STEPS, launch, prompts_file, untimed
from tools.bench.partial import eos_prone_model

CHECK = "tests.multirank.rank_scoring_check:check"
REWARD = "tests.multirank.rank_scoring_check:logged_run_reward"
COUNT = 11
FAILURE = -1.0


def serial(log: str) -> list[float]:
    """Every item scored here, one call each (items 5, 6, 7 fail: failure_score)."""
    return [FAILURE if i in (5, 6, 7) else call_reward(logged_reward, item)
            for i, item in enumerate(items(log, COUNT))]


def scored_by(log) -> list[tuple[str, int]]:
    return [(line.split()[0], int(line.split()[1])) for line in log.read_text().splitlines()]


def audit(log, expected_ranks: dict[int, str]) -> list[str]:
    """Problems of a scoring log: an item scored more than once or never, or on another rank
    than `expected_ranks` names (the hanging / crashing items are replaced, not retried)."""
    calls = scored_by(log)
    counts = Counter(i for _, i in calls)
    problems = [f"item {i} scored {counts[i]} times" for i in range(COUNT) if counts[i] != 1]
    problems += [f"item {i} scored on rank {r}, not {expected_ranks[i]}" for r, i in calls
                 if expected_ranks.get(i) != r]
    return problems


def test_shares_cover_every_item_once():
    for count in (0, 1, 5, 11, 64):
        for world in (1, 2, 3, 8):
            parts = shares(count, world)
            assert [i for p in parts for i in p] == list(range(count))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_two_ranks_score_their_shares_exactly(pools, tmp_path):
    values = pools.run(2, CHECK, str(tmp_path), COUNT)
    out = values[0]
    assert out["spreads"]
    # each rank's pool sized to its CPUs: the node's CPUs shared by its 2 ranks
    assert out["workers"] == out["default_workers"] == values[1]["workers"] >= 1
    expected = serial(str(tmp_path / "x.log"))
    failures = {"reward/timeouts": 1.0, "reward/failures": 1.0}
    batch = out["batch"]
    assert batch["scores"] == expected and batch["errors"] == 3      # bitwise equal
    assert {k: batch["metrics"][k] for k in failures} == failures
    assert batch["metrics"]["time/reward_s"] > 0
    owner = {i: str(r) for r, part in enumerate(shares(COUNT, 2)) for i in part}
    assert audit(tmp_path / "batch.log", owner) == []
    stream = out["stream"]
    assert stream["scores"] == [expected[i] for i in stream["order"]]
    assert stream["errors"] == 3 and {k: stream["metrics"][k] for k in failures} == failures
    assert audit(tmp_path / "stream.log", {i: str(i % 2) for i in range(COUNT)}) == []


@pytest.mark.parametrize("broken, problem", [("overlap", "item 5 scored 2 times"),
                                              ("rank0", "item 6 scored on rank 0, not 1")])
def test_audit_catches_a_broken_split(pools, tmp_path, broken, problem):
    """Negative controls: shares overlapping by one item score it on both ranks; rank 0
    scoring the whole batch (the behaviour before) scores rank 1's share itself."""
    pools.run(2, CHECK, str(tmp_path), COUNT, broken)
    owner = {i: str(r) for r, part in enumerate(shares(COUNT, 2)) for i in part}
    assert problem in audit(tmp_path / "batch.log", owner)


@pytest.mark.parametrize("path", [["rollout.partial=false"], ["rollout.partial_driver=true"]],
                         ids=["rounds", "driver"])
def test_two_rank_run_equals_rank0_scoring(pools, tmp_path, path):
    """A 2-rank RL run (one engine on rank 0; plain rollouts, or the step driver's partial
    rollouts scored as replies finish) scoring reward.fn on both ranks equals the same run
    scoring on rank 0 alone (reward.num_workers=0, the path before): every metric but the
    timings and the dumps, exactly; both ranks scored, together as many calls as one process
    scoring in its own pool (the driver path scores each reply as it finishes, also those of
    the groups still carried after the last step; reward.num_workers=0 only what is read)."""
    model = eos_prone_model(str(tmp_path / "model"), eos_scale=2.5, hidden=64, layers=4)
    data = prompts_file(tmp_path)
    runs, calls = {}, {}
    for name, ranks, extra in (("ranks", 2, []), ("rank0", 2, ["reward.num_workers=0"]),
                               ("one", 1, [])):
        log = tmp_path / f"{name}.log"
        runs[name], _ = launch(pools, ranks, model, data, tmp_path / name, *path, *extra,
                               f"reward.fn={REWARD}", env={"RANK_SCORING_LOG": str(log)})
        calls[name] = [tuple(json.loads(x)) for x in log.read_text().splitlines()]
    (m_ranks, d_ranks), (m_rank0, d_rank0) = runs["ranks"], runs["rank0"]
    assert [untimed(m) for m in m_ranks] == [untimed(m) for m in m_rank0]
    assert d_ranks == d_rank0 and len(d_ranks) == STEPS
    ranks = {name: Counter(c[0] for c in calls[name]) for name in calls}
    assert set(ranks["rank0"]) == {"0"} and ranks["ranks"]["0"] > 0 and ranks["ranks"]["1"] > 0
    assert len(calls["ranks"]) == len(calls["one"]) >= len(calls["rank0"])
    for name in ("ranks", "one") if "driver" in path[0] else ():
        # replies are keyed by row and tokens: each scored once, carried ones too
        assert len(set(c[1:] for c in calls[name])) == len(calls[name]), name
    scores = [m["reward/mean"] for m in m_ranks]
    assert len(set(scores)) > 1 and all(s > 0 for s in scores)
