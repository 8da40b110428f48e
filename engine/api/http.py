"""HTTP plumbing shared by both OpenAI servers (the agent endpoint, `serve`): uvicorn in a
daemon thread (start_http / stop_http), the JSON body with its size limit (413) and its shape
(400 for what is not plain JSON: NaN, integers over MAX_INT_DIGITS digits, nesting deeper than
MAX_JSON_DEPTH), OpenAI-style error bodies for ApiError (with Retry-After for a 429,
X-Request-Id when the error names its request) and routing errors, the optional API key (401),
the /v1/models bodies, one log line per request (log_requests).
"""
from __future__ import annotations

import json
import logging
import re
import secrets
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from engine.api.requests import ApiError, Limits, bad
from engine.errors import RunError

START_TIMEOUT_S = 30.0
MAX_BODY_BYTES = 16 << 20  # a request body over it is a 413 (both servers' default)
MAX_JSON_DEPTH = 64        # nesting levels of a request body (deeper: 400, never a crash)
MAX_INT_DIGITS = 100       # digits of an integer in a request body (more: 400)
_LONG_INT = re.compile(rb"\d{%d}" % (MAX_INT_DIGITS + 1))


def start_http(app: FastAPI, host: str, port: int, what: str, hint: str
               ) -> tuple[uvicorn.Server, threading.Thread, int]:
    """Serve `app` with uvicorn in a daemon thread on host:port (0: a free port), bound and
    started before it returns: (the uvicorn server, its thread, the port). A port that cannot
    be bound is a RunError naming `what` (the server) and ending with `hint`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise RunError(f"the {what} cannot listen on {host}:{port}: {e}; {hint}") from None
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            timeout_keep_alive=60)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                              name=what.replace(" ", "-"), daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RunError(f"the {what} did not start on {host}:{port}")
        time.sleep(0.01)
    return server, thread, port


def stop_http(server: uvicorn.Server, thread: threading.Thread) -> None:
    """Stop a server of start_http and wait (at most 10 s) for its thread."""
    server.should_exit = True
    thread.join(timeout=10)


def model_object(limits: Limits) -> dict:
    """The served model as OpenAI's model object (GET /v1/models/{id})."""
    return {"id": limits.model, "object": "model", "created": 0,
            "owned_by": "megatron-sft-engine"}


def models_body(limits: Limits) -> dict:
    return {"object": "list", "data": [model_object(limits)]}


class _BodyShape(ValueError):
    """A request body that parses but is refused (an over-long integer, NaN)."""


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _BodyShape(f"it has an integer of {len(text.lstrip('-'))} digits (at most "
                         f"{MAX_INT_DIGITS})")
    return int(text)


def _no_constant(name: str):
    raise _BodyShape(f"{name} is not a JSON number")


def _depth(value) -> int:
    """Nesting levels of a parsed JSON value (iterative: any depth)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        items = node.values() if isinstance(node, dict) else node
        stack.extend((x, depth + 1) for x in items if isinstance(x, (dict, list)))
    return deepest


def parse_json(raw: bytes):
    """`raw` as JSON, or ApiError 400 saying why (not JSON, NaN / Infinity, an integer over
    MAX_INT_DIGITS digits, nesting deeper than MAX_JSON_DEPTH): nothing a client sends reaches
    the request checks in a shape that crashes them (recursion, int conversion limits)."""
    deep = bad(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        kw = {"parse_int": _bounded_int} if _LONG_INT.search(raw) else {}
        value = json.loads(raw, parse_constant=_no_constant, **kw)
    except _BodyShape as e:
        raise bad(f"the request body is refused: {e}") from None
    except RecursionError:
        raise deep from None
    except ValueError as e:   # JSONDecodeError, UnicodeDecodeError
        raise bad(f"the request body is not valid JSON: {e}") from None
    if isinstance(value, (dict, list)) and raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH \
            and _depth(value) > MAX_JSON_DEPTH:
        raise deep
    return value


async def read_body(request: Request, max_bytes: int = MAX_BODY_BYTES,
                    setting: str = "") -> bytes:
    """The request's body bytes: ApiError 413 when it is over `max_bytes` (by its
    Content-Length before reading, or while reading a chunked body); `setting`: how the
    message names the limit's setting (serve: "--max-body-mb 16")."""
    def too_large() -> ApiError:
        named = f" ({setting})" if setting else ""
        return ApiError(413, f"the request body is over this server's limit of {max_bytes} "
                        f"bytes{named}", code="request_too_large")

    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise too_large()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large()
        chunks.append(chunk)
    return b"".join(chunks)


async def json_body(request: Request, max_bytes: int = MAX_BODY_BYTES) -> dict:
    """The request's JSON body: 413 as read_body, 400 when not JSON (parse_json)."""
    return parse_json(await read_body(request, max_bytes))


