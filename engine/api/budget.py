"""The context-budget rule both servers apply to a call before anything is queued: how many
tokens a reply may take after a prompt of `context` ids, or the 400 "context length exceeded"
(code context_length_exceeded, as vLLM answers) saying what was asked and where the limit comes
from.

Rule (one `Window`: `most` ids a prompt plus its reply may hold):
- room = most - context;
- refused when room < 1 and the call asks for a reply (`asked` is not 0), or when it names a
  max_tokens (`asked`, as sent) over room;
- otherwise the budget is 0 for max_tokens 0 (serve's echo: the prompt scored, nothing
  generated), else min(max_tokens or the default, room), max_tokens already capped at the
  default by the request checks (engine.api.requests).
The agent endpoint's window is a trajectory (train.seq_length + 1 ids, engine.rl.agent.sessions);
serve's is --max-context (one id fewer when log-probs are asked, engine.serve.endpoint).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.api.requests import ApiError


@dataclass(frozen=True)
class Window:
    """Where a server's replies must fit, and how its refusals say so."""

    most: int       # prompt + reply ids at most
    subject: str    # what the message says has the tokens, e.g. "this call's context"
    noun: str       # how it counts them: "tokens", "prompt tokens"
    limit: str      # the limit as the message names it, e.g. "a trajectory holds at most 9 (...)"
    param: str      # the parameter a refusal names ("messages", "prompt")


def reply_budget(window: Window, context: int, asked: int | None, max_tokens: int | None,
                 default: int) -> int:
    """The reply's max_tokens after `context` prompt ids (module docstring). `asked`: the
    max_tokens as the client sent it (None: not sent); `max_tokens`: the checked one (capped at
    `default`); `default`: the reply's tokens when none is named."""
    room = window.most - context
    if (room < 1 and asked != 0) or (asked is not None and asked > room):
        plus = f" plus max_tokens={asked}" if asked is not None else ""
        raise ApiError(400, f"context length exceeded: {window.subject} has {context} "
                       f"{window.noun}{plus}; {window.limit}", window.param,
                       code="context_length_exceeded")
    if max_tokens == 0:
        return 0
    return min(max_tokens or default, room)
