"""Naming a reward function: `reward.fn` is a built-in name or ``"package.module:function"``,
resolved the same way in the trainer and in every scoring worker (engine.rl.rewards.pool), so
built-ins are module specs too and a heavy one (math-verify) is imported only when chosen.

A reward function is any callable ``fn(prompt: str, response: str, answer: str, **fields) ->
float``; ``fields`` are the extra columns of the dataset row.
"""
from __future__ import annotations

import importlib
import pickle
from collections.abc import Callable
from typing import Any

RewardFn = Callable[..., float]

# name -> "module:function"; docs/rewards.md
BUILTIN_REWARDS: dict[str, str] = {
    "math": "engine.rl.rewards.math_match:math_reward",
    "math_verify": "engine.rl.rewards.verify_math:math_verify_reward",
    "code": "engine.rl.rewards.code:code_reward",
    "none": "engine.rl.rewards.math_match:no_reward",
}


def load_reward_fn(spec: str) -> RewardFn:
    """Resolve a reward function spec: a built-in name (``"math"``) or ``"package.module:fn"``.

    A built-in resolves through its module spec (BUILTIN_REWARDS). Raises ValueError naming
    ``spec`` when it has no colon and is not a built-in, when the
    module cannot be imported, when the attribute is missing, or when it is not callable.
    """
    if spec in BUILTIN_REWARDS:
        return load_reward_fn(BUILTIN_REWARDS[spec])
    valid = f"a built-in ({', '.join(sorted(BUILTIN_REWARDS))}) or 'package.module:function'"
    module_name, colon, attr = spec.partition(":")
    if not colon or not module_name or not attr:
        raise ValueError(f"reward function spec {spec!r} is not {valid}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(f"reward function spec {spec!r}: cannot import module "
                         f"{module_name!r}: {exc}") from exc
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"reward function spec {spec!r}: module {module_name!r} has no "
                             f"attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"reward function spec {spec!r}: {attr!r} is a "
                         f"{type(target).__name__}, not callable")
    return target




def check_picklable(fn: RewardFn, spec: str) -> None:
    """Raise ValueError naming ``spec`` when ``fn`` cannot be sent to a scoring worker process
    (reward.num_workers > 0 pickles it: a module-level function is sent by name, a callable
    object with its state)."""
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise ValueError(
            f"reward.fn={spec!r} cannot be sent to the scoring worker processes "
            f"(reward.num_workers): pickling it failed: {exc!r}. Make it a module-level "
            f"function (or a callable object whose attributes pickle: open clients and locks "
            f"created lazily in the call), or score in the trainer with "
            f"reward.num_workers=0") from exc
