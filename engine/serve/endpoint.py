"""The OpenAI-compatible endpoint of `serve`: one fixed base URL, http://HOST:PORT/v1, serving
    GET  /v1/models             the one served model (ServeSettings.model_name)
    POST /v1/chat/completions   messages (tools -> tool_calls, logprobs, n, stop)
    POST /v1/completions        a text or token-id prompt
    GET  /health                200 once the model is loaded (for scripts that wait for it)
Stateless: every request is rendered whole (a chat with the generation prompt, as RL prompts
are; a text prompt with the tokenizer's special tokens), checked by the agent endpoint's rules
(engine.api.requests: the same parameters and 400s, any temperature / top_p), queued
(engine.serve.batching: concurrent clients share one generate call) and answered by
engine.api.replies. Errors are OpenAI-style bodies: 400 for malformed JSON, a parameter
out of range, or context length exceeded (the prompt, or the prompt plus an explicit
max_tokens, over max_context tokens: code context_length_exceeded); 401 (code invalid_api_key)
without `Authorization: Bearer <key>` when the endpoint has a key (--api-key); 413 for a body
over --max-body-mb (16 MiB by default); 503 when generation failed.

max_tokens: a request's max_tokens (or max_completion_tokens) is capped at
ServeSettings.max_tokens; absent, the reply may take that many, or what is left of
max_context. A value that does not fit in max_context with the prompt is a 400 (as vLLM's).

Seeds: choice k of a request samples with call_seed(base, 0, k) (engine.api.backend:
choice 0 samples with `base` itself), base = the request's `seed` (any integer, taken mod 2**63)
or, without one, call_seed(ServeSettings.seed, i) for the i-th request accepted (from 0, in
arrival order; refused requests take no number). So a request with a seed gets the same reply
whatever else the endpoint serves (the sample depends on its prompt, seed and settings only,
never on batching), and a fresh server answers the same unseeded sequence of requests the same.
"""
from __future__ import annotations

import asyncio
import secrets
import threading
from dataclasses import dataclass
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from engine.api.backend import GenerateBackend, GenerateRequest, call_seed
from engine.api.http import (MAX_BODY_BYTES, add_error_handlers, json_body, models_body,
                             require_api_key, start_http, stop_http)
from engine.api.replies import make_reply, response_body
from engine.api.requests import ApiError, Call, Limits, bad, parse_chat, parse_completion
from engine.api.tokens import TemplateRules
from engine.errors import RunError
from engine.serve.batching import CLIENTS, ServeQueue

SEED_RANGE = 2 ** 63


@dataclass(frozen=True)
class ServeSettings:
    """The endpoint's defaults and limits (the command's flags)."""

    model_name: str          # what /v1/models lists; a request may name any model
    max_tokens: int          # a reply's tokens: the cap, and the default (--max-tokens)
    max_context: int         # prompt + reply tokens (--max-context)
    temperature: float = 1.0  # when a request gives none (--temperature)
    top_p: float = 1.0       # when a request gives none (--top-p)
    seed: int = 0            # the seeds of requests without one (--seed; module docstring)


def request_seed(body: dict) -> int | None:
    """The request's `seed` (mod 2**63), None when absent; 400 when not an integer."""
    seed = body.get("seed") if isinstance(body, dict) else None
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise bad(f"seed must be an integer, got {seed!r:.50}", "seed")
    return seed % SEED_RANGE


def requested_max_tokens(body: dict) -> int | None:
    """max_completion_tokens, else max_tokens, as sent (parse_* checked it)."""
    value = body.get("max_completion_tokens")
    return body.get("max_tokens") if value is None else value


