"""`serve`'s replies with scores (Limits.evaluation): the generate results of one call, their
raw-logit scores (engine.api.backend: GenerateRequest.score_top_k) and, for completions, the
echoed prompts and several prompts, as vLLM's server answers them.

Log-probs. Every log-prob serve reports (the prompt's tokens under echo, the sampled tokens,
the top-k alternatives) is the scoring pass's: log_softmax of the model's RAW logits over
prompt + reply (vLLM's default raw_logprobs; the request's temperature and top_p do not change
them), never the sampling log-probs. A choice's ids are a prefix of what was scored (a stop
string drops the ids after it), so its entries are the first len(ids) reply entries.

Completions: prompt i's choice k is choice index i * n + k (prompt-major, as vLLM); with echo
its text starts with the prompt's text (a text prompt as sent; an id prompt decoded with its
special tokens) and, with logprobs, its `logprobs` lists the prompt's tokens first, the first
entry's token_logprobs and top_logprobs null. usage sums over the prompts (prompt_tokens:
each prompt once; completion_tokens: every choice's sampled ids).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

from engine.api.backend import GenerateResult
from engine.api.replies import Reply, completion_logprobs, make_reply, response_body
from engine.api.requests import Call
from engine.api.tokens import TemplateRules


@dataclass
class Echo:
    """The echoed prompt of a completions choice."""

    text: str
    ids: list[int]
    logprobs: list[float | None]             # [None] + the scores (log-probs asked), else []
    top: list[dict[int, float] | None]


def scored_reply(rules: TemplateRules, call: Call, result: GenerateResult,
                 context: list[int], name: str) -> Reply:
    """make_reply, then (when the request was scored) its log-probs replaced by the raw
    scores of its kept ids and their top-k alternatives (module docstring)."""
    reply = make_reply(rules, call, result, name, context)
    if result.scores is None:
        return reply
    start, n = len(context) - 1, len(reply.ids)
    return replace(reply, logprobs=result.scores.logprobs[start:start + n],
                   top=result.scores.top[start:start + n])


def echo_of(rules: TemplateRules, prompt, ids: list[int], result: GenerateResult) -> Echo:
    """Prompt `prompt` (as sent: text or ids) echoed, with the prompt's scores when the
    request was scored."""
    text = prompt if isinstance(prompt, str) else rules.tokenizer.decode(ids)
    if result.scores is None:
        return Echo(text, list(ids), [], [])
    m = len(ids) - 1
    return Echo(text, list(ids), [None] + result.scores.logprobs[:m],
                [None] + result.scores.top[:m])


def chat_reply(rules: TemplateRules, call: Call, context: list[int],
               results: list[GenerateResult], model: str, rid: str
               ) -> tuple[dict, list[Reply]]:
    """(the /v1/chat/completions body, its replies) of one chat call."""
    replies = [scored_reply(rules, call, r, context, f"{rid}_{k}")
               for k, r in enumerate(results)]
    return response_body(rules, call, context, replies, model, rid), replies


def _choice(rules: TemplateRules, call: Call, index: int, reply: Reply,
            echo: Echo | None) -> dict:
    head = echo or Echo("", [], [], [])
    choice = {"index": index, "text": head.text + reply.text,
              "finish_reason": reply.finish_reason, "logprobs": None}
    if call.logprobs:
        tops = None if reply.top is None else head.top + reply.top
        choice["logprobs"] = completion_logprobs(rules, head.ids + reply.ids,
                                                 head.logprobs + reply.logprobs, tops)
    if call.return_token_ids:
        choice["token_ids"] = list(reply.ids)
    return choice


def completion_reply(rules: TemplateRules, call: Call, contexts: list[list[int]],
                     results: list[GenerateResult], model: str, rid: str
                     ) -> tuple[dict, list[Reply], list[Echo | None]]:
    """(the /v1/completions body, its replies in choice order, each prompt's Echo or None)
    of one completions call; `results` prompt-major (module docstring)."""
    n, choices, replies = call.n, [], []
    echoes = [echo_of(rules, p, c, results[i * n]) if call.echo else None
              for i, (p, c) in enumerate(zip(call.prompts, contexts))]
    for index, result in enumerate(results):
        i = index // n
        reply = scored_reply(rules, call, result, contexts[i], f"{rid}_{index}")
        replies.append(reply)
        choice = _choice(rules, call, index, reply, echoes[i])
        if call.return_token_ids and len(contexts) > 1:
            choice["prompt_token_ids"] = list(contexts[i])
        choices.append(choice)
    prompt_tokens = sum(len(c) for c in contexts)
    sampled = sum(len(r.ids) for r in replies)
    body = {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": sampled,
                      "total_tokens": prompt_tokens + sampled}}
    if call.return_token_ids and len(contexts) == 1:
        body["prompt_token_ids"] = list(contexts[0])
    return body, replies, echoes
