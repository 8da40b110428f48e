"""Reward functions of `python -m tools.bench rewards`, in a module of their own that imports
nothing heavy: the reward pool's workers import it to unpickle them."""
from __future__ import annotations

import time

WORK_S = 0.020   # the GRPO rollout's reward: about 20 ms of CPU per item


def busy_reward(prompt, response, answer, **fields) -> float:
    """WORK_S seconds of busy CPU (a CPU-bound checker's cost), then 1 for a response of odd
    length in characters + 0.25 when it holds the answer."""
    end = time.perf_counter() + WORK_S
    spins = 0
    while time.perf_counter() < end:
        spins += 1
    return float(len(response) % 2) + 0.25 * (str(answer) in response)
