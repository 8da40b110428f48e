"""HTTP plumbing shared by both OpenAI servers (the agent endpoint, `serve`): uvicorn in a
daemon thread (start_http / stop_http), the JSON body with its size limit (413), OpenAI-style
error bodies for ApiError and routing errors, the optional API key (401), the /v1/models body.
"""
from __future__ import annotations

import json
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


def models_body(limits: Limits) -> dict:
    return {"object": "list", "data": [{"id": limits.model, "object": "model", "created": 0,
                                        "owned_by": "megatron-sft-engine"}]}


async def json_body(request: Request, max_bytes: int = MAX_BODY_BYTES) -> dict:
    """The request's JSON body: ApiError 413 when it is over `max_bytes` (by its
    Content-Length before reading, or while reading a chunked body), 400 when not JSON."""
    def too_large() -> ApiError:
        return ApiError(413, f"the request body is over this server's limit of {max_bytes} "
                        "bytes", code="request_too_large")

    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise too_large()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large()
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}") from None


def add_error_handlers(app: FastAPI) -> None:
    """ApiError and routing errors (unknown path, wrong method) as OpenAI-style bodies."""
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

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