def add_error_handlers(app: FastAPI) -> None:
    """ApiError and routing errors (unknown path, wrong method) as OpenAI-style bodies; an
    ApiError with a `retry_after_s` (engine.api.batcher.QueueFull) sends it as Retry-After,
    one with a `request_id` as X-Request-Id (what the openai client reads as the error's
    request_id)."""
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        retry, rid = getattr(exc, "retry_after_s", None), exc.request_id
        headers = {**({"Retry-After": str(retry)} if retry else {}),
                   **({"X-Request-Id": rid} if rid else {})}
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers or None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(ApiError(exc.status_code, str(exc.detail), kind="not_found_error"
                                     if exc.status_code == 404 else "invalid_request_error"
                                     ).body(), status_code=exc.status_code)


def require_api_key(app: FastAPI, api_key: str | None, open_paths: tuple[str, ...] = ()
                    ) -> None:
    """With `api_key`, a request to any path but `open_paths` without the header
    `Authorization: Bearer <api_key>` gets 401 with OpenAI's body (type
    invalid_request_error, code invalid_api_key) before its body is read; None: no check."""
    if api_key is None:
        return
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if request.url.path not in open_paths and not secrets.compare_digest(
                request.headers.get("authorization", "").encode(), expected):
            return JSONResponse(ApiError(
                401, "Incorrect API key provided: send the header 'Authorization: Bearer "
                "<key>' with the server's key (OpenAI(api_key=...))",
                kind="invalid_request_error", code="invalid_api_key").body(), status_code=401)
        return await call_next(request)


class _Seen:
    """What a response sent: status, and (JSON bodies, streamed usage chunks) its usage or
    its error message."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.kind = ""
        self.body = bytearray()
        self.usage: dict | None = None
        self.error: str | None = None
        self.finished = False   # the last body part went out
        self.gone = False       # the client disconnected (or a send to it failed)

    def add(self, message: dict) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.finished = True
        if message["type"] == "http.response.start":
            self.status = message["status"]
            headers = dict(message.get("headers") or [])
            self.kind = headers.get(b"content-type", b"").split(b";")[0].decode("latin-1")
        elif message["type"] == "http.response.body":
            chunk = message.get("body", b"")
            if self.kind == "application/json":
                self.body += chunk
            elif self.kind == "text/event-stream" and (b'"usage"' in chunk
                                                       or b'"error"' in chunk):
                for line in bytes(chunk).splitlines():
                    if line.startswith(b"data: {"):
                        self.read(line[6:])

    def read(self, raw: bytes) -> None:
        try:
            value = json.loads(raw)
        except ValueError:
            return
        if not isinstance(value, dict):
            return
        if isinstance(value.get("usage"), dict):
            self.usage = value["usage"]
        error = value.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            self.error = error["message"]

    def line(self, method: str, path: str, ms: float) -> str:
        if self.body:
            self.read(bytes(self.body))
        cut = self.gone and self.status is not None and not self.finished
        if cut:   # a response (a stream) the client left before its end: as a timeout's 499
            self.status, self.error = 499, "the client closed the request before its end"
        parts = [method, path, str(self.status or "-")]
        usage = self.usage or {}
        for key in ("prompt_tokens", "completion_tokens"):
            if isinstance(usage.get(key), int):
                parts.append(f"{key}={usage[key]}")
        text = " ".join(parts) + f" {ms:.1f} ms"
        if self.error and (self.status or 500) >= 400:
            text += ": " + (self.error.splitlines() or [""])[0]
        return text


class RequestLog:
    """ASGI middleware of log_requests."""

    def __init__(self, app, logger: logging.Logger) -> None:
        self.app, self.logger = app, logger

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0, seen = time.perf_counter(), _Seen()

        async def watch(message: dict) -> None:
            seen.add(message)
            try:
                await send(message)
            except OSError:   # the client went away (ASGI 2.4 servers raise on send)
                seen.gone = True
                raise

        async def listen() -> dict:
            message = await receive()
            seen.gone = seen.gone or message["type"] == "http.disconnect"
            return message

        try:
            await self.app(scope, listen, watch)
        except Exception:
            seen.status = seen.status or 500
            raise
        finally:
            self.logger.info(seen.line(scope["method"], scope["path"],
                                       (time.perf_counter() - t0) * 1e3))


def log_requests(app: FastAPI, logger: logging.Logger) -> None:
    """One INFO line on `logger` per request, once it is answered: "METHOD PATH STATUS
    [prompt_tokens=P completion_tokens=C] MS ms[: the error message's first line]", tokens
    from the response's `usage` (a JSON body, or the streamed chunk that carries it), a
    request that raised logged as 500, a response its client left before the end (an aborted
    stream) as 499, as a request answered 499 (engine.serve.live: a client gone while its
    reply waited). Call it after every other middleware of `app` (it then
    sees their answers too, e.g. require_api_key's 401s)."""
    app.add_middleware(RequestLog, logger=logger)