class ServeEndpoint:
    """The endpoint (module docstring): `start()` the HTTP thread, then on the thread that
    owns the rollout engine `serve(backend, until)`; `stop()` at the end.

    Args:
        tokenizer: the model's tokenizer (its chat template renders chats).
        settings: defaults and limits.
        host, port: where to listen (loopback by default; 0: a free port).
        gather_s, max_batch: the batching rule (engine.serve.batching).
        api_key: when set, requests need `Authorization: Bearer <api_key>` (401 otherwise;
            /health stays open); None: open (--api-key).
        max_body_bytes: a request body over it is a 413 (--max-body-mb).
    """

    def __init__(self, tokenizer, settings: ServeSettings, host: str = "127.0.0.1",
                 port: int = 0, gather_s: float = 0.02, max_batch: int | None = None,
                 api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.api_key, self.max_body_bytes = api_key, max_body_bytes
        self.rules, self.settings, self.host, self.port = (TemplateRules(tokenizer), settings,
                                                           host, port)
        self.limits = Limits(max_new_tokens=settings.max_tokens,
                             seq_length=settings.max_context - 1,
                             temperature=settings.temperature, top_p=settings.top_p,
                             fixed_sampling=False, model=settings.model_name)
        self.queue = ServeQueue(gather_s, max_batch)
        self.app = build_app(self)
        self._lock = threading.Lock()
        self._accepted = 0
        self._token = secrets.token_hex(4)
        self._http = None

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def start(self) -> "ServeEndpoint":
        server, thread, self.port = start_http(self.app, self.host, self.port,
                                               "serve endpoint", "choose another --port")
        self._http = (server, thread)
        return self

    def stop(self) -> None:
        """Stop listening; requests still queued get 503."""
        if self._http is not None:
            stop_http(*self._http)
            self._http = None
        self.queue.fail_all("the server is stopping")

    def serve(self, backend: GenerateBackend, until: Callable[[], bool],
              alive: Callable[[], bool] = lambda: True) -> None:
        """On the engine-owning thread: batches through `backend` until `until()` holds and
        nothing is pending. A failed generate call answers its batch 503 and serving goes on
        while `alive()` (the engine still works); otherwise RunError."""
        while True:
            try:
                self.queue.serve(backend, until)
                return
            except Exception as e:  # noqa: BLE001 - the batch got its 503s; the engine decides
                if not alive():
                    raise RunError(f"the rollout engine failed and is not alive: "
                                   f"{type(e).__name__}: {e}") from e
                print(f"[serve] warning: a generate call failed ({type(e).__name__}: {e}); "
                      "its requests got 503", flush=True)

    def _context(self, call: Call) -> list[int]:
        if call.kind == "chat":
            return self.rules.prompt_ids(call.messages, call.tools)
        if isinstance(call.prompt, str):
            return self.rules.text_ids(call.prompt, first=True)
        self.rules.check_ids(list(call.prompt))
        return list(call.prompt)

    def _budget(self, call: Call, asked: int | None, context: int) -> int:
        room = self.settings.max_context - context
        if room < 1 or (asked is not None and asked > room):
            plus = f" plus max_tokens={asked}" if asked is not None else ""
            raise ApiError(400, f"context length exceeded: this request has {context} prompt "
                           f"tokens{plus}; this endpoint serves at most "
                           f"{self.settings.max_context} tokens (--max-context)", "messages"
                           if call.kind == "chat" else "prompt", code="context_length_exceeded")
        return min(call.max_tokens or self.settings.max_tokens, room)

    def _accept(self, seed: int | None) -> tuple[int, int]:
        """(the request's number, its base seed) (module docstring)."""
        with self._lock:
            number = self._accepted
            self._accepted += 1
        return number, seed if seed is not None else call_seed(self.settings.seed, number)

    async def handle(self, kind: str, body: dict) -> JSONResponse:
        seed = request_seed(body)
        call = (parse_chat if kind == "chat" else parse_completion)(body, self.limits)
        context = self._context(call)
        budget = self._budget(call, requested_max_tokens(body), len(context))
        number, base = self._accept(seed)
        futures = [asyncio.wrap_future(self.queue.submit(CLIENTS, GenerateRequest(
            tuple(context), budget, call.temperature, call.top_p, call_seed(base, 0, k))))
            for k in range(call.n)]
        results = await asyncio.gather(*futures)
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{self._token}-{number}"
        replies = [make_reply(self.rules, call, r, f"{rid}_{k}") for k, r in enumerate(results)]
        return JSONResponse(response_body(self.rules, call, context, replies,
                                          self.limits.model, rid))


def build_app(endpoint: ServeEndpoint) -> FastAPI:
    """The FastAPI app of `endpoint`'s routes (module docstring)."""
    app = FastAPI(title="megatron-sft-engine serve", docs_url=None, redoc_url=None,
                  openapi_url=None)
    add_error_handlers(app)
    require_api_key(app, endpoint.api_key, open_paths=("/health",))

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/v1/models")
    async def models() -> dict:
        return models_body(endpoint.limits)

    async def call(request: Request, kind: str) -> JSONResponse:
        try:
            return await endpoint.handle(kind, await json_body(request,
                                                               endpoint.max_body_bytes))
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug must answer 500, not drop the request
            raise ApiError(500, f"{type(e).__name__}: {e}", kind="server_error") from e

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        return await call(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        return await call(request, "completion")

    return app
