"""`stream: true` of `serve`: a response as server-sent events, OpenAI's chunks.

Two ways. Cut from the finished response (`chat_chunks`, `completion_chunks`, `event_stream`:
the batch path of the hf engine, and every request with log-probs or echo, whose log-probs
come from a scoring pass after the reply, or chat tool parsing): sent after generation, the
time to the first token is the whole reply's time. Live (`LiveText`, engine.serve.live: the
vllm engine's step-level serving): each step's new text is sent as it is sampled, the rest
and the finish chunk at the end, with the same chunk shapes. Either is a stream a client
consumes the same way: `data: {chunk}\\n\\n` events, then `data: [DONE]\\n\\n` (media type
text/event-stream).

Chunks (every one with the response's id, created and model):
- chat (`chat.completion.chunk`), choice by choice: a first delta {"role": "assistant",
  "content": ""}, then one content delta per sampled token (with its `logprobs` entry when
  asked; a token whose text is not complete yet, e.g. half of a multi-byte character, gives
  "" and its text comes with a later token), the content's rest, one `tool_calls` delta with
  the parsed calls (each with its `index`) when the reply has them, and a last chunk with an
  empty delta and the choice's finish_reason;
- completions (`text_completion`), choice by choice: with echo, the prompt's text (and its
  tokens' log-probs), then one text piece per sampled token as above, and a last chunk with
  "" and the finish_reason;
- with stream_options.include_usage, every chunk carries "usage": null and a final chunk has
  "choices": [] and the response's usage (OpenAI's shape).
A client concatenating a choice's deltas gets exactly the non-streamed text (token_pieces).

An error once the stream has started (its 200 is sent) ends it with one error event, OpenAI's
error body `data: {"error": {"message", "type": "server_error", "param": null, "code":
"stream_failed"}}` (the message names the request id, nothing of the exception), then `data:
[DONE]`, as vLLM's server ends a failed stream; the exception goes to the server's log.
"""
from __future__ import annotations

import json
import logging
from typing import Callable, Iterable, Iterator

from fastapi.responses import StreamingResponse

from engine.api.evaluation import Echo
from engine.api.replies import Reply
from engine.api.requests import ApiError, Call
from engine.api.tokens import TemplateRules


def token_pieces(rules: TemplateRules, ids: list[int], text: str, lead: list[int] = ()
                 ) -> tuple[list[str], str]:
    """(one piece per id, the rest) with "".join(pieces) + rest == text: the pieces decode
    `ids` incrementally (vLLM's way: the text of a short window of ids before a token and
    with it, held back while it ends in an incomplete character), each kept only while the
    pieces so far spell a prefix of `text` (a stop string or the end-of-turn marker end the
    returned text early; tool-call blocks leave the content), the rest is text beyond them.
    `lead`: the context ids a completion's text follows (Reply.lead), read before the first
    id, so the first piece carries the space the text starts with."""
    decode = rules.tokenizer.decode
    seq = list(lead) + list(ids)
    pieces, emitted, prefix, read = [], "", 0, len(lead)
    for j in range(len(lead) + 1, len(seq) + 1):
        before = decode(seq[prefix:read], skip_special_tokens=True)
        after = decode(seq[prefix:j], skip_special_tokens=True)
        delta = ""
        if len(after) > len(before) and not after.endswith("\ufffd"):
            delta = after[len(before):]
            prefix, read = read, j
        if delta and text.startswith(emitted + delta):
            emitted += delta
            pieces.append(delta)
        else:
            pieces.append("")
    return pieces, text[len(emitted):]


def _head(body: dict, obj: str) -> dict:
    return {"id": body["id"], "object": obj, "created": body["created"],
            "model": body["model"]}


def _chat_choice(rules: TemplateRules, chunk, k: int, choice: dict,
                 reply: Reply) -> Iterator[dict]:
    message = choice["message"]
    content = message.get("content")
    entries = choice["logprobs"]["content"] if choice.get("logprobs") else None
    yield chunk(k, {"role": "assistant", "content": "" if content is not None else None})
    pieces, rest = (token_pieces(rules, reply.ids, content) if content is not None
                    else ([""] * len(reply.ids), ""))
    for j, piece in enumerate(pieces):
        logprobs = {"content": [entries[j]]} if entries is not None else None
        if piece or logprobs:
            yield chunk(k, {"content": piece} if content is not None else {}, logprobs)
    if rest:
        yield chunk(k, {"content": rest})
    if message.get("tool_calls"):
        yield chunk(k, {"tool_calls": [{"index": j, **c}
                                       for j, c in enumerate(message["tool_calls"])]})
    yield chunk(k, {}, None, choice["finish_reason"])


