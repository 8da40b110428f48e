"""The request plumbing of engine.tinker.routes: the caller's owner from its API key, bodies
read within the size bound and validated into the SDK's request types, refusals answered as
4xx JSON naming the field (and logged nowhere), and the wait for a worker's future without
holding a thread."""
from __future__ import annotations

import asyncio
import json

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from engine.tinker.losses import LossError
from engine.tinker.service import BadRequest, NotFound, QueueFull
from engine.tinker.wire import WireError


class TooLarge(ValueError):
    pass


class Unauthorized(ValueError):
    pass


def _where(e: pydantic.ValidationError) -> str:
    first = e.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or "body"
    return f"{field}: {first['msg']}"


REFUSALS = {BadRequest: 400, LossError: 400, WireError: 400, Unauthorized: 401,
            NotFound: 404, TooLarge: 413, QueueFull: 429}


def future_answer(request_id: str, model_id: str | None = None) -> dict:
    """The SDK's UntypedAPIFuture answer: the request id (and the model it is about)."""
    return {"request_id": request_id, **({"model_id": model_id} if model_id else {})}


def owner_of(request: Request, keys: dict[str, str] | None) -> str:
    """The owner of the request's X-API-Key ("open" without keys); Unauthorized (401)."""
    if keys is None:
        return "open"
    key = request.headers.get("x-api-key")
    if key not in keys:
        raise Unauthorized("X-API-Key is missing or not a key of this server")
    return keys[key]


async def read_body(request: Request, max_body_bytes: int) -> bytes:
    """The whole body; TooLarge (413) past `max_body_bytes`, declared or streamed."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise TooLarge(f"body of {declared} bytes exceeds --max-body-mb "
                       f"({max_body_bytes} bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise TooLarge(f"body exceeds --max-body-mb ({max_body_bytes} bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(request: Request, model, max_body_bytes: int):
    """The JSON body validated into pydantic `model`; BadRequest naming the bad field."""
    raw = await read_body(request, max_body_bytes)
    try:
        data = json.loads(raw or b"{}")
    except ValueError as e:
        raise BadRequest(f"body: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise BadRequest("body: must be a JSON object")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        raise BadRequest(_where(e)) from None


async def _refuse(request: Request, e: Exception):
    return JSONResponse({"detail": str(e)}, REFUSALS[type(e)])


def install_refusals(app: FastAPI) -> None:
    """One handler per refusal class: Starlette answers these in its ExceptionMiddleware, and
    they are answers, not failures: nothing is logged. (A handler for Exception would run in
    ServerErrorMiddleware, which re-raises after answering, so uvicorn wrote a traceback to
    stderr for every 4xx; a server whose stderr was a pipe nobody read blocked on that write
    once the pipe filled and stopped answering.) Anything else is a 500, logged."""
    for cls in REFUSALS:
        app.add_exception_handler(cls, _refuse)


async def wait_for(future, seconds: float) -> bool:
    """Wait until the worker resolves `future` (True), at most `seconds` (False). The worker
    thread wakes this coroutine through the loop (call_soon_threadsafe); no thread is held and
    nothing polls."""
    loop = asyncio.get_running_loop()
    woken = loop.create_future()

    def wake():
        try:
            loop.call_soon_threadsafe(lambda: woken.done() or woken.set_result(None))
        except RuntimeError:   # the loop closed (server shut down): nobody waits
            pass
    future.on_done(wake)
    try:
        await asyncio.wait_for(woken, None if seconds == float("inf") else seconds)
    except asyncio.TimeoutError:
        return False
    return True
