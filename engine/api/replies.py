"""A call's generated ids as an OpenAI response.

Each choice's sampled ids go through:
1. stop strings: the reply ends BEFORE the first of the call's `stop` strings in its text, in
   ids as in text: the ids kept are the longest prefix of the sampled ids whose text is a
   prefix of the text before the stop string (the ids that spell the stop string, a token
   that spans its start, and everything sampled after are dropped, as an engine stopping
   there would not have sampled them), the returned text is exactly the kept ids' text, and
   finish_reason is "stop". So what a client sees is what the trajectory holds: a ReAct
   scaffold that appends "\nObservation: ..." after the text (OpenAI semantics: the stop
   string is not returned) never puts the stop string in the trajectory twice;
2. the text: decoded without special tokens and without a final end-of-turn marker
   (engine.api.tokens); a completion's text is what its ids add after the last context ids
   (TemplateRules.reply_text with continuation_lead: prompt + text spells the sequence, a
   space before the first token kept, as vLLM returns it), a chat reply's is decoded alone;
3. tool calls, when the call gave tools with tool_choice "auto" and the chat template has a
   known format (engine.data.tool_calls): parsed calls become `tool_calls` (arguments as JSON
   strings, ids call_<episode>_<call>_<choice>_<j>), the content is the text outside the
   tool-call blocks (null when empty), finish_reason "tool_calls" (a reply cut at max_tokens
   stays "length"); a malformed call leaves the whole text as the content.
Log-probs (when asked): one entry per sampled id kept, the end-of-turn id included: the
generate call's (the agent endpoint: what training uses), or `serve`'s raw-logit scores with
their top-k alternatives (Reply.top, engine.api.evaluation). A log-prob below -9999 (-inf) is
reported as -9999.0, as vLLM does (JSON has no infinity); NaN (a model whose logits overflowed)
as -9999.0 too and +inf as 0.0, so every reported log-prob is a number in JSON.
"""
from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Callable

from engine.api.backend import GenerateResult
from engine.api.requests import Call
from engine.api.tokens import TemplateRules, continuation_lead
from engine.data.tool_calls import parse_tool_calls

TOOL_CALL_BLOCK = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


@dataclass
class Reply:
    ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str
    content: str | None
    tool_calls: list[dict] | None = None
    top: list[dict[int, float]] | None = None   # serve: each kept id's top-k {id: log-prob}
    lead: list[int] = field(default_factory=list)  # completions: the context ids text follows

    def message(self) -> dict:
        out = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


