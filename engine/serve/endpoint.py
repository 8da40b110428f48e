"""The OpenAI-compatible endpoint of `serve`: one fixed base URL, http://HOST:PORT/v1, serving
    GET  /v1/models             the one served model (ServeSettings.model_name)
    POST /v1/chat/completions   messages (tools -> tool_calls, logprobs with top_logprobs,
                                n, stop, stream)
    POST /v1/completions        a text or token-id prompt, or a list of several; echo,
                                logprobs k, max_tokens 0 (with echo), n, stop, stream
    GET  /health                200 once the model is loaded (for scripts that wait for it)
    POST /tokenize, POST /detokenize, GET /tokenizer_info (at the root, as vLLM's), and
    GET  /v1/models/{id}        engine.serve.tokenizer_routes
Each request is logged in one INFO line (engine.api.http.log_requests on REQUEST_LOG; --quiet:
none). A request of more than max_choices choices (prompts x n) is a 400 before its prompts
are tokenized; one whose choices would take the waiting ones past max_pending gets 429 (code
queue_full, Retry-After); once stopping, queued and new requests get 503
(engine.serve.admission, engine.serve.batching). A body is parsed, checked and tokenized on a
worker thread, never on the server's event loop (so /health answers meanwhile).
Stateless: every request is rendered whole (a chat with the generation prompt, as RL prompts
are; a text prompt with the tokenizer's special tokens), checked by the agent endpoint's rules
(engine.api.requests: the same parameters and 400s, any temperature / top_p, and the
evaluation parameters below), queued
(with a step-level backend, the vllm or hf engine's step driver, engine.api.stepping:
each request joins the running engine step; engine.serve.batching, an hf model the step
driver does not serve: concurrent clients share one generate call) and answered by
engine.api.replies. Errors are OpenAI-style bodies: 400 for malformed JSON, a parameter
out of range, or context length exceeded (the prompt, or the prompt plus an explicit
max_tokens, over max_context tokens: code context_length_exceeded); 401 (code invalid_api_key)
without `Authorization: Bearer <key>` when the endpoint has a key (--api-key or
MEGATRON_SFT_ENGINE_API_KEY); 413 for a body over --max-body-mb (16 MiB by default); 503
when generation failed (code generation_failed; the other requests of its batch are answered:
engine.serve.batching) and 500 for a bug: both with a short message naming the request id
(also the X-Request-Id header), the exception with its traceback on ERROR_LOG only.

max_tokens: a request's max_tokens (or max_completion_tokens) is capped at
ServeSettings.max_tokens; absent, the reply may take that many, or what is left of
max_context. A value that does not fit in max_context with the prompt is a 400 (as vLLM's).

Seeds: choice k of a request samples with call_seed(base, 0, k) (engine.api.backend:
choice 0 samples with `base` itself), base = the request's `seed` (any integer, taken mod 2**63)
or, without one, call_seed(ServeSettings.seed, i) for the i-th request accepted (from 0, in
arrival order; refused requests take no number). So a request with a seed gets the same reply
whatever else the endpoint serves (the sample depends on its prompt, seed and settings only,
never on batching), and a fresh server answers the same unseeded sequence of requests the same.
Each prompt of a list samples with these seeds too, as it would alone.

Evaluation (vLLM's request and response shapes: Limits.evaluation in engine.api.requests,
engine.api.evaluation, engine.api.streaming). Log-probs: every log-prob serve reports (the
prompt's tokens under echo, the sampled tokens, the top-k alternatives) is log_softmax of the
model's RAW logits (vLLM's default raw_logprobs: temperature and top_p do not change them),
computed by one scoring pass (RolloutEngine.score, through SamplingBackend's `score`) over
prompt + reply on the serving thread, after the batch's generate calls; k is capped at
ServeSettings.max_logprobs (20, vLLM's default max_logprobs; more is a 400 naming the
parameter and the cap). stream=true: with a step-level backend, a request without
log-probs, echo or chat tool parsing streams live (engine.serve.live: each engine step's new
text as it is sampled); otherwise (the hf batch path, or those requests) the events
are cut from the finished reply and sent after generation (engine.api.streaming). Errors found
before streaming starts are JSON error bodies (a full queue's 429 before the body is read);
one after it started ends the stream with an error event, then [DONE] (engine.api.streaming;
a live stream's generation failure too).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import threading
from dataclasses import dataclass
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engine.api.backend import GenerateBackend, GenerateRequest, call_seed
from engine.api.batcher import GenerationFailed
from engine.api.failures import failure
from engine.api.stepping import StepServing
from engine.api.http import (MAX_BODY_BYTES, add_error_handlers, log_requests, models_body,
                             parse_json, read_body, require_api_key, start_http, stop_http)
from engine.api.evaluation import chat_reply, completion_reply
from engine.api.requests import ApiError, Call, Limits, bad, parse_chat, parse_completion
from engine.api.sampling_fields import FieldError, check_vocabulary
from engine.api.streaming import chat_chunks, completion_chunks, event_stream
from engine.api.tokens import TemplateRules
from engine.errors import RunError
from engine.generation.sampling_backend import StepBackend
from engine.serve.admission import (DEFAULT_MAX_CHOICES, DEFAULT_MAX_N, DEFAULT_MAX_SCORE_GIB,
                                    budget, check_choices, check_scoring)
from engine.serve.batching import CLIENTS, DEFAULT_MAX_QUEUE, STOPPING, ServeQueue
from engine.serve.live import LiveStream, results_unless_gone, streams_live
from engine.serve.tokenizer_routes import add_tokenizer_routes

SEED_RANGE = 2 ** 63
REQUEST_LOG = logging.getLogger("engine.serve")   # one INFO line per request (--quiet: off)
ERROR_LOG = logging.getLogger("engine.serve.errors")   # failed requests' exceptions (always)


@dataclass(frozen=True)
class ServeSettings:
    """The endpoint's defaults and limits (the command's flags)."""

    model_name: str          # what /v1/models lists; a request may name any model
    max_tokens: int          # a reply's tokens: the cap, and the default (--max-tokens)
    max_context: int         # prompt + reply tokens (--max-context)
    temperature: float = 1.0  # when a request gives none (--temperature)
    top_p: float = 1.0       # when a request gives none (--top-p)
    seed: int = 0            # the seeds of requests without one (--seed; module docstring)
    max_logprobs: int = 20   # the most top log-probs a request may ask (vLLM's default cap)
    max_choices: int = DEFAULT_MAX_CHOICES   # prompts x n of one request (--max-choices)
    max_n: int = DEFAULT_MAX_N               # n of one request (--max-n)
    max_score_gib: float | None = DEFAULT_MAX_SCORE_GIB   # scoring memory (--max-score-gib)
    vocab_size: int | None = None   # the logits' width (None: the tokenizer's length)


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
        max_pending: a request whose choices would take the waiting ones past it gets 429
            (--max-queue; None: unbounded; engine.serve.batching); a request may bring
            min(settings.max_choices, max_pending) choices (more could never be queued).
        request_log: the logger of one INFO line per request (engine.api.http.log_requests);
            None: no lines (--quiet).
    """

    def __init__(self, tokenizer, settings: ServeSettings, host: str = "127.0.0.1",
                 port: int = 0, gather_s: float = 0.02, max_batch: int | None = None,
                 api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
                 max_pending: int | None = DEFAULT_MAX_QUEUE,
                 request_log: logging.Logger | None = REQUEST_LOG) -> None:
        self.api_key, self.max_body_bytes = api_key, max_body_bytes
        self.request_log = request_log
        self.rules, self.settings, self.host, self.port = (TemplateRules(tokenizer), settings,
                                                           host, port)
        self.limits = Limits(max_new_tokens=settings.max_tokens,
                             seq_length=settings.max_context - 1,
                             temperature=settings.temperature, top_p=settings.top_p,
                             fixed_sampling=False, model=settings.model_name,
                             evaluation=True, max_logprobs=settings.max_logprobs,
                             max_n=settings.max_n, max_n_flag="--max-n")
        self.max_choices = (settings.max_choices if max_pending is None
                            else min(settings.max_choices, max_pending))
        self.vocab_size = settings.vocab_size or self.rules.vocab_size
        self.queue = ServeQueue(gather_s, max_batch, max_pending)
        self.queue.limit_name = ", --max-queue"
        self.body_limit = f"--max-body-mb {max_body_bytes / 2 ** 20:g}"
        self.app = build_app(self)
        self._lock = threading.Lock()
        self._accepted = 0
        self._token = secrets.token_hex(4)
        self._http = None
        self.live = False   # live streams: a step-level backend (serve; engine.serve.live)

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
        """Requests still queued (and any arriving) get 503 at once; then stop listening (the
        answers go out first, so no handler holds the HTTP thread's shutdown)."""
        self.queue.close(STOPPING)
        if self._http is not None:
            stop_http(*self._http)
            self._http = None

    def serve(self, backend: GenerateBackend, until: Callable[[], bool],
              alive: Callable[[], bool] = lambda: True) -> None:
        """On the engine-owning thread: batches through `backend` (a StepBackend: steps,
        engine.api.stepping) until `until()` holds and nothing is pending. A failed generate
        call answers its failing requests 503 (engine.serve.batching) and serving goes on
        while `alive()` (the engine still works); otherwise RunError."""
        self.queue.alive = alive
        self.live = isinstance(backend, StepBackend)
        run = (StepServing(self.queue, backend, STOPPING).run if self.live
               else lambda stop: self.queue.serve(backend, stop))
        while True:
            try:
                run(until)
                return
            except Exception as e:  # noqa: BLE001 - the batch got its 503s; the engine decides
                if not alive():
                    raise RunError(f"the rollout engine failed and is not alive: "
                                   f"{type(e).__name__}: {e}") from e
                print(f"[serve] warning: a generate call failed ({type(e).__name__}: {e}); "
                      "its failing requests got 503 (their tracebacks: the log)", flush=True)

    def _contexts(self, call: Call) -> list[list[int]]:
        """The prompt ids of each of the call's prompts (a chat: its one rendering)."""
        if call.kind == "chat":
            return [self.rules.prompt_ids(call.messages, call.tools)]
        contexts = []
        for prompt in call.prompts:
            if isinstance(prompt, str):
                contexts.append(self.rules.text_ids(prompt, first=True))
            else:
                self.rules.check_ids(list(prompt))
                contexts.append(list(prompt))
        return contexts

    def _prepare(self, kind: str, raw: bytes) -> tuple[Call, list[list[int]], list[int],
                                                       int | None]:
        """(the call, its prompts' ids, their reply budgets, its seed) of a request body, on
        a worker thread: JSON, checks, the choices' cap before tokenizing, the prompts'
        budgets and scoring memory (engine.serve.admission; 400s)."""
        body = parse_json(raw)
        seed = request_seed(body)
        call = (parse_chat if kind == "chat" else parse_completion)(body, self.limits)
        check_choices(call, self.max_choices)
        try:
            check_vocabulary(call.sampling, self.vocab_size)
        except FieldError as e:
            raise bad(str(e), e.param) from None
        contexts = self._contexts(call)
        asked = requested_max_tokens(body)
        budgets = []
        for i, c in enumerate(contexts):
            which = f" (prompt {i})" if len(contexts) > 1 else ""
            budgets.append(budget(call, asked, len(c), which, self.settings.max_context,
                                  self.settings.max_tokens))
            check_scoring(call, len(c) + budgets[-1], which, self.vocab_size,
                          self.settings.max_score_gib)
        return call, contexts, budgets, seed

    def _accept(self, seed: int | None) -> tuple[int, int]:
        """(the request's number, its base seed) (module docstring)."""
        with self._lock:
            number = self._accepted
            self._accepted += 1
        return number, seed if seed is not None else call_seed(self.settings.seed, number)

    async def handle(self, kind: str, raw: bytes, gone=None) -> Response:
        """One request body: checked and tokenized on a worker thread (400s before anything
        is queued or streamed), its prompts' choices queued (prompt i choice k: seed
        call_seed(base, 0, k), the same as that prompt alone; scored when log-probs are asked:
        raw-logit log-probs, engine.api.evaluation), answered as JSON or, with stream=true, as
        server-sent events (live with a step-level backend, engine.serve.live; else cut from
        the finished reply, engine.api.streaming). A failed generation is a 503 naming the
        request id (module docstring). `gone`: an async check that the client disconnected
        (a step-level backend then aborts a waiting request's choices)."""
        call, contexts, budgets, seed = await asyncio.to_thread(self._prepare, kind, raw)
        self.queue.check_admission(len(contexts) * call.n)   # 429 / 503: no number
        score = call.top_logprobs if call.logprobs else None
        shapes = [GenerateRequest(tuple(context), budget, call.temperature, call.top_p, 0,
                                  score, call.sampling)
                  for context, budget in zip(contexts, budgets)]
        self.queue.check_twins(shapes)   # 503 repeated_failure (the seed is not looked at)
        number, base = self._accept(seed)
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{self._token}-{number}"
        requests = [dataclasses.replace(shape, seed=call_seed(base, 0, k))
                    for shape in shapes for k in range(call.n)]
        if self.live and streams_live(call, self.rules):   # engine.serve.live
            return LiveStream(self.rules, call, contexts, self.limits.model, rid,
                              ERROR_LOG).response(self.queue, CLIENTS, requests)
        try:
            results = await results_unless_gone(self.queue.submit_many(CLIENTS, requests),
                                                gone if self.live else None)
        except GenerationFailed as e:
            raise failure(rid, e.cause, ERROR_LOG, e) from None
        try:
            return self._answer(kind, call, contexts, results, rid)
        except Exception as e:  # noqa: BLE001 - a bug: 500 naming the request, logged
            raise failure(rid, e, ERROR_LOG) from None

    def _answer(self, kind: str, call: Call, contexts: list[list[int]], results: list,
                rid: str) -> Response:
        if kind == "chat":
            reply, replies = chat_reply(self.rules, call, contexts[0], results,
                                        self.limits.model, rid)
            chunks = chat_chunks(self.rules, call, reply, replies) if call.stream else None
        else:
            reply, replies, echoes = completion_reply(self.rules, call, contexts, results,
                                                      self.limits.model, rid)
            chunks = (completion_chunks(self.rules, call, reply, replies, echoes)
                      if call.stream else None)
        if call.stream:
            return event_stream(chunks, rid, ERROR_LOG)
        return JSONResponse(reply)


def build_app(endpoint: ServeEndpoint) -> FastAPI:
    """The FastAPI app of `endpoint`'s routes (module docstring)."""
    app = FastAPI(title="megatron-sft-engine serve", docs_url=None, redoc_url=None,
                  openapi_url=None)
    add_error_handlers(app)
    require_api_key(app, endpoint.api_key, open_paths=("/health",))
    if endpoint.request_log is not None:    # outermost: it logs the key's 401s too
        log_requests(app, endpoint.request_log)
    add_tokenizer_routes(app, endpoint)

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/v1/models")
    async def models() -> dict:
        return models_body(endpoint.limits)

    async def call(request: Request, kind: str) -> Response:
        endpoint.queue.check_admission(1)   # a full queue: 429 before the body is read
        try:
            return await endpoint.handle(kind, await read_body(
                request, endpoint.max_body_bytes, endpoint.body_limit), request.is_disconnected)
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug must answer 500, not drop the request
            raise failure(f"{kind}-{secrets.token_hex(6)}", e, ERROR_LOG) from None

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await call(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await call(request, "completion")

    return app
