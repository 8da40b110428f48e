"""OpenAI request bodies checked against the run's limits: every refusal is an ApiError (an
HTTP status and a message naming the parameter and the limit), never a crash.

Honoured (`Limits`): max_tokens / max_completion_tokens (capped at max_new_tokens: a larger
value is served with max_new_tokens), temperature and top_p (with `fixed_sampling`, as in
training, only the run's values: the trainer recomputes log-probs at the run's temperature, so
a call sampled otherwise would train off-policy; without it any valid value), n (1..max_n),
stop (a string or up to max_stop strings), logprobs (chat: a bool; completions: an integer),
tools and tool_choice ("auto", "none"), return_token_ids (vLLM's extension: the prompt and
sampled ids in the response), response_format {"type": "text"} (json_object / json_schema are
refused by name: there is no constrained decoding).
Accepted and ignored: IGNORED (`seed` among them: the agent endpoint seeds every call from
its episode and its index; serve reads it itself).
Refused: suffix, best_of > 1, and every other parameter, by name; by the agent endpoint also
vLLM's sampling fields other than their neutral values (NEUTRAL: top_k, min_p, the penalties,
logit_bias, ignore_eos, min_tokens, stop_token_ids), which `serve` honours
(engine.api.sampling_fields: Call.sampling).

Evaluation (`Limits.evaluation`, `megatron-sft-engine serve` only; the agent endpoint refuses
each of these saying why: an episode's call is one trajectory whose reply is a training
sample, recorded whole with the sampled tokens' own log-probs):
- completions: `echo` (the prompt's text, and its tokens' log-probs, first), `logprobs: k`
  (top-k alternatives, k <= max_logprobs), `max_tokens: 0` (only with echo: nothing
  generated, the prompt scored), `prompt` as a list of several strings or several id lists;
- chat: `top_logprobs: k` (with logprobs=true, k <= max_logprobs);
- both: `stream` (server-sent events, engine.api.streaming) with
  `stream_options.include_usage`; vLLM's sampling fields (engine.api.sampling_fields: top_k,
  min_p, the penalties, logit_bias, ignore_eos, min_tokens, stop_token_ids) as Call.sampling.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from engine.api.sampling_fields import FIELDS, FieldError, SamplingFields, parse_fields
from engine.data.files import DataError
from engine.data.rows import check_messages, check_tools

IGNORED = {"model", "user", "seed", "metadata", "store", "service_tier", "parallel_tool_calls",
           "prompt_cache_key", "safety_identifier", "reasoning_effort"}
SAMPLES = "it changes what the policy samples"
NEUTRAL = {"presence_penalty": ((0,), SAMPLES), "frequency_penalty": ((0,), SAMPLES),
           "repetition_penalty": ((1,), SAMPLES), "logit_bias": (({},), SAMPLES),
           "top_k": ((-1, 0), SAMPLES), "min_p": ((0,), SAMPLES), "best_of": ((1,), SAMPLES),
           "ignore_eos": ((False,), SAMPLES), "min_tokens": ((0,), SAMPLES),
           "stop_token_ids": (([],), SAMPLES), "suffix": (("",), "suffix is not served")}
BEST_OF = "best_of > 1 is not served (n choices are)"   # serve's reason
# evaluation-only parameters (module docstring) and why the agent endpoint refuses them
SERVE_ONLY = "megatron-sft-engine serve answers it"
AGENT_REFUSES = {
    "stream": "streaming is not served by the agent endpoint: a call's reply is recorded "
              "whole as the episode's training sample",
    "echo": "echo is not served by the agent endpoint: a call's reply is a training sample "
            "of the sampled tokens only"}
COMMON = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop",
          "logprobs", "return_token_ids", "response_format", "stream", "stream_options"}
CHAT = COMMON | {"messages", "tools", "tool_choice", "top_logprobs"}
COMPLETION = COMMON | {"prompt", "echo"}
CONSTRAINED = ("json_object", "json_schema", "regex", "grammar", "structural_tag")


class ApiError(Exception):
    """An OpenAI-style error answer: `status` and {"error": {"message", "type", "param"}};
    `request_id` (set by a server for its 5xx answers) goes out as X-Request-Id."""

    request_id: str | None = None

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
    max_n: int = 8                   # n per prompt at most
    max_n_flag: str = ""             # what sets max_n, named in its 400 (serve: "--max-n")
    max_stop: int = 4
    model: str = "policy"            # the name /v1/models lists
    evaluation: bool = False         # serve: echo, top-k, max_tokens 0, prompt lists, stream
    max_logprobs: int = 20           # evaluation: the most top log-probs per position


@dataclass
class Call:
    """One checked request; `messages` (chat) or `prompt` (completions: text or ids)."""

    kind: str                        # "chat" or "completion"
    max_tokens: int | None           # None: as many as fit (at most max_new_tokens); 0: echo
    temperature: float
    top_p: float
    n: int
    stop: list[str]
    logprobs: bool                   # log-probs in the reply
    return_token_ids: bool
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    parse_tools: bool = False        # tools given and tool_choice "auto"
    prompt: str | list[int] | None = None     # completions: the first (the agent's only) one
    prompts: list | None = None      # completions: every prompt, in order (evaluation: several)
    top_logprobs: int = 0            # evaluation: alternatives per position (logprobs on)
    echo: bool = False               # evaluation, completions: the prompt first
    stream: bool = False             # evaluation: server-sent events
    include_usage: bool = False      # stream_options.include_usage
    sampling: SamplingFields | None = None    # serve: vLLM's sampling fields (None: neutral)


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
    """The requested reply length; 0 only with echo under evaluation (module docstring)."""
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else \
        "max_tokens"
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad(f"{key} must be an integer >= 1, got {value!r:.50}", key)
    if value == 0 and not limits.evaluation:
        raise bad(f"{key} must be an integer >= 1, got 0: a call of an episode samples a "
                  f"reply ({key}=0 with echo scores a prompt: {SERVE_ONLY})", key)
    if value == 0 and body.get("echo") is not True:
        raise bad(f"{key}=0 is served only with echo=true on /v1/completions (nothing is "
                  "generated: the prompt is scored), as vLLM", key)
    return min(value, limits.max_new_tokens)


def _stop(body: dict, limits: Limits) -> list[str]:
    value = body.get("stop")
    stops = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop must be a non-empty string or a list of them", "stop")
    if len(stops) > limits.max_stop:
        raise bad(f"stop has {len(stops)} strings; at most {limits.max_stop}", "stop")
    return stops


def _response_format(body: dict) -> None:
    """{"type": "text"} or nothing; a constrained format is refused by name."""
    value = body.get("response_format")
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in CONSTRAINED:
        raise bad(f"response_format type {kind!r} is not honoured: this server has no "
                  "constrained decoding; send {'type': 'text'} or leave response_format out",
                  "response_format")
    if kind != "text":
        raise bad(f"response_format must be {{'type': 'text'}}, got {value!r:.80}",
                  "response_format")


def _stream(body: dict, limits: Limits) -> tuple[bool, bool]:
    """(stream, stream_options.include_usage); stream_options without stream is ignored."""
    stream, options = body.get("stream") or False, body.get("stream_options")
    if not isinstance(stream, bool):
        raise bad(f"stream must be a boolean, got {stream!r:.20}", "stream")
    if options is None or not limits.evaluation:
        return stream, False
    usage = options.get("include_usage", False) if isinstance(options, dict) else None
    if not isinstance(usage, bool):
        raise bad("stream_options must be an object like {'include_usage': true}",
                  "stream_options")
    return stream, usage


def _common(body: dict, limits: Limits, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    for key, value in body.items():
        if key in FIELDS and limits.evaluation:
            continue                         # serve: parse_fields checks them
        if key in NEUTRAL:
            neutral, why = NEUTRAL[key]
            why = BEST_OF if key == "best_of" and limits.evaluation else why
            if value is not None and (isinstance(value, bool) != isinstance(neutral[0], bool)
                                      or value not in neutral):
                raise bad(f"{key}={value!r:.50} is refused: {why}; leave it out", key)
        elif key in AGENT_REFUSES and not limits.evaluation:
            if value not in (None, False):
                raise bad(f"{key}={value!r:.50} is refused: {AGENT_REFUSES[key]} "
                          f"({SERVE_ONLY}); leave it out", key)
        elif key == "echo" and key not in allowed:
            if value not in (None, False):
                raise bad("echo is served on /v1/completions only", key)
        elif key not in allowed and key not in IGNORED:
            raise bad(f"unsupported parameter {key!r}", key)
    n = body.get("n") if body.get("n") is not None else 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= limits.max_n:
        flag = f" ({limits.max_n_flag} {limits.max_n})" if limits.max_n_flag else ""
        raise bad(f"n={n!r:.20} must be an integer in [1, {limits.max_n}]{flag}", "n")
    temperature, top_p = _sampling(body, limits)
    _response_format(body)
    stream, include_usage = _stream(body, limits)
    max_tokens = _max_tokens(body, limits)
    asked = body.get("max_completion_tokens")
    asked = body.get("max_tokens") if asked is None else asked
    try:
        sampling = parse_fields(body, asked) if limits.evaluation else None
    except FieldError as e:
        raise bad(str(e), e.param) from None
    return dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                n=n, stop=_stop(body, limits), stream=stream, include_usage=include_usage,
                return_token_ids=bool(body.get("return_token_ids", False)), sampling=sampling)


def _text_parts(messages: list[dict]) -> list[dict]:
    """Content given as a list of text parts becomes one string (images are not served)."""
    for i, m in enumerate(messages):
        if isinstance(m.get("content"), list):
            if any(p.get("type") != "text" for p in m["content"]):
                raise bad(f"messages[{i}].content has a part other than text; only text is "
                          "served", "messages")
            m["content"] = "".join(p["text"] for p in m["content"])
    return messages


def _top_logprobs(body: dict, limits: Limits, logprobs: bool) -> int:
    """Chat's top_logprobs: 0 without; k needs logprobs=true, evaluation and k <= the cap."""
    k = body.get("top_logprobs")
    if k is None or k == 0 and not isinstance(k, bool):
        return 0
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise bad(f"top_logprobs must be an integer >= 0, got {k!r:.20}", "top_logprobs")
    if not limits.evaluation:
        raise bad("top_logprobs is refused by the agent endpoint: a call records only the "
                  f"sampled tokens' log-probs, what training uses ({SERVE_ONLY})",
                  "top_logprobs")
    if not logprobs:
        raise bad("top_logprobs needs logprobs=true", "top_logprobs")
    if k > limits.max_logprobs:
        raise bad(f"top_logprobs={k} is over this server's cap of {limits.max_logprobs} "
                  "(max_logprobs, as vLLM's)", "top_logprobs")
    return k


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
    return Call("chat", messages=messages, tools=tools, logprobs=logprobs,
                top_logprobs=_top_logprobs(body, limits, logprobs),
                parse_tools=bool(tools) and choice == "auto", **common)


