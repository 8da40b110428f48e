"""OpenAI request bodies checked against the run's limits: every refusal is an ApiError (an
HTTP status and a message naming the parameter and the limit), never a crash.

Honoured (`Limits`): max_tokens / max_completion_tokens (capped at max_new_tokens: a larger
value is served with max_new_tokens), temperature and top_p (with `fixed_sampling`, as in
training, only the run's values: the trainer recomputes log-probs at the run's temperature, so
a call sampled otherwise would train off-policy; without it any valid value), n (1..max_n),
stop (a string or up to max_stop strings), logprobs (chat: a bool, top_logprobs 0; completions:
0 or null: only the sampled tokens' log-probs exist), tools and tool_choice ("auto", "none"),
return_token_ids (vLLM's extension: the prompt and sampled ids in the response).
Accepted and ignored: IGNORED (`seed` among them: every call is seeded from its episode and
its index). Refused: stream=true, any penalty, logit_bias, echo, suffix, best_of > 1, and
every other parameter, by name.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from engine.data.files import DataError
from engine.data.rows import check_messages, check_tools

IGNORED = {"model", "user", "seed", "metadata", "store", "service_tier", "parallel_tool_calls",
           "stream_options", "prompt_cache_key", "safety_identifier", "reasoning_effort"}
SAMPLES = "it changes what the policy samples"
NEUTRAL = {"presence_penalty": ((0,), SAMPLES), "frequency_penalty": ((0,), SAMPLES),
           "repetition_penalty": ((1,), SAMPLES), "logit_bias": (({},), SAMPLES),
           "top_k": ((-1, 0), SAMPLES), "min_p": ((0,), SAMPLES), "best_of": ((1,), SAMPLES),
           "stream": ((False,), "streaming is not served (responses come whole)"),
           "echo": ((False,), "echo is not served"), "suffix": (("",), "suffix is not served")}
COMMON = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop",
          "logprobs", "return_token_ids"}
CHAT = COMMON | {"messages", "tools", "tool_choice", "top_logprobs"}
COMPLETION = COMMON | {"prompt"}


class ApiError(Exception):
    """An OpenAI-style error answer: `status` and {"error": {"message", "type", "param"}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclass(frozen=True)
class Limits:
    """What one call may ask for (the run's settings)."""

    max_new_tokens: int              # rollout.max_new_tokens
    seq_length: int                  # train.seq_length: a trajectory holds seq_length + 1 ids
    temperature: float               # rollout.temperature (the default)
    top_p: float                     # rollout.top_p (the default)
    max_turns: int | None = None     # env.max_turns: calls per episode
    fixed_sampling: bool = True      # temperature / top_p must be the run's (training)
    max_n: int = 8
    max_stop: int = 4
    model: str = "policy"            # the name /v1/models lists


@dataclass
class Call:
    """One checked request; `messages` (chat) or `prompt` (completions: text or ids)."""

    kind: str                        # "chat" or "completion"
    max_tokens: int | None           # None: as many as fit (at most max_new_tokens)
    temperature: float
    top_p: float
    n: int
    stop: list[str]
    logprobs: bool
    return_token_ids: bool
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    parse_tools: bool = False        # tools given and tool_choice "auto"
    prompt: str | list[int] | None = None


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def _number(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(f"{key} must be a number, got {value!r:.50}", key)
    if value > hi or value < lo or (lo_open and value == lo):
        raise bad(f"{key}={value} is out of range ({'(' if lo_open else '['}{lo:g}, {hi:g}])",
                  key)
    return float(value)


def _sampling(body: dict, limits: Limits) -> tuple[float, float]:
    t = _number(body, "temperature", limits.temperature, 0.0, 2.0, False)
    p = _number(body, "top_p", limits.top_p, 0.0, 1.0, True)
    if limits.fixed_sampling:
        for key, value, run in (("temperature", t, limits.temperature), ("top_p", p, limits.top_p)):
            if value != run:
                raise bad(f"{key}={value:g} differs from the run's rollout.{key}={run:g}; the "
                          "trainer recomputes log-probs with the run's sampling settings, so "
                          f"leave {key} out or send {run:g}", key)
    return t, p


def _max_tokens(body: dict, limits: Limits) -> int | None:
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else \
        "max_tokens"
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad(f"{key} must be an integer >= 1, got {value!r:.50}", key)
    return min(value, limits.max_new_tokens)


def _stop(body: dict, limits: Limits) -> list[str]:
    value = body.get("stop")
    stops = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop must be a non-empty string or a list of them", "stop")
    if len(stops) > limits.max_stop:
        raise bad(f"stop has {len(stops)} strings; at most {limits.max_stop}", "stop")
    return stops


def _common(body: dict, limits: Limits, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    for key, value in body.items():
        if key in NEUTRAL:
            neutral, why = NEUTRAL[key]
            if value is not None and (isinstance(value, bool) != isinstance(neutral[0], bool)
                                      or value not in neutral):
                raise bad(f"{key}={value!r:.50} is refused: {why}; leave it out", key)
        elif key not in allowed and key not in IGNORED:
            raise bad(f"unsupported parameter {key!r}", key)
    n = body.get("n") if body.get("n") is not None else 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= limits.max_n:
        raise bad(f"n={n!r:.20} must be an integer in [1, {limits.max_n}]", "n")
    temperature, top_p = _sampling(body, limits)
    return dict(max_tokens=_max_tokens(body, limits), temperature=temperature, top_p=top_p,
                n=n, stop=_stop(body, limits),
                return_token_ids=bool(body.get("return_token_ids", False)))


def _text_parts(messages: list[dict]) -> list[dict]:
    """Content given as a list of text parts becomes one string (images are not served)."""
    for i, m in enumerate(messages):
        if isinstance(m.get("content"), list):
            if any(p.get("type") != "text" for p in m["content"]):
                raise bad(f"messages[{i}].content has a part other than text; only text is "
                          "served", "messages")
            m["content"] = "".join(p["text"] for p in m["content"])
    return messages


def parse_chat(body: dict, limits: Limits) -> Call:
    """A /v1/chat/completions body as a Call (ApiError 400 otherwise)."""
    common = _common(body, limits, CHAT)
    try:
        messages = _text_parts(check_messages(body.get("messages"), "messages", "request"))
    except DataError as e:
        raise bad(str(e), "messages") from None
    try:
        tools = check_tools(body.get("tools"), "request")
    except DataError as e:
        raise bad(str(e), "tools") from None
    choice = body.get("tool_choice") or "auto"
    if choice not in ("auto", "none"):
        raise bad(f"tool_choice={choice!r:.80} is not served; use 'auto' or 'none'",
                  "tool_choice")
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise bad("logprobs must be a boolean", "logprobs")
    if body.get("top_logprobs"):
        raise bad("top_logprobs is not served: only the sampled tokens' log-probs are known",
                  "top_logprobs")
    return Call("chat", messages=messages, tools=tools, logprobs=logprobs,
                parse_tools=bool(tools) and choice == "auto", **common)


def parse_completion(body: dict, limits: Limits) -> Call:
    """A /v1/completions body as a Call (ApiError 400 otherwise)."""
    common = _common(body, limits, COMPLETION)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                           and t >= 0 for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not (ids and prompt):
        raise bad("prompt must be one non-empty string or one non-empty list of token ids",
                  "prompt")
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0) or isinstance(logprobs, bool):
        raise bad(f"logprobs={logprobs!r:.20} is not served: only the sampled tokens' "
                  "log-probs are known (logprobs=0)", "logprobs")
    return Call("completion", prompt=prompt, logprobs=logprobs == 0, **common)
