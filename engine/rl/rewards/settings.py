"""The `reward.*` keys of scoring (fn, num_workers, timeout_s, failure_score, code_score,
code_sandbox): their checks, run before any process group starts, and the reward function
they configure."""
from __future__ import annotations

import math
from typing import Any

from engine.rl.rewards.code import SANDBOX_MODES, SCORE_MODES, CodeReward
from engine.rl.rewards.pool import default_num_workers
from engine.rl.rewards.registry import RewardFn, check_picklable, load_reward_fn
from engine.rl.rewards.sandbox import describe, missing_layers


def reward_fn_for(reward: Any) -> RewardFn:
    """reward.fn resolved (engine.rl.rewards.load_reward_fn); `code` configured by
    reward.code_score and reward.timeout_s."""
    if reward.fn == "code":
        return CodeReward(reward.code_score, reward.timeout_s)
    return load_reward_fn(reward.fn)


def reward_settings_problems(reward: Any) -> list[str]:
    """Every problem of the scoring keys, each naming its key and the valid choices: reward.fn
    loads (and pickles when reward.num_workers != 0); num_workers null or >= 0; failure_score
    null or finite; code_score and code_sandbox known; with fn=code and code_sandbox=strict, every
    sandbox layer enforceable here (engine.rl.rewards.sandbox.missing_layers)."""
    p = []
    workers = reward.num_workers
    if workers is not None and not (isinstance(workers, int) and workers >= 0):
        p.append(f"reward.num_workers={workers!r} must be null (the CPUs this rank may use), "
                 "0 (score in the trainer) or a positive number of processes")
    score = reward.failure_score
    if score is not None and not (isinstance(score, (int, float)) and math.isfinite(score)):
        p.append(f"reward.failure_score={score!r} must be a finite number or null (a failed "
                 "call's group leaves the update)")
    if reward.code_score not in SCORE_MODES:
        p.append(f"reward.code_score={reward.code_score!r} is not one of {list(SCORE_MODES)}")
    if reward.code_sandbox not in SANDBOX_MODES:
        p.append(f"reward.code_sandbox={reward.code_sandbox!r} is not one of "
                 f"{list(SANDBOX_MODES)}")
    if p:
        return p
    try:
        fn = reward_fn_for(reward)
    except ValueError as e:
        return [f"reward.fn: {e}"]
    if workers != 0:
        try:
            check_picklable(fn, reward.fn)
        except ValueError as e:
            p.append(str(e))
    if reward.fn == "code" and reward.code_sandbox == "strict" and missing_layers():
        missing = "; ".join(f"{k}: {v}" for k, v in missing_layers().items())
        p.append(f"reward.fn=code with reward.code_sandbox=strict: this host cannot enforce "
                 f"every sandbox layer ({missing}); run where it can, or set "
                 f"reward.code_sandbox=relaxed to run with the layers it has ({describe()})")
    return p


def scoring_header(reward: Any) -> str:
    """The run header's line on scoring: reward.fn, its workers and bound; with fn=code the
    sandbox layers active and missing (engine.rl.rewards.sandbox.describe)."""
    workers = reward.num_workers
    where = ("in the trainer (reward.num_workers=0)" if workers == 0 else
             f"in {default_num_workers() if workers is None else workers} worker processes")
    bound = "no bound" if reward.timeout_s is None else f"{reward.timeout_s:g} s per call"
    line = f"reward.fn={reward.fn} scored {where}, {bound}"
    if reward.fn == "code":
        line += f"; reward.code_sandbox={reward.code_sandbox}, {describe()}"
    return line
