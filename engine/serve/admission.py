"""What one `serve` request may ask, checked before it is queued (each a 400 naming the flag
that sets the limit):
- choices: its prompts x n generate requests at most --max-choices (DEFAULT_MAX_CHOICES, and
  never more than --max-queue; code too_many_choices), counted before any prompt is
  tokenized; the queue then admits all of them or none (--max-queue: 429,
  engine.api.batcher);
- the context budget of each prompt: the one rule of engine.api.budget, with max_tokens
  capped at --max-tokens before it (max_tokens=100000 is served with --max-tokens when
  that fits), in a window of --max-context ids (one fewer when log-probs are asked: the
  vllm engine scores a sequence by generating one token after it; code context_length_exceeded);
- scoring memory: a request with log-probs is scored over each prompt plus its reply, and the
  hf engine holds a sequence's float32 log-probs in one piece (tokens x vocabulary x 4 bytes;
  engine.generation.scoring), so a sequence over --max-score-gib (prompt tokens + the reply's
  budget) is refused (code scoring_too_large) instead of failing in the engine. E.g. 32,768
  tokens on Qwen's vocabulary of 151,936: 18.5 GiB, over the hf default of 4 GiB (at most
  7,067 tokens there); vLLM computes prompt log-probs chunk by chunk, so vllm has no default
  limit.
"""
from __future__ import annotations

from engine.api.budget import Window, reply_budget
from engine.api.requests import ApiError, Call

GIB = 2 ** 30
LOGPROB_BYTES = 4            # float32
DEFAULT_MAX_SCORE_GIB = 4.0  # --max-score-gib on the hf backend (vllm: none)
DEFAULT_MAX_CHOICES = 256    # --max-choices (at most --max-queue)
DEFAULT_MAX_N = 8            # --max-n: the most choices (n) per prompt


def check_choices(call: Call, max_choices: int) -> int:
    """The request's choices (prompts x n); 400 over `max_choices` (module docstring)."""
    prompts = len(call.prompts) if call.kind == "completion" else 1
    choices = prompts * call.n
    if choices > max_choices:
        raise ApiError(400, f"this request asks for {choices} choices ({prompts} prompts x "
                       f"n={call.n}); this endpoint takes at most {max_choices} per request "
                       "(--max-choices, never more than --max-queue): send the prompts in "
                       "smaller requests",
                       "prompt" if call.kind == "completion" else "n",
                       code="too_many_choices")
    return choices


def budget(call: Call, asked: int | None, context: int, which: str, max_context: int,
           max_tokens: int) -> int:
    """The reply's max_tokens for a prompt of `context` ids (`which`: "" or " (prompt i)" of
    a list of prompts; `asked`: max_tokens as sent), by engine.api.budget's rule in
    --max-context (module docstring), `asked` capped at --max-tokens first (a larger value is
    served with --max-tokens, so only what would be generated must fit)."""
    asked = None if asked is None else min(asked, max_tokens)
    most = max_context - (1 if call.logprobs else 0)
    scored = " (max_context - 1 with log-probs)" if call.logprobs else ""
    window = Window(most, f"this request{which}", "prompt tokens",
                    f"this endpoint serves at most {most} tokens{scored} (--max-context "
                    f"{max_context})", "messages" if call.kind == "chat" else "prompt")
    return reply_budget(window, context, asked, call.max_tokens, max_tokens)


def check_scoring(call: Call, tokens: int, which: str, vocab_size: int,
                  max_score_gib: float | None) -> None:
    """400 when a scored sequence of `tokens` ids (prompt + the reply's budget) needs more
    than `max_score_gib` GiB of float32 log-probs (module docstring); None: no limit."""
    if not call.logprobs or max_score_gib is None:
        return
    need = tokens * vocab_size * LOGPROB_BYTES
    if need > max_score_gib * GIB:
        most = int(max_score_gib * GIB // (vocab_size * LOGPROB_BYTES))
        raise ApiError(400, f"this request{which} asks for log-probs over {tokens} tokens "
                       f"(prompt plus max_tokens) on a vocabulary of {vocab_size}: "
                       f"{need / GIB:.3g} GiB of float32 log-probs, over this endpoint's limit "
                       f"of {max_score_gib:g} GiB (--max-score-gib; at most {most} tokens per "
                       "scored sequence): shorten the prompt or lower max_tokens",
                       "messages" if call.kind == "chat" else "prompt",
                       code="scoring_too_large")
