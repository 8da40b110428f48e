"""The environment contract of `env.fn` (docs/multi-turn.md):

- `Class(row: dict, **env.kwargs)`: one instance per episode (prompt row x sample); `row` is the
  dataset row (prompt, answer and every extra field);
- `step(action: str) -> {"observations": [chat messages], "reward": float, "done": bool}`:
  `action` is the decoded text of the assistant turn just generated; observation messages have
  role "tool" or "user" and string content. An optional "metrics" dict of numbers is summed
  over the step's episodes under env/<name> (the tool environment reports tool_calls and
  tool_errors this way);
- optional `close()`, called once the episode ended.
The episode's reward is the sum of its step rewards; env.max_turns bounds its assistant turns.
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field

ENV_TOOLS = "tools"          # env.fn of the built-in tool environment

OBSERVATION_ROLES = ("tool", "user")


class EnvError(RuntimeError):
    """An environment broke the contract (its episode ends with reward 0, counted)."""


@dataclass
class StepResult:
    observations: list[dict]
    reward: float
    done: bool
    metrics: dict[str, float] = field(default_factory=dict)


def load_object(spec: str, key: str):
    """The attribute named by "package.module:name"; ValueError naming `key` otherwise."""
    module_name, colon, attr = str(spec).partition(":")
    if not colon or not module_name or not attr:
        raise ValueError(f"{key}={spec!r} is not 'package.module:name'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure of user code
        raise ValueError(f"{key}={spec!r}: cannot import module {module_name!r}: {e}") from None
    if not hasattr(module, attr):
        raise ValueError(f"{key}={spec!r}: module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)


def load_env_class(spec: str) -> type:
    """The environment class of env.fn="package.module:Class" (ValueError naming env.fn)."""
    cls = load_object(spec, "env.fn")
    if not isinstance(cls, type) or not callable(getattr(cls, "step", None)):
        raise ValueError(f"env.fn={spec!r} is not a class with a step(action) method")
    return cls


def check_step(result) -> StepResult:
    """`result` of env.step as a StepResult; EnvError saying what is wrong otherwise."""
    if not isinstance(result, dict):
        raise EnvError(f"step returned a {type(result).__name__}, not a dict with "
                       "observations, reward, done")
    missing = [k for k in ("observations", "reward", "done") if k not in result]
    if missing:
        raise EnvError(f"step's result lacks {missing}")
    obs = result["observations"]
    if not isinstance(obs, list):
        raise EnvError(f"step's observations must be a list of messages, got {type(obs).__name__}")
    for i, m in enumerate(obs):
        if (not isinstance(m, dict) or m.get("role") not in OBSERVATION_ROLES
                or not isinstance(m.get("content"), str)):
            raise EnvError(f"observation {i} must be a message with role 'tool' or 'user' and "
                           f"string content, got {m!r:.200}")
    try:
        reward = float(result["reward"])
    except (TypeError, ValueError):
        raise EnvError(f"step's reward {result['reward']!r:.100} is not a number") from None
    if not math.isfinite(reward):
        raise EnvError(f"step's reward {reward} is not finite")
    metrics = result.get("metrics") or {}
    if not isinstance(metrics, dict):
        raise EnvError("step's metrics must be a dict of numbers")
    return StepResult(obs, reward, bool(result["done"]),
                      {str(k): float(v) for k, v in metrics.items()})


