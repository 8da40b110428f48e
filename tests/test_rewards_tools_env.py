"""env.fn=tools scores an episode's final answer through the collector's reward scorer
(engine.rl.env.tools_env): in a pool worker, the same score as calling reward.fn, a hanging or
crashing call bounded by reward.timeout_s and counted (reward/timeouts, reward/failures)."""
from __future__ import annotations

import os
import time
from types import SimpleNamespace

from engine.rl.env.tools_env import ToolEnv
from engine.rl.rewards.scorer import BatchScorer

ASK = [{"role": "user", "content": "What is 1+2?"}]


def answer_reward(prompt, response, answer, pids=None, **fields):
    """1/3 per occurrence of the answer, minus the level / 10; appends its pid to `pids`.
    Responses "hang" and "crash" misbehave."""
    with open(pids, "a") as f:
        f.write(f"{os.getpid()}\n")
    if response == "hang":
        time.sleep(3600)
    if response == "crash":
        os._exit(3)
    return response.count(answer) / 3 - fields["level"] / 10


def final(env: ToolEnv, text: str) -> float:
    step = env.step(text)
    assert step["done"] and step["observations"] == []
    return step["reward"]


def test_final_answers_score_in_the_pool(tmp_path):
    pids = str(tmp_path / "pids")
    row = {"prompt": ASK, "answer": "3", "level": 2, "pids": pids}
    scorer = BatchScorer(answer_reward, SimpleNamespace(num_workers=1, timeout_s=2.0,
                                                         failure_score=-1.0))
    try:
        env = ToolEnv(row, pool=None, fmt="hermes", reward_fn=answer_reward, scorer=scorer)
        texts = ["The answer is 3.", "3, 3 and 3", "no idea"]
        got = [final(env, t) for t in texts]
        assert scorer.take_metrics()["reward/timeouts"] == 0.0
        t0 = time.monotonic()
        assert [final(env, "hang"), final(env, "crash")] == [-1.0, -1.0]
        assert time.monotonic() - t0 < 30           # bounded: the hung worker was killed
        metrics = scorer.take_metrics()
        assert metrics["reward/timeouts"] == 1.0 and metrics["reward/failures"] == 1.0
        assert final(env, "3") == answer_reward("What is 1+2?", "3", "3", pids, level=2)
    finally:
        scorer.close()
    direct = [answer_reward("What is 1+2?", t, "3", pids, level=2) for t in texts]
    assert got == direct == [1 / 3 - 0.2, 1.0 - 0.2, -0.2]      # bitwise
    scored_in = [int(p) for p in open(pids).read().split()][:3]
    assert os.getpid() not in scored_in                        # in a pool worker


def test_without_a_scorer_the_answer_is_scored_here(tmp_path):
    """The control of the pid check: ToolEnv without a scorer (the path before) calls reward.fn
    in this process."""
    pids = tmp_path / "pids"
    row = {"prompt": ASK, "answer": "3", "level": 2, "pids": str(pids)}
    env = ToolEnv(row, pool=None, fmt="hermes", reward_fn=answer_reward)
    assert final(env, "The answer is 3.") == 1 / 3 - 0.2
    assert [int(p) for p in pids.read_text().split()] == [os.getpid()]


def test_a_failed_final_answer_is_named_and_unscored(tmp_path):
    """With reward.failure_score null (the default) a crashing final answer's reward call is
    named in the env's `reward_failure` (its group then leaves the update:
    tests/test_rewards_failed.py); its step reward 0 is a placeholder nothing trains on. A
    scored answer leaves it None."""
    pids = str(tmp_path / "pids")
    row = {"prompt": ASK, "answer": "3", "level": 2, "pids": pids}
    scorer = BatchScorer(answer_reward, SimpleNamespace(num_workers=1, timeout_s=10.0,
                                                         failure_score=None))
    try:
        env = ToolEnv(row, pool=None, fmt="hermes", reward_fn=answer_reward, scorer=scorer)
        assert final(env, "3") == 1 / 3 - 0.2 and env.reward_failure is None
        crashed = ToolEnv(row, pool=None, fmt="hermes", reward_fn=answer_reward, scorer=scorer)
        assert final(crashed, "crash") == 0.0
        assert crashed.reward_failure == "crash: the worker died (exit status 3)"
    finally:
        scorer.close()