def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def _prompts(body: dict, limits: Limits) -> list:
    """Every prompt of a completions body, in order: one string or id list, or (evaluation)
    a list of several strings or several id lists."""
    prompt = body.get("prompt")
    if (isinstance(prompt, str) and prompt) or _is_ids(prompt):
        return [prompt]
    texts = isinstance(prompt, list) and bool(prompt) and all(
        isinstance(p, str) and p for p in prompt)
    if texts or (isinstance(prompt, list) and bool(prompt) and all(map(_is_ids, prompt))):
        if len(prompt) == 1 or limits.evaluation:
            return list(prompt)
        raise bad(f"prompt is a list of {len(prompt)} prompts; the agent endpoint takes one "
                  "prompt per call: a call extends one trajectory of the episode "
                  f"(a list of prompts: {SERVE_ONLY})", "prompt")
    several = ", or a list of several of either" if limits.evaluation else ""
    raise bad(f"prompt must be one non-empty string or one non-empty list of token ids"
              f"{several}", "prompt")


def _completion_logprobs(body: dict, limits: Limits) -> tuple[bool, int]:
    """(log-probs asked, top-k): null, or an integer 0..max_logprobs (evaluation), 0
    (the agent endpoint: only the sampled tokens' log-probs)."""
    k = body.get("logprobs")
    if k is None:
        return False, 0
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise bad(f"logprobs must be an integer >= 0 or null, got {k!r:.20}", "logprobs")
    if k and not limits.evaluation:
        raise bad(f"logprobs={k} is refused by the agent endpoint: a call records only the "
                  "sampled tokens' log-probs, what training uses; send logprobs=0 "
                  f"(top-k log-probs: {SERVE_ONLY})", "logprobs")
    if k > limits.max_logprobs:
        raise bad(f"logprobs={k} is over this server's cap of {limits.max_logprobs} "
                  "(max_logprobs, as vLLM's)", "logprobs")
    return True, k


def parse_completion(body: dict, limits: Limits) -> Call:
    """A /v1/completions body as a Call (ApiError 400 otherwise)."""
    common = _common(body, limits, COMPLETION)
    prompts = _prompts(body, limits)
    echo = body.get("echo") or False
    if not isinstance(echo, bool):
        raise bad(f"echo must be a boolean, got {echo!r:.20}", "echo")
    logprobs, k = _completion_logprobs(body, limits)
    return Call("completion", prompt=prompts[0], prompts=prompts, logprobs=logprobs,
                top_logprobs=k, echo=echo, **common)
