"""The reward process pool (engine.rl.rewards.pool, reward.num_workers): scores equal serial
scoring exactly; a hanging and a crashing item are bounded, counted and replaced while the
others score; unpicklable functions are refused by name; the scorer's metrics.

The workers import this module to unpickle its functions, so it imports nothing heavy at the
top (engine.rl.config imports torch: the tests needing it import it inside)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from engine.rl.rewards import load_reward_fn, score_responses
from engine.rl.rewards.pool import RewardPool, default_num_workers
from engine.rl.rewards.scorer import BatchScorer
from engine.rl.rewards.settings import reward_fn_for, reward_settings_problems


def field_reward(prompt, response, answer, weight=1.0, **fields):
    """A user function reading a row field; the score depends on every argument."""
    return weight * (len(response) % 7) + (response.strip() == str(answer)) + len(prompt) / 100


def hostile(prompt, response, answer, **fields):
    """'hang' sleeps for ever, 'crash' kills its own process, 'raise' raises, 'nan' returns a
    non-finite score; anything else scores its length."""
    if response == "hang":
        time.sleep(3600)
    if response == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    if response == "raise":
        raise RuntimeError("bad row")
    if response == "nan":
        return float("nan")
    return float(len(response))


class LoadsUntil:
    """A reward whose worker can load it only while `marker` does not exist (as a reward module
    deleted or broken mid-run); 'crash' kills its worker, anything else scores its length."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __setstate__(self, state: dict) -> None:
        if os.path.exists(state["marker"]):
            raise ImportError(f"the reward module is gone ({state['marker']} exists)")
        self.__dict__.update(state)

    def __call__(self, prompt, response, answer, **fields):
        if response == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        return float(len(response))


def items_of(responses, answer="3"):
    return [{"prompt": f"p{i}", "response": r, "answer": answer, "weight": 0.5 + i % 3}
            for i, r in enumerate(responses)]


def test_pool_scores_equal_serial_scores_exactly():
    """Built-ins and a user function with fields: the pool's scores are the serial ones, in
    item order, whichever worker scored them."""
    responses = [rf"so \boxed{{{i % 5}}}" if i % 2 else f"answer {i} = 3" for i in range(60)]
    items = items_of(responses)
    for fn in (load_reward_fn("math"), load_reward_fn("math_verify"), field_reward):
        serial = [fn(**item) for item in items]
        pool = RewardPool(fn, num_workers=2, timeout_s=30.0)
        try:
            report = pool.score(items)
            again = pool.score(items)   # the pool is kept across batches
        finally:
            pool.close()
        assert report.scores == serial == again.scores
        assert (report.errors, report.timeouts, report.failures) == (0, 0, 0)
    assert sum(load_reward_fn("math")(**i) for i in items) > 0    # the check is not vacuous


def test_a_hanging_and_a_crashing_item_are_bounded_counted_and_the_rest_score():
    """A call past timeout_s and a worker that dies mid-call each score failure_score and are
    counted; the worker is replaced; every other item scores as serially, and the pool goes on
    to the next batch."""
    responses = ["a", "hang", "bb", "crash", "ccc", "raise", "nan", "dddd"]
    pool = RewardPool(hostile, num_workers=2, timeout_s=2.0, failure_score=-1.0)
    try:
        t0 = time.monotonic()
        report = pool.score(items_of(responses))
        elapsed = time.monotonic() - t0
        assert report.scores == [1.0, -1.0, 2.0, -1.0, 3.0, -1.0, -1.0, 4.0]
        assert (report.errors, report.timeouts, report.failures) == (4, 1, 1)
        assert pool.replaced == 2
        assert elapsed < 60   # bounded (the hanging call sleeps an hour)
        after = pool.score(items_of(["xy", "z"]))
        assert after.scores == [2.0, 1.0] and after.errors == 0
    finally:
        pool.close()


