"""The reward.judge.* keys of an RL config, checked before any process group starts
(engine.rl.checks.rl_problems calls judge_problems; docs/rl.md#an-llm-judge)."""
from __future__ import annotations

import math
import os

from engine.config.redaction import redact_text
from engine.rl.judge.scorer import load_parser
# the other ranks wait at most this long in a collective while rank 0 judges
from parallel.timeouts import PROCESS_GROUP_TIMEOUT_S


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


def judge_problems(cfg) -> list[str]:
    """Sentences naming each violated reward.judge.* key (none while base_url is null): an
    http(s) base_url, a model name, a prompt with {prompt} and {response}, a loadable parser,
    a finite weight, concurrency and max_tokens >= 1, timeout_s > 0, deadline_s in
    (0, PROCESS_GROUP_TIMEOUT_S), score_range two finite numbers low < high, temperature in
    [0, 2], api_key_env naming a set variable; agent episodes (env.agent) are not judged yet."""
    judge = cfg.reward.judge
    if judge.base_url is None:
        return []
    p: list[str] = []
    if not isinstance(judge.base_url, str) or not judge.base_url.startswith(("http://",
                                                                            "https://")):
        p.append(f"reward.judge.base_url={redact_text(repr(judge.base_url))} must be an http:// or https:// URL "
                 "ending in /v1 (e.g. megatron-sft-engine serve's), or null (no judge)")
    if not isinstance(judge.model, str) or not judge.model:
        p.append(f"reward.judge.model={judge.model!r} must be a model name")
    for field in ("prompt", "response"):
        if not isinstance(judge.prompt, str) or "{" + field + "}" not in judge.prompt:
            p.append(f"reward.judge.prompt lacks {{{field}}}: the template must contain both "
                     "{prompt} and {response} (the response's prompt and its text)")
    bounds = None if isinstance(judge.score_range, (str, int, float)) or judge.score_range \
        is None else list(judge.score_range)
    if not (bounds is not None and len(bounds) == 2 and all(_number(b) for b in bounds)
            and bounds[0] < bounds[1]):
        p.append(f"reward.judge.score_range={judge.score_range!r} must be two finite numbers "
                 "[low, high] with low < high (e.g. [0, 10]): the verdicts parser=number accepts")
        bounds = [0.0, 10.0]
    try:
        load_parser(str(judge.parser), bounds)
    except ValueError as e:
        p.append(str(e))
    if not _number(judge.weight):
        p.append(f"reward.judge.weight={judge.weight!r} must be a finite number")
    for key in ("concurrency", "max_tokens"):
        if not _positive_int(getattr(judge, key)):
            p.append(f"reward.judge.{key}={getattr(judge, key)!r} must be an integer >= 1")
    if not (_number(judge.timeout_s) and judge.timeout_s > 0):
        p.append(f"reward.judge.timeout_s={judge.timeout_s!r} must be > 0")
    if not (_number(judge.deadline_s) and 0 < judge.deadline_s < PROCESS_GROUP_TIMEOUT_S):
        p.append(f"reward.judge.deadline_s={judge.deadline_s!r} must be > 0 and below the "
                 f"{PROCESS_GROUP_TIMEOUT_S} s process-group timeout (the other ranks wait in a "
                 "collective while rank 0 judges), e.g. 600")
    if not (_number(judge.temperature) and 0 <= judge.temperature <= 2):
        p.append(f"reward.judge.temperature={judge.temperature!r} must be in [0, 2]")
    if judge.api_key_env is not None and not os.environ.get(str(judge.api_key_env)):
        p.append(f"reward.judge.api_key_env={judge.api_key_env!r}: that environment variable "
                 "is not set (or empty); set it, or null for a judge without a key")
    if getattr(cfg.env, "agent", None):
        p.append("reward.judge.base_url with env.agent is not built: agent episodes are not "
                 "judged yet; unset one of them")
    return p
