"""Live streams of a step-level serve endpoint (engine.api.stepping): `stream: true`
requests whose reply text can be sent as it is sampled (no log-probs, no echo, no chat tool
parsing: `streams_live`) get each engine step's new text as chunks (engine.api.streaming's
LiveText and chunk shapes), then the rest of the final text, the finish chunk (and the usage
chunk), then [DONE]. The 200 goes out before generation, so a failure after it (a generation
that failed, a bug) ends the stream with engine.api.streaming's error event instead of a 503
body, as vLLM's server does. A client that goes away cancels its choices' futures: the
owner thread aborts them in the engine (their slots free from the next step); a
non-streamed request whose client disconnects while it waits is aborted the same way
(`results_unless_gone`); neither leaves asyncio an unretrieved CancelledError to log
(`cancel_gone`).

Each choice's ids reach the server's event loop through Pending.progress (called on the owner
thread after each step) and `Latest` (one call_soon_threadsafe wake-up waiting at most); only
the latest ids matter (LiveText reads the whole text each time), so a loop that falls behind
the engine sends bigger pieces instead of slowing it.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Awaitable, Callable

from fastapi.responses import StreamingResponse

from engine.api.backend import GenerateRequest
from engine.api.batcher import GenerateQueue
from engine.api.evaluation import chat_reply, completion_reply
from engine.api.requests import ApiError, Call
from engine.api.streaming import LiveText, stream_error
from engine.api.tokens import TemplateRules, continuation_lead


GONE_POLL_S = 0.05   # how often a waiting non-streamed request checks its client


async def results_unless_gone(futures: list, gone: Callable[[], Awaitable[bool]] | None
                              ) -> list:
    """The futures' results (a non-streamed request of a step-level endpoint); when `gone()`
    (the client disconnected, polled every GONE_POLL_S) holds first, the futures are cancelled
    (the owner thread aborts their requests: engine.api.stepping) and ApiError 499 raised
    (nobody reads it). `gone` None: just the results."""
    waiter = asyncio.gather(*[asyncio.wrap_future(f) for f in futures])
    if gone is None:
        return await waiter
    while True:
        done, _ = await asyncio.wait({waiter}, timeout=GONE_POLL_S)
        if done:
            return waiter.result()
        if await gone():
            cancel_gone(waiter)
            raise ApiError(499, "the client closed the request", code="client_closed")


def cancel_gone(waiter: asyncio.Future) -> None:
    """Cancel `waiter` (the gather of a request whose client went away) and retrieve its
    outcome once it settles: a cancelled gather ends holding a CancelledError as its
    exception, which asyncio would otherwise log as "_GatheringFuture exception was never
    retrieved" on every disconnect."""
    waiter.cancel()
    waiter.add_done_callback(lambda done: done.cancelled() or done.exception())


def streams_live(call: Call, rules: TemplateRules) -> bool:
    """A stream whose text can go out as it is sampled (module docstring)."""
    tools = call.kind == "chat" and call.parse_tools and bool(rules.tool_format)
    return call.stream and not call.logprobs and not call.echo and not tools


def _sse(value: dict) -> str:
    return f"data: {json.dumps(value, ensure_ascii=False, allow_nan=False)}\n\n"


class Latest:
    """The latest ids of each choice, handed from the owner thread to the event loop with at
    most one wake-up waiting at a time (a loop that falls behind reads only the newest ids)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, choices: int) -> None:
        self.loop, self.event, self.lock = loop, asyncio.Event(), threading.Lock()
        self.ids: dict[int, list[int]] = {}
        self.posted = False
        self.choices = choices

    def reporter(self, i: int) -> Callable[[list[int]], None]:
        def report(ids: list[int]) -> None:   # on the owner thread
            with self.lock:
                self.ids[i] = ids
                if self.posted or self.loop.is_closed():
                    return
                self.posted = True
            self.loop.call_soon_threadsafe(self.event.set)
        return report

    async def take(self) -> dict[int, list[int]]:
        await self.event.wait()
        with self.lock:
            self.event.clear()
            got, self.ids, self.posted = self.ids, {}, False
        return got


class LiveStream:
    """One live stream: `response()` submits the choices (429 / 503 raised before any byte is
    sent) and returns the StreamingResponse."""

    def __init__(self, rules: TemplateRules, call: Call, contexts: list[list[int]],
                 model: str, rid: str, log: logging.Logger) -> None:
        self.rules, self.call, self.contexts = rules, call, contexts
        self.model, self.rid, self.log = model, rid, log
        self.kind = call.kind
        self.head = {"id": rid, "object": "chat.completion.chunk" if call.kind == "chat"
                     else "text_completion", "created": int(time.time()), "model": model}
        self.usage = {"usage": None} if call.include_usage else {}

    def chunk(self, index: int, text: str | None = None, finish: str | None = None,
              role: bool = False) -> dict:
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else \
                ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None,
                      "finish_reason": finish}
        return {**self.head, "choices": [choice], **self.usage}

    def _text_of(self, i: int) -> Callable[[list[int]], str]:
        lead = (continuation_lead(self.contexts[i // self.call.n])
                if self.kind == "completion" else [])
        return lambda ids: self.rules.reply_text(ids, lead)

    def response(self, queue: GenerateQueue, episode: str,
                 requests: list[GenerateRequest]) -> StreamingResponse:
        updates = Latest(asyncio.get_running_loop(), len(requests))
        futures = queue.submit_many(episode, requests,
                                    [updates.reporter(i) for i in range(len(requests))])
        texts = [LiveText(self._text_of(i), self.call.stop) for i in range(len(requests))]
        return StreamingResponse(self._events(futures, updates, texts),
                                 media_type="text/event-stream")

    async def _events(self, futures, updates: Latest, texts: list[LiveText]):
        waiter = asyncio.gather(*[asyncio.wrap_future(f) for f in futures])
        try:
            if self.kind == "chat":
                for k in range(len(texts)):
                    yield _sse(self.chunk(k, role=True))
            while not waiter.done():
                getter = asyncio.ensure_future(updates.take())
                await asyncio.wait({getter, waiter}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    continue
                for i, ids in sorted(getter.result().items()):
                    piece = texts[i].piece(ids)
                    if piece:
                        yield _sse(self.chunk(i, piece))
            for value in self._ending(waiter.result(), texts):
                yield _sse(value)
        except Exception:  # noqa: BLE001 - the 200 is sent: the stream says it failed
            self.log.exception("request %s: the stream failed after it started", self.rid)
            yield _sse(stream_error(self.rid))
        finally:
            if not waiter.done():          # the client went away: its choices are aborted
                cancel_gone(waiter)
        yield "data: [DONE]\n\n"

    def _ending(self, results: list, texts: list[LiveText]) -> list[dict]:
        """The rest of each choice's final text, its finish chunk, the usage chunk."""
        if self.kind == "chat":
            body, _ = chat_reply(self.rules, self.call, self.contexts[0], results, self.model,
                                 self.rid)
            finals = [c["message"]["content"] or "" for c in body["choices"]]
        else:
            body, _, _ = completion_reply(self.rules, self.call, self.contexts, results,
                                          self.model, self.rid)
            finals = [c["text"] for c in body["choices"]]
        out = []
        for k, (choice, text) in enumerate(zip(body["choices"], texts)):
            rest = text.rest(finals[k])
            if rest:
                out.append(self.chunk(k, rest))
            out.append(self.chunk(k, None, choice["finish_reason"]))
        if self.call.include_usage:
            out.append({**self.head, "choices": [], "usage": body["usage"]})
        return out