def test_the_thread_scorer_cannot_stop_a_crash_but_the_pool_can():
    """Negative control for the pool's isolation: the same crashing call scored in-process
    (the thread scorer of reward.num_workers=0) takes the caller down with it (run in a child
    interpreter here), where the pool above survives it."""
    code = ("import os, signal\n"
            "from engine.rl.rewards import score_responses\n"
            "def crash(**kw):\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            "score_responses(crash, [dict(prompt='', response='', answer='')], timeout_s=5.0)\n"
            "print('survived')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == -signal.SIGKILL and "survived" not in done.stdout


def test_unpicklable_functions_are_refused_by_name_with_the_fix(monkeypatch, tmp_path):
    from engine.rl.config import RewardConfig   # torch: kept out of the workers' import
    module = tmp_path / "closure_rewards.py"
    module.write_text("import threading\n"
                      "class Holder:\n"
                      "    def __init__(self):\n"
                      "        self.lock = threading.Lock()\n"
                      "    def __call__(self, prompt, response, answer, **f):\n"
                      "        return 1.0\n"
                      "holder = Holder()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    bad = RewardConfig(fn="closure_rewards:holder")
    (problem,) = reward_settings_problems(bad)
    assert "reward.fn='closure_rewards:holder'" in problem and "module-level function" in problem
    assert "reward.num_workers=0" in problem
    assert reward_settings_problems(RewardConfig(fn="closure_rewards:holder", num_workers=0)) == []
    with pytest.raises(ValueError, match="cannot be sent to the scoring worker processes"):
        RewardPool(lambda **kw: 1.0, num_workers=1)


def test_reward_settings_are_checked_by_name():
    from engine.rl.config import RewardConfig   # torch: kept out of the workers' import
    problems = reward_settings_problems(RewardConfig(num_workers=-2, failure_score=float("inf"),
                                                     code_score="most", code_sandbox="off"))
    assert [p.split("=")[0] for p in problems] == ["reward.num_workers", "reward.failure_score",
                                                  "reward.code_score", "reward.code_sandbox"]
    assert "['fraction', 'all']" in problems[2] and "['strict', 'relaxed']" in problems[3]
    assert reward_settings_problems(RewardConfig(fn="math_verify")) == []
    assert reward_fn_for(RewardConfig(fn="code", code_score="all")).score == "all"
    assert default_num_workers() == len(os.sched_getaffinity(0))


def test_the_scorer_submits_as_items_come_and_counts_its_metrics():
    """BatchScorer: submit/wait gives the batch scores (a repeated key is scored once);
    num_workers=0 scores in the trainer with the same results; metrics count timeouts and
    failures and reset when taken."""
    items = items_of(["a", "bb", "hang", "ccc"])
    cfgs = [SimpleNamespace(num_workers=n, timeout_s=1.5, failure_score=0.0) for n in (2, 0)]
    pooled = BatchScorer(hostile, cfgs[0])
    try:
        for i, item in enumerate(items):
            pooled.submit(("k", i), item)
        pooled.submit(("k", 0), items[0])
        report = pooled.wait([("k", i) for i in range(4)] + [("k", 0)])
        assert report.scores == [1.0, 2.0, 0.0, 3.0, 1.0]
        metrics = pooled.take_metrics()
        assert metrics["reward/timeouts"] == 1.0 and metrics["reward/failures"] == 0.0
        assert metrics["time/reward_s"] > 0 and metrics["time/reward_wait_s"] > 0
        assert pooled.take_metrics()["reward/timeouts"] == 0.0
    finally:
        pooled.close()
    local = BatchScorer(hostile, cfgs[1])
    assert local.pool is None
    assert local.score(items_of(["a", "bb"])).scores == [1.0, 2.0]


def _bounded(call, limit_s: float = 90.0):
    """call() in a helper thread: ("ok", value) or ("raised", exception); fails (instead of
    hanging the test) when it has not returned within limit_s."""
    out: list = []

    def run():
        try:
            out.append(("ok", call()))
        except Exception as exc:  # noqa: BLE001 - what the test inspects
            out.append(("raised", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert out, f"the call did not return within {limit_s} s (a wait() blocked for ever)"
    return out[0]


def test_a_replacement_worker_that_cannot_start_fails_every_wait_by_name(tmp_path):
    """A worker dies mid-call and its replacement cannot load the function: the crashed item
    is recorded, and every wait() on the others raises RuntimeError naming the cause (before:
    the service thread died of the error and the waiters blocked for ever). So does a later
    submit or batch. A pool whose first workers cannot load the function refuses at start."""
    marker = tmp_path / "gone"
    pool = RewardPool(LoadsUntil(str(marker)), num_workers=1, timeout_s=30.0)
    try:
        assert pool.score(items_of(["ab"])).scores == [2.0]
        marker.write_text("")
        pool.submit("crash", items_of(["crash"])[0])
        pool.submit("next", items_of(["abc"])[0])
        kind, result = _bounded(lambda: pool.wait(["crash", "next"]))
        assert kind == "raised" and isinstance(result, RuntimeError), result
        assert "reward scoring stopped" in str(result) and "the reward module is gone" in str(
            result) and "crash: the worker died" in str(result)
        (crashed,) = _bounded(lambda: pool.wait(["crash"]))[1]
        assert crashed.failure == "crash" and crashed.score != crashed.score   # NaN: no score
        kind, result = _bounded(lambda: pool.score(items_of(["x"])))
        assert kind == "raised" and "the reward module is gone" in str(result)
        with pytest.raises(RuntimeError, match="the reward module is gone"):
            pool.submit("later", items_of(["y"])[0])
    finally:
        pool.close()
    with pytest.raises(RuntimeError, match="reward worker failed to start: .*module is gone"):
        RewardPool(LoadsUntil(str(marker)), num_workers=1)