def stop_cut(text_of: Callable[[list[int]], str], ids: list[int], stops: list[str]
             ) -> tuple[int, str] | None:
    """(ids kept, their text) when the reply's text holds one of `stops`, None otherwise (rule
    1 of the module docstring). The first stop string is found in the text of the fewest ids
    that contain one (text grows with ids: bisection); the ids kept are the longest prefix
    whose text the text before it starts with."""
    if not stops or not any(s in text_of(ids) for s in stops):
        return None
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in text_of(ids[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    text = text_of(ids[:lo])
    before = text[:min(text.find(s) for s in stops if s in text)]
    keep = lo - 1
    while keep > 0 and not before.startswith(text_of(ids[:keep])):
        keep -= 1
    return keep, text_of(ids[:keep])


def _tool_calls(rules: TemplateRules, text: str, name: str) -> tuple[str | None, list | None]:
    parsed = parse_tool_calls(text, rules.tool_format)
    if not parsed.calls or parsed.errors:
        return text, None
    calls = [{"id": f"call_{name}_{j}", "type": "function",
              "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
             for j, c in enumerate(parsed.calls)]
    content = None
    if rules.tool_format == "hermes":
        head, sep, tail = text.rpartition("</think>")
        content = (head + sep + TOOL_CALL_BLOCK.sub("", tail)).strip() or None
    return content, calls


def make_reply(rules: TemplateRules, call: Call, result: GenerateResult, name: str,
               context: list[int] | None = None) -> Reply:
    """Choice `name` ("<episode>_<call>_<choice>") of a call from its generate result;
    `context`: the ids it continues (a completion's text follows their last ids, rule 2)."""
    ids, logprobs, finish = list(result.ids), list(result.logprobs), result.finish_reason
    lead = continuation_lead(context) if call.kind == "completion" and context else []

    def text_of(part: list[int]) -> str:
        return rules.reply_text(part, lead)

    cut = stop_cut(text_of, ids, call.stop)
    if cut is not None:
        ids, logprobs, finish, text = ids[:cut[0]], logprobs[:cut[0]], "stop", cut[1]
    else:
        text = text_of(ids)
    content, tool_calls = text, None
    if call.kind == "chat" and call.parse_tools and rules.tool_format:
        content, tool_calls = _tool_calls(rules, text, name)
        if tool_calls and finish != "length":
            finish = "tool_calls"
    return Reply(ids, logprobs, finish, text, content, tool_calls, lead=lead)


def finite(logprob: float) -> float:
    """A log-prob as JSON can carry it (module docstring): at least -9999.0 (vLLM's clamp of
    -inf), NaN as -9999.0, +inf as 0.0."""
    value = float(logprob)
    if math.isnan(value):
        return -9999.0
    return min(max(value, -9999.0), 0.0) if math.isinf(value) else max(value, -9999.0)


def chat_entry(rules: TemplateRules, token: int, logprob: float) -> dict:
    """OpenAI's {token, logprob, bytes} of one token."""
    text = rules.token_text(token)
    return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode())}


def chat_logprobs(rules: TemplateRules, reply: Reply) -> dict:
    """The chat choice's `logprobs`: one entry per id, its `top_logprobs` the top-k
    alternatives most likely first (reply.top; [] without)."""
    tops = reply.top if reply.top is not None else [{}] * len(reply.ids)
    return {"content": [{**chat_entry(rules, token, lp),
                         "top_logprobs": [chat_entry(rules, t, v) for t, v in top.items()]}
                        for token, lp, top in zip(reply.ids, reply.logprobs, tops)]}


def top_dict(rules: TemplateRules, token: int, logprob: float, top: dict[int, float]) -> dict:
    """vLLM's completions `top_logprobs` entry: {text: log-prob} of the chosen token, then the
    top-k alternatives, most likely first (k or k + 1 entries)."""
    out = {rules.token_text(token): finite(logprob)}
    for t, v in top.items():
        out[rules.token_text(t)] = finite(v)
    return out


def completion_logprobs(rules: TemplateRules, ids: list[int], logprobs: list,
                        tops: list | None) -> dict:
    """The completions choice's `logprobs` for `ids` (vLLM's shape): `tokens`,
    `token_logprobs`, `text_offset` (from 0, each token's text length added) and
    `top_logprobs` (None without `tops`; a None log-prob or top: the echoed prompt's first
    token, which has none)."""
    tokens = [rules.token_text(t) for t in ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    top = None if tops is None else [
        None if d is None else top_dict(rules, t, lp, d) for t, lp, d in zip(ids, logprobs, tops)]
    return {"tokens": tokens, "token_logprobs": [None if lp is None else finite(lp)
                                                 for lp in logprobs],
            "top_logprobs": top, "text_offset": offsets}


def response_body(rules: TemplateRules, call: Call, context: list[int], replies: list[Reply],
                  model: str, rid: str) -> dict:
    """The /v1/chat/completions or /v1/completions response of one call."""
    choices = []
    for k, r in enumerate(replies):
        if call.kind == "chat":
            choice = {"index": k, "message": r.message(), "finish_reason": r.finish_reason,
                      "logprobs": chat_logprobs(rules, r) if call.logprobs else None}
        else:
            choice = {"index": k, "text": r.text, "finish_reason": r.finish_reason,
                      "logprobs": completion_logprobs(rules, r.ids, r.logprobs, r.top)
                      if call.logprobs else None}
        if call.return_token_ids:
            choice["token_ids"] = list(r.ids)
        choices.append(choice)
    sampled = sum(len(r.ids) for r in replies)
    body = {"id": rid, "object": "chat.completion" if call.kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": {"prompt_tokens": len(context), "completion_tokens": sampled,
                      "total_tokens": len(context) + sampled}}
    if call.return_token_ids:
        body["prompt_token_ids"] = list(context)
    return body