def chat_chunks(rules: TemplateRules, call: Call, body: dict,
                replies: list[Reply]) -> list[dict]:
    """The chat.completion.chunk objects of a chat response `body` (module docstring)."""
    head = _head(body, "chat.completion.chunk")
    usage = {"usage": None} if call.include_usage else {}

    def chunk(k: int, delta: dict, logprobs=None, finish=None) -> dict:
        return {**head, "choices": [{"index": k, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": finish}], **usage}

    out = [c for k, (choice, reply) in enumerate(zip(body["choices"], replies))
           for c in _chat_choice(rules, chunk, k, choice, reply)]
    if call.include_usage:
        out.append({**head, "choices": [], "usage": body["usage"]})
    return out


def _part(logprobs: dict | None, start: int, stop: int) -> dict | None:
    return None if logprobs is None else {key: value[start:stop]
                                          for key, value in logprobs.items()}


def completion_chunks(rules: TemplateRules, call: Call, body: dict, replies: list[Reply],
                      echoes: list[Echo | None]) -> list[dict]:
    """The text_completion chunks of a completions response `body` (module docstring);
    `replies` in choice order, `echoes` one per prompt."""
    head = _head(body, "text_completion")
    usage = {"usage": None} if call.include_usage else {}

    def chunk(index: int, text: str, logprobs=None, finish=None) -> dict:
        return {**head, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                     "finish_reason": finish}], **usage}

    out = []
    for index, (choice, reply) in enumerate(zip(body["choices"], replies)):
        echo, lp = echoes[index // call.n], choice["logprobs"]
        first = len(echo.ids) if echo is not None and lp is not None else 0
        if echo is not None:
            out.append(chunk(index, echo.text, _part(lp, 0, first)))
        pieces, rest = token_pieces(rules, reply.ids, reply.text, reply.lead)
        for j, piece in enumerate(pieces):
            if piece or lp is not None:
                out.append(chunk(index, piece, _part(lp, first + j, first + j + 1)))
        if rest:
            out.append(chunk(index, rest))
        out.append(chunk(index, "", None, choice["finish_reason"]))
    if call.include_usage:
        out.append({**head, "choices": [], "usage": body["usage"]})
    return out


class LiveText:
    """A choice's text sent while its ids are sampled (a step-level server: engine.serve.live):
    `piece(ids)` is the new text to send after the ids so far, always a prefix of the reply's
    final text: the text of every id but the last (a token's text may change with the next
    one: half a character, spaces cleaned up; a final end-of-turn marker is not text), without
    a trailing incomplete character, less the longest stop string's length - 1 characters (a
    stop string may be starting there); nothing more once the text holds a stop string (the
    reply is cut there: engine.api.replies). `rest(final)` is what the final text adds to what
    was sent. `text_of(ids)`: the reply's text of ids (TemplateRules.reply_text with the
    choice's lead)."""

    def __init__(self, text_of: Callable[[list[int]], str], stops: list[str]) -> None:
        self.text_of, self.stops = text_of, list(stops)
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent, self.frozen = "", False

    def piece(self, ids: list[int]) -> str:
        if self.frozen or len(ids) < 2:
            return ""
        text = self.text_of(list(ids[:-1])).rstrip("\ufffd")
        if any(s in text for s in self.stops):
            self.frozen = True
            return ""
        safe = text[:len(text) - self.hold]
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        new, self.sent = safe[len(self.sent):], safe
        return new

    def rest(self, final: str) -> str:
        """The final text past what was sent; RuntimeError if what was sent is not its start
        (the stream then ends with its error event)."""
        if not final.startswith(self.sent):
            raise RuntimeError(f"the streamed text {self.sent[-40:]!r} is not the start of the "
                               "reply's text")
        return final[len(self.sent):]


def stream_error(request_id: str) -> dict:
    """The error event's body of a stream that failed after it started (module docstring)."""
    return ApiError(500, f"the stream of request {request_id} failed after it started; the "
                    "server log has the details", kind="server_error",
                    code="stream_failed").body()


def event_stream(chunks: Iterable[dict], request_id: str = "",
                 log: logging.Logger | None = None) -> StreamingResponse:
    """`chunks` as server-sent events ending with `data: [DONE]`; an error while streaming
    ends them with stream_error's event first, the exception logged on `log` (module
    docstring)."""
    log = log or logging.getLogger(__name__)

    async def events():
        try:
            for c in chunks:
                yield f"data: {json.dumps(c, ensure_ascii=False, allow_nan=False)}\n\n"
        except Exception:  # noqa: BLE001 - the 200 is sent: the stream says it failed
            log.exception("request %s: the stream failed after it started", request_id)
            yield f"data: {json.dumps(stream_error(request_id))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
