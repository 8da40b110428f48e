"""vLLM's sampling fields of one `serve` request (SamplingFields) and their checks: top_k,
min_p, repetition_penalty, presence_penalty, frequency_penalty, logit_bias, ignore_eos,
min_tokens, stop_token_ids, with vLLM 0.32's ranges and meanings (vllm.SamplingParams):

- repetition_penalty r > 0 over the prompt's and the reply's tokens: a seen token's logit l
  becomes l / r when l > 0, else l * r;
- presence_penalty p, frequency_penalty f in [-2, 2] over the reply's tokens: a token seen c
  times in the reply loses f * c + p * (c > 0);
- logit_bias {id: b}: b (clamped to [-100, 100]) added to that id's logit (keys may be
  strings of integers, as OpenAI's clients send them);
- min_tokens m >= 0: the end-of-sequence ids and stop_token_ids are masked while the reply
  has fewer than m tokens (an m above the request's max_tokens is a 400, as vLLM answers; a
  reply the server's budget ends earlier ends there);
- ignore_eos: the end-of-sequence ids do not end the reply (stop_token_ids still do);
- stop_token_ids: ids that end the reply (kept in it, finish_reason "stop");
- top_k k (0 or -1: off; else >= 1) and min_p in [0, 1] restrict the random draw after the
  temperature (greedy ignores them, as vLLM).

vLLM's order: min_tokens mask, logit_bias, repetition, frequency, presence, then temperature,
min_p, top_k, top_p (engine.generation.processing writes it for the hf backend; the vllm
backend hands the fields to vLLM). None of them changes a log-prob: `serve` reports the
scoring pass's raw ones (as vLLM's default raw_logprobs), and the sampling log-probs stay
engine.generation.base's contract (log_softmax of the unshaped logits / T) on both backends.

`serve` (Limits.evaluation) takes them; the agent endpoint refuses each other than its neutral
value (engine.api.requests.NEUTRAL): a training sample must be the policy's own draw.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

FIELDS = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
          "logit_bias", "ignore_eos", "min_tokens", "stop_token_ids")
MAX_BIAS = 100.0      # vLLM clamps a logit bias to [-100, 100]
MAX_LISTED = 1024     # logit_bias entries / stop_token_ids at most (a body bound, not vLLM's)


@dataclass(frozen=True)
class SamplingFields:
    """One request's vLLM sampling fields (module docstring); the defaults are neutral."""

    top_k: int = 0                                  # 0: off (-1 is read as 0)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (id, bias), ids ascending
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()

    @property
    def neutral(self) -> bool:
        return self == SamplingFields()

    def stop_ids(self, eos_ids) -> frozenset[int]:
        """The ids that end the reply: the end-of-sequence ids (unless ignore_eos) and
        stop_token_ids."""
        own = frozenset(self.stop_token_ids)
        return own if self.ignore_eos else own | frozenset(eos_ids)

    def min_tokens_masked(self, eos_ids) -> frozenset[int]:
        """The ids masked while the reply is shorter than min_tokens: the end-of-sequence
        ids (ignore_eos or not, as vLLM's all_stop_token_ids) and stop_token_ids."""
        return frozenset(eos_ids) | frozenset(self.stop_token_ids)


class FieldError(ValueError):
    """A bad field: the message and the field's name (engine.api.requests answers 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _int(body: dict, key: str, lo: int) -> int:
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise FieldError(f"{key} must be an integer >= {lo}, got {value!r:.50}", key)
    return value


def _float(body: dict, key: str, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value > hi or value < lo or (lo_open and value == lo):
        span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise FieldError(f"{key} must be a number in {span}, got {value!r:.50}", key)
    return float(value)


def _token_id(value, key: str) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise FieldError(f"{key} must name token ids (integers >= 0), got {value!r:.30}", key)
    return value


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    if not isinstance(value, dict) or len(value) > MAX_LISTED:
        raise FieldError(f"logit_bias must be an object of at most {MAX_LISTED} entries "
                   "{token id: bias}", "logit_bias")
    out = {}
    for key, bias in value.items():
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or \
                not math.isfinite(bias):
            raise FieldError(f"logit_bias[{key!r:.20}] must be a number, got {bias!r:.30}",
                       "logit_bias")
        out[_token_id(key, "logit_bias")] = min(MAX_BIAS, max(-MAX_BIAS, float(bias)))
    return tuple(sorted(out.items()))


def parse_fields(body: dict, max_tokens: int | None) -> SamplingFields | None:
    """The request's SamplingFields, None when every one is absent or neutral (the request
    samples as without them); a bad value is a FieldError naming the field. `max_tokens`: the
    requested reply length (None: not given)."""
    given = {k: body[k] for k in FIELDS if body.get(k) is not None}
    if not given:
        return None
    out = {}
    if "top_k" in given:
        out["top_k"] = max(0, _int(given, "top_k", -1))
    if "min_p" in given:
        out["min_p"] = _float(given, "min_p", 0.0, 1.0)
    if "repetition_penalty" in given:
        out["repetition_penalty"] = _float(given, "repetition_penalty", 0.0, math.inf, True)
    for key in ("presence_penalty", "frequency_penalty"):
        if key in given:
            out[key] = _float(given, key, -2.0, 2.0)
    if "logit_bias" in given:
        out["logit_bias"] = _logit_bias(given["logit_bias"])
    if "ignore_eos" in given:
        if not isinstance(given["ignore_eos"], bool):
            raise FieldError(f"ignore_eos must be a boolean, got {given['ignore_eos']!r:.20}",
                       "ignore_eos")
        out["ignore_eos"] = given["ignore_eos"]
    if "min_tokens" in given:
        out["min_tokens"] = _int(given, "min_tokens", 0)
        if max_tokens is not None and out["min_tokens"] > max_tokens:
            raise FieldError(f"min_tokens={out['min_tokens']} must be <= max_tokens={max_tokens}",
                       "min_tokens")
    if "stop_token_ids" in given:
        ids = given["stop_token_ids"]
        if not isinstance(ids, list) or len(ids) > MAX_LISTED or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise FieldError(f"stop_token_ids must be a list of at most {MAX_LISTED} token ids "
                       f"(integers >= 0), got {ids!r:.50}", "stop_token_ids")
        out["stop_token_ids"] = tuple(dict.fromkeys(ids))
    result = SamplingFields(**out)
    return None if result.neutral else result


def check_vocabulary(sampling: SamplingFields | None, vocab_size: int | None) -> None:
    """FieldError when a field names a token id outside [0, vocab_size) (a 400, as vLLM's
    server answers)."""
    if sampling is None or vocab_size is None:
        return
    for key in ("logit_bias", "stop_token_ids"):
        named = [t for t, _ in sampling.logit_bias] if key == "logit_bias" \
            else list(sampling.stop_token_ids)
        outside = [t for t in named if t >= vocab_size]
        if outside:
            raise FieldError(f"{key} names token ids outside the vocabulary [0, {vocab_size}): "
                       f"{outside[:5]}", key)

