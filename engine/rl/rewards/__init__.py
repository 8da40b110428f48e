"""Reward functions and their scoring (docs/rewards.md).

Modules: registry (`reward.fn` names and `package.module:function` specs), math_match (`math`,
`none`), verify_math (`math_verify`, Hugging Face math-verify), code (`code`: the reply's
block (fences) against the row's tests (code_tests), run by code_runner in the bubblewrap
sandbox (sandbox, bwrap), results crossing as plain_data), scoring (one call's checks; the in-process thread scorer),
outcome (an item's Outcome and a batch's ScoreReport: scores and named failures), pool (the
process pool of `reward.num_workers`, per-item timeouts), worker (one pool process),
worker_process (the pool's handle of one),
cpus (the default worker count: the CPUs the rank may use), scorer (a collector's scoring).

The contract: ``load_reward_fn(name)`` returns ``fn(prompt, response, answer, **fields) ->
float``; users and tests call it directly. This package scores in the calling process's pool;
no collective (engine.rl.collect.rank_scoring spreads a batch over the ranks' pools).

May import: nothing else in engine.rl (engine.rl.rewards is a leaf).
"""
from engine.rl.rewards.math_match import (extract_answer, last_boxed, last_number, math_reward,
                                          no_reward, normalize_answer)
from engine.rl.rewards.registry import (BUILTIN_REWARDS, RewardFn, check_picklable,
                                        load_reward_fn)
from engine.rl.rewards.scoring import call_reward, score_responses

__all__ = ["BUILTIN_REWARDS", "RewardFn", "call_reward", "check_picklable", "extract_answer",
           "last_boxed", "last_number", "load_reward_fn", "math_reward", "no_reward",
           "normalize_answer", "score_responses"]
