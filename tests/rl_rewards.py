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
