"""Reward functions the tests pass as `reward.fn=tests.rl_rewards:NAME` (or through
tests.test_rl_loop, which re-exports them). A module with no imports: the reward pool's worker
processes (engine.rl.rewards.worker, fresh interpreters) import the function's own module, and
a test module's imports (pytest, torch, the engine: ~10 s of CPU per worker on the 2-core host)
would be paid by every worker of every RL run."""
from __future__ import annotations


def digit_reward(prompt: str, response: str, answer: str, **fields) -> float:
    """Fraction of digit characters in the response: varies within a group even for a random
    model, so advantages (and the update) are non-zero. Used via reward.fn in the CLI tests."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def parity_reward(prompt: str, response: str, answer: str, **fields) -> float:
    """1 for a response of odd length in characters, else 0: about half of the 2-response
    groups agree, so DAPO's dynamic sampling needs more than one generation batch per step."""
    return float(len(response) % 2)


_SLEPT = []


def sleeping_reward(prompt: str, response: str, answer: str, **fields) -> float:
    """Hangs its process for 40 s once (longer than rollout.peer_timeout_s=15 in
    tests/test_rl_async.py), then scores 0."""
    import time
    if not _SLEPT:
        _SLEPT.append(1)
        time.sleep(40)
    return 0.0


def dying_reward(prompt: str, response: str, answer: str, **fields) -> float:
    """Kills its process at once (no exception, no message): a rollout rank that dies."""
    import os
    os._exit(3)
