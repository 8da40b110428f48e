"""The answer to a request that failed inside a server (serve's endpoint, the agent server).

A client gets a short message naming the request id (also sent as the X-Request-Id header,
what the openai client reads as the error's request_id); the exception's type, text and
traceback go to the server's error log only, never into the body (they may carry internals:
paths, prompts, secrets).
"""
from __future__ import annotations

import logging

from engine.api.requests import ApiError


def failure(rid: str, cause: BaseException, log: logging.Logger,
            error: ApiError | None = None) -> ApiError:
    """The answer to request `rid` that failed with `cause`: `error` (a 503 for a failed
    generation, engine.api.batcher.GenerationFailed), else a 500 `internal_error`; `cause`
    with its traceback is logged on `log` at ERROR."""
    log.error("request %s failed", rid, exc_info=(type(cause), cause, cause.__traceback__))
    status, what = (error.status, "generation failed") if error else (500, "internal error")
    out = ApiError(status, f"{what} (request id {rid}); the server log has the details",
                   kind="server_error", code=error.code if error else "internal_error")
    out.request_id = rid
    return out
