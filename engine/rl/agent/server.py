"""The OpenAI-compatible HTTP server of agent episodes (docs/agents.md).

Every episode gets its own base URL, http://HOST:PORT/episodes/<id>/v1 (what
`openai.OpenAI(base_url=...)` takes), <id> 22 URL-safe characters carrying 128 random bits
from `secrets` (`new_episode_id`): no episode's URL can be derived from another's, so a
scaffold (or code it runs) reaches only the episodes whose URL it was given. It serves
    GET  /v1/models             the one served model (Limits.model)
    POST /v1/chat/completions   messages, tools -> choices with tool_calls, logprobs
    POST /v1/completions        a text or token-id prompt
Requests are checked (engine.api.requests), matched to the episode's earlier calls and
given their context (engine.rl.agent.sessions), queued for the engine-owning thread, and
answered (engine.api.replies). Two ways to run them, by the backend `serve` is given:
- a StepBackend over a step driver (engine.generation.sampling_backend; the rollout's one
  in-process engine, engine.rl.agent.rollout): continuous batching (engine.api.stepping):
  each call joins the running engine step and is answered at its own end, whatever the
  other episodes do; no gathering (gather_s and max_wait_s are not used);
- a batched GenerateBackend (SamplingBackend over the pool's generate: several engines, or an
  engine without a driver): the gather rule of engine.api.batcher (gather_s, the expected
  episodes, max_wait_s), one generate call per batch. Errors are OpenAI-style JSON
bodies: 400 (malformed JSON, a parameter beyond the run's limits, context length exceeded,
env.max_turns reached), 401 (an api_key is set and the request lacks `Authorization: Bearer
<key>`), 413 (a body over max_body_bytes, 16 MiB by default), 404 (no such episode), 410 (the
episode finished or timed out), 429 (max_pending choices wait: code queue_full), 503
(generation failed, or the server is stopping; the queue's bound counts the running
choices too on the step path; a full queue answers 429 before the body is read); nothing a client sends crashes the server.
With request_log, every request is logged in one INFO line (engine.api.http.log_requests; off
by default).

Threads: uvicorn runs FastAPI in a daemon thread with its own event loop (`start`); the thread
that owns the rollout engines calls `serve(backend, until)` (the only place the backend runs).
The server listens on loopback by default; port 0 picks a free port (`port` after `start`).
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from typing import Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from engine.api.backend import GenerateBackend, GenerateRequest
from engine.api.batcher import GenerateQueue
from engine.api.failures import failure
from engine.api.stepping import StepServing
from engine.api.http import (MAX_BODY_BYTES, add_error_handlers, json_body, log_requests,
                             models_body, require_api_key, start_http, stop_http)
from engine.api.replies import make_reply, response_body
from engine.api.requests import ApiError, Limits, parse_chat, parse_completion
from engine.api.tokens import TemplateRules
from engine.generation.sampling_backend import StepBackend
from engine.rl.agent.sessions import Episode

FINISHED_KEPT = 1 << 16   # finished episode ids remembered for 410 (older ones: 404)
ERROR_LOG = logging.getLogger("engine.rl.agent.errors")   # failed calls' exceptions (always)


def new_episode_id() -> str:
    """128 random bits from `secrets`, URL-safe (22 characters): independent of every other
    id, so knowing one episode's URL gives nothing about another's."""
    return secrets.token_urlsafe(16)


class AgentServer:
    """Episodes, their URLs and the HTTP thread (module docstring).

    Args:
        tokenizer: the policy's tokenizer (its chat template renders prompts and observations).
        limits: what a call may ask for.
        host, port: where to listen (loopback by default; 0: a free port).
        gather_s, max_wait_s, max_batch: the gather rule of the batched path
            (engine.api.batcher); the step path does not gather.
        api_key: when set, every request must carry `Authorization: Bearer <api_key>` (401
            otherwise; require_api_key); None: open (env.agent_api_key).
        max_body_bytes: a request body over it is a 413 (json_body).
        max_pending: a call arriving while this many choices wait gets 429 (None: unbounded;
            engine.api.batcher).
        request_log: the logger of one INFO line per request; None (default): no lines.
    """

    def __init__(self, tokenizer, limits: Limits, host: str = "127.0.0.1", port: int = 0,
                 gather_s: float = 0.2, max_wait_s: float = 2.0,
                 max_batch: int | None = None, api_key: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES, max_pending: int | None = None,
                 request_log: logging.Logger | None = None) -> None:
        self.rules, self.limits, self.host, self.port = TemplateRules(tokenizer), limits, host, port
        self.api_key, self.max_body_bytes = api_key, max_body_bytes
        self.request_log = request_log
        self.episodes: dict[str, Episode] = {}
        self._lock = threading.Lock()
        self._finished: dict[str, None] = {}  # closed ids, oldest first (FINISHED_KEPT)
        self._new_id = new_episode_id
        self.queue = GenerateQueue(self._live, self._refusal, gather_s, max_wait_s,
                                   max_batch, max_pending)
        self.app = build_app(self)
        self.stepping: StepServing | None = None   # the last step-path loop (serve)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifetime
    def start(self) -> "AgentServer":
        self._server, self._thread, self.port = start_http(
            self.app, self.host, self.port, "agent server",
            "choose another env.agent_port (0: any free port)")
        return self

    def stop(self) -> None:
        """Queued calls (and any arriving) get 503 at once, then the server stops listening."""
        self.queue.close("the server is stopping")
        if self._server is not None:
            stop_http(self._server, self._thread)
            self._server = None

    def __enter__(self) -> "AgentServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ episodes
    def open_episode(self, seed: int) -> Episode:
        """A new episode seeded with its response seed; its URL is base_url(episode.id)."""
        with self._lock:
            eid = self._new_id()
            while eid in self.episodes or eid in self._finished:   # 2**-128: never, but exact
                eid = self._new_id()
            episode = self.episodes[eid] = Episode(eid, seed, self.rules, self.limits)
        return episode

    def close_episode(self, eid: str, reason: str = "it finished") -> Episode | None:
        """No more calls for `eid` (later ones get 410); returns the episode (None when it
        was closed already)."""
        with self._lock:
            episode = self.episodes.pop(eid, None)
            if episode is not None:
                self._finished[eid] = None
                if len(self._finished) > FINISHED_KEPT:
                    del self._finished[next(iter(self._finished))]
        if episode is not None:
            episode.close(reason)
            self.queue.forget(eid)
        return episode

    def base_url(self, eid: str) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/episodes/{eid}/v1"

    def episode(self, eid: str) -> Episode:
        with self._lock:
            episode = self.episodes.get(eid)
            if episode is None:
                if eid in self._finished:
                    raise ApiError(410, f"episode {eid} has finished; it takes no more calls")
                raise ApiError(404, f"no episode {eid!r} on this server", kind="not_found_error")
        return episode

    def _live(self) -> dict[str, tuple[float, int]]:
        """{id: (start time, calls accepted)} of the live episodes."""
        with self._lock:
            episodes = [e for e in self.episodes.values() if e.live]
        return {e.id: (e.started, e.calls) for e in episodes}

    def _refusal(self, eid: str) -> str | None:
        with self._lock:
            episode = self.episodes.get(eid)
        return "it finished" if episode is None else episode.refusal()

    # ------------------------------------------------------------------ serving
    def serve(self, backend: GenerateBackend | StepBackend, until: Callable[[], bool]) -> None:
        """On the engine-owning thread, until `until()` holds and nothing is queued or
        running: a StepBackend's steps (continuous batching; `stepping` keeps the loop, its
        step_s the engine's busy seconds), else generate batches by the gather rule (module
        docstring)."""
        if isinstance(backend, StepBackend):
            self.stepping = StepServing(self.queue, backend)
            self.stepping.run(until)
        else:
            self.queue.serve(backend, until)

    async def handle(self, eid: str, kind: str, body: dict) -> JSONResponse:
        episode = self.episode(eid)
        call = (parse_chat if kind == "chat" else parse_completion)(body, self.limits)
        self.queue.check_admission()   # a 429 / 503 takes no call index of the episode
        plan = episode.plan(call)
        futures = [asyncio.wrap_future(f) for f in self.queue.submit_many(eid, [
            GenerateRequest(tuple(plan.context), plan.budget, call.temperature, call.top_p,
                            seed) for seed in plan.seeds])]
        try:
            results = await asyncio.gather(*futures)
            replies = [make_reply(self.rules, call, r, f"{eid}_{plan.call}_{k}", plan.context)
                       for k, r in enumerate(results)]
            for k, r in enumerate(replies):
                episode.record(plan, k, r.ids, r.logprobs, r.finish_reason,
                               r.message() if kind == "chat" else r.text)
            prefix = "chatcmpl" if kind == "chat" else "cmpl"
            return JSONResponse(response_body(self.rules, call, plan.context, replies,
                                              self.limits.model, f"{prefix}-{eid}-{plan.call}"))
        finally:
            self.queue.responded(eid, len(futures))


def build_app(server: AgentServer) -> FastAPI:
    """The FastAPI app of `server`'s routes (module docstring)."""
    app = FastAPI(title="agent episodes", docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app)
    require_api_key(app, server.api_key)
    if server.request_log is not None:     # outermost: it logs the key's 401s too
        log_requests(app, server.request_log)

    @app.get("/episodes/{eid}/v1/models")
    async def models(eid: str) -> dict:
        server.episode(eid)
        return models_body(server.limits)

    async def call(eid: str, request: Request, kind: str) -> JSONResponse:
        server.episode(eid)                  # 404 / 410 first
        server.queue.check_admission(1)      # a full queue: 429 before the body is read
        try:
            return await server.handle(eid, kind, await json_body(request,
                                                                  server.max_body_bytes))
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug must answer 500, not drop the request
            raise failure(f"{kind}-{secrets.token_hex(6)}", e, ERROR_LOG) from None

    @app.post("/episodes/{eid}/v1/chat/completions")
    async def chat(eid: str, request: Request) -> JSONResponse:
        return await call(eid, request, "chat")

    @app.post("/episodes/{eid}/v1/completions")
    async def completions(eid: str, request: Request) -> JSONResponse:
        return await call(eid, request, "completion")

    return app
