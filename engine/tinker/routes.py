"""The Tinker REST API as the official `tinker` SDK (0.38) calls it, over engine.tinker.service.

Routes (all under /api/v1; docs/tinker.md lists them with what each answers):
client/config, client/dynamic_config, healthz, get_server_capabilities, create_session,
session_heartbeat, telemetry (accepted, discarded), create_model, get_info, forward_backward
(protobuf body, optionally zstd), optim_step, save_weights, save_weights_for_sampler,
load_weights, create_sampling_session, samplers/{id}, asample, retrieve_future.

Authentication: the SDK's X-API-Key header; `keys` maps each accepted key to its owner (None:
open, every caller the owner "open"). A missing or unknown key gets 401. Every id is looked up
under the caller's owner, so another owner's model, sampler or checkpoint is a 404.

Errors are 4xx JSON {"detail": "..."} naming the field: 400 for a malformed body or a value the
service refuses (pydantic's location of the bad field, or the loss / shape check's message),
401, 404 for unknown ids, 413 for a body over `max_body_bytes`, 429 when the work queue is
full. Refusals are answered by one handler per refusal class and log nothing; any other
exception is a 500, logged with its traceback. CPU work on a request body (decoding and
checking a forward_backward, reading a checkpoint) runs off the event loop. Work that fails
while running (for example a checkpoint of another shape) resolves its future as
{"error", "category": "user"}, which the SDK raises as RequestFailedError.
retrieve_future long-polls: it answers when the work is done or after `poll_s` with
{"type": "try_again"}."""
from __future__ import annotations

import asyncio
import json

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from engine.tinker.losses import LossError, check_loss
from engine.tinker.lora import LoraSpec
from engine.tinker.service import BadRequest, NotFound, QueueFull, Service
from engine.tinker.wire import WireError, decode_forward_backward

PROTO = "application/x-protobuf"


class TooLarge(ValueError):
    pass


class Unauthorized(ValueError):
    pass


def _where(e: pydantic.ValidationError) -> str:
    first = e.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or "body"
    return f"{field}: {first['msg']}"


def build_app(service: Service, keys: dict[str, str] | None, max_body_bytes: int,
              poll_s: float = 10.0) -> FastAPI:
    from tinker import types

    app = FastAPI(title="megatron-sft-engine tinker")
    app.state.service = service

    def owner_of(request: Request) -> str:
        if keys is None:
            return "open"
        key = request.headers.get("x-api-key")
        if key not in keys:
            raise Unauthorized("X-API-Key is missing or not a key of this server")
        return keys[key]

    async def body(request: Request) -> bytes:
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

    async def parsed(request: Request, model):
        raw = await body(request)
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

    refusals = {BadRequest: 400, LossError: 400, WireError: 400, Unauthorized: 401,
                NotFound: 404, TooLarge: 413, QueueFull: 429}

    async def refuse(request: Request, e: Exception):
        return JSONResponse({"detail": str(e)}, refusals[type(e)])

    # One handler per refusal class: Starlette answers these in its ExceptionMiddleware, and
    # they are answers, not failures: nothing is logged. (A handler for Exception would run in
    # ServerErrorMiddleware, which re-raises after answering, so uvicorn wrote a traceback to
    # stderr for every 4xx; a server whose stderr was a pipe nobody read blocked on that write
    # once the pipe filled and stopped answering.) Anything else is a 500, logged.
    for cls in refusals:
        app.add_exception_handler(cls, refuse)

    async def wait(future, seconds: float) -> bool:
        """Wait until the worker resolves `future` (True), at most `seconds` (False). The
        worker thread wakes this coroutine through the loop (call_soon_threadsafe); no thread
        is held and nothing polls."""
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

    def future(request_id: str, model_id: str | None = None) -> dict:
        return {"request_id": request_id, **({"model_id": model_id} if model_id else {})}

    @app.post("/api/v1/client/config")
    async def client_config(request: Request):
        return {"pjwt_auth_enabled": False, "use_pyqwest_transport": False,
                "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False,
                "custom_loss_server_side": False, "sample_join_sampling_session": False}

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config(request: Request):
        owner_of(request)
        return {"refresh_interval_sec": 3600}

    @app.get("/api/v1/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities(request: Request):
        owner_of(request)
        return {"supported_models": [{"model_name": service.name, "trainable": True,
                                      "sampleable": True,
                                      "max_context_length": service.max_context}]}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request):
        owner = owner_of(request)
        await parsed(request, types.CreateSessionRequest)
        return {"type": "create_session", "session_id": service.create_session(owner)}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request):
        owner = owner_of(request)
        req = await parsed(request, types.SessionHeartbeatRequest)
        service.session(owner, req.session_id)
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/telemetry")
    async def telemetry(request: Request):
        await body(request)
        return {"status": "accepted"}

    @app.post("/api/v1/create_model")
    async def create_model(request: Request):
        owner = owner_of(request)
        req = await parsed(request, types.CreateModelRequest)
        service.session(owner, req.session_id)
        service.check_base_model(req.base_model)
        if req.lora_config is None:
            raise BadRequest("lora_config: required (only LoRA training models are served)")
        if req.optimizer_config.type != "adamw":
            raise BadRequest(f"optimizer_config.type {req.optimizer_config.type!r} is not "
                             "served (adamw)")
        c = req.lora_config
        if c.rank < 1:
            raise BadRequest(f"lora_config.rank {c.rank} must be >= 1")
        if not (c.train_mlp or c.train_attn or c.train_unembed):
            raise BadRequest("lora_config: one of train_mlp, train_attn, train_unembed must "
                             "be true")
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        if model_id in service.models:
            raise BadRequest(f"model_seq_id {req.model_seq_id}: this session already has it")
        spec = LoraSpec(c.rank, c.train_attn, c.train_mlp, c.train_unembed, c.seed)
        return future(service.submit("create_model", dict(owner=owner, model_id=model_id,
                                                          spec=spec)), model_id)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        owner = owner_of(request)
        req = await parsed(request, types.GetInfoRequest)
        return service.info(owner, req.model_id)

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        owner = owner_of(request)
        raw = await body(request)
        if PROTO not in request.headers.get("content-type", ""):
            raise BadRequest(f"Content-Type must be {PROTO} (the SDK's ForwardBackwardRequest)")
        # decoding and checking a body of up to --max-body-mb is CPU work: off the event loop
        return await run_in_threadpool(checked_forward_backward, owner, raw,
                                       request.headers.get("content-encoding"))

    def checked_forward_backward(owner: str, raw: bytes, encoding: str | None) -> dict:
        model_id, loss_fn, config, forward_only, data = decode_forward_backward(raw, encoding)
        model = service.model(owner, model_id)
        for i, d in enumerate(data):
            if len(d.tokens) > service.max_context:
                raise BadRequest(f"data[{i}].model_input: {len(d.tokens)} tokens exceed the "
                                 f"context of {service.max_context}")
            bad = [t for t in d.tokens if not 0 <= t < service.vocab]
            bad_targets = "target_tokens" in d.inputs and bool(
                ((d.inputs["target_tokens"] < 0) | (d.inputs["target_tokens"] >= service.vocab))
                .any())
            if bad or bad_targets:
                field = "model_input" if bad else "loss_fn_inputs.target_tokens"
                raise BadRequest(f"data[{i}].{field}: token ids must be in [0, {service.vocab})")
        for d in data:
            config_filled = check_loss(loss_fn, set(d.inputs), config)
        return future(service.submit("forward_backward", dict(
            adapter=model.adapter, loss_fn=loss_fn, config=config_filled, data=data,
            forward_only=forward_only)), model_id)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request):
        owner = owner_of(request)
        req = await parsed(request, types.OptimStepRequest)
        model = service.model(owner, req.model_id)
        if not isinstance(req.optim_params, types.AdamParams):
            raise BadRequest("optim_params: only AdamParams are served")
        adam = req.optim_params.model_dump()
        for key, low in (("learning_rate", 0.0), ("eps", 0.0), ("weight_decay", 0.0),
                         ("grad_clip_norm", 0.0)):
            if not adam[key] >= low:
                raise BadRequest(f"adam_params.{key} {adam[key]} must be >= {low}")
        for key in ("beta1", "beta2"):
            if not 0 <= adam[key] < 1:
                raise BadRequest(f"adam_params.{key} {adam[key]} must be in [0, 1)")
        return future(service.submit("optim_step", dict(model=model, adam=adam)), req.model_id)

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request):
        owner = owner_of(request)
        req = await parsed(request, types.SaveWeightsRequest)
        model = service.model(owner, req.model_id)
        name = req.path or f"step-{model.steps}"
        service.path_file(f"tinker://{req.model_id}/weights/{name}")
        return future(service.submit("save", dict(model_id=req.model_id, model=model,
                                                  kind="weights", name=name,
                                                  with_optimizer=True)), req.model_id)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request):
        owner = owner_of(request)
        req = await parsed(request, types.SaveWeightsForSamplerRequest)
        model = service.model(owner, req.model_id)
        if req.path is not None:
            service.path_file(f"tinker://{req.model_id}/sampler_weights/{req.path}")
            return future(service.submit("save", dict(
                model_id=req.model_id, model=model, kind="sampler_weights", name=req.path,
                with_optimizer=False)), req.model_id)
        if req.kind != "snapshot":
            raise BadRequest(f"kind {req.kind!r} is not served (snapshot)")
        session_id = req.model_id.split(":train:")[0]
        sampler_id = f"{session_id}:sample:{req.sampling_session_seq_id}"
        return future(service.submit("snapshot", dict(owner=owner, model=model,
                                                      sampling_session_id=sampler_id)),
                      req.model_id)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request):
        owner = owner_of(request)
        req = await parsed(request, types.LoadWeightsRequest)
        state = await run_in_threadpool(service.read_state, owner, req.path)
        if not req.path.split("/")[-2] == "weights" and req.optimizer:
            raise BadRequest(f"path {req.path!r} holds sampler weights, no optimizer state")
        if req.model_id is not None:
            model = service.model(owner, req.model_id)
            return future(service.submit("load_into", dict(model=model, state=state,
                                                           optimizer=req.optimizer,
                                                           path=req.path)), req.model_id)
        if req.session_id is None or req.model_seq_id is None:
            raise BadRequest("load_weights: give model_id, or session_id and model_seq_id")
        service.session(owner, req.session_id)
        service.check_base_model(req.base_model)
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        if model_id in service.models:
            raise BadRequest(f"model_seq_id {req.model_seq_id}: this session already has it")
        if not req.optimizer:
            state = dict(state, optimizer=None, steps=0)
        return future(service.submit("create_model", dict(owner=owner, model_id=model_id,
                                                          spec=LoraSpec(**state["spec"]),
                                                          state=state, path=req.path)),
                      model_id)

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        owner = owner_of(request)
        req = await parsed(request, types.CreateSamplingSessionRequest)
        service.session(owner, req.session_id)
        sampler_id = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
        if req.model_path is None:
            service.check_base_model(req.base_model)
            service.samplers[sampler_id] = (owner, None)
        else:
            state = await run_in_threadpool(service.read_state, owner, req.model_path)
            rid = service.submit("sampler_from_path", dict(owner=owner, state=state,
                                                          sampling_session_id=sampler_id))
            f = service.future(rid)
            await wait(f, float("inf"))
            service.forget(rid)
            if f.error:
                raise BadRequest(f.error)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request):
        owner = owner_of(request)
        service.sampler(owner, sampler_id)
        return {"sampler_id": sampler_id, "base_model": service.name}

    @app.post("/api/v1/asample")
    async def asample(request: Request):
        owner = owner_of(request)
        req = await parsed(request, types.SampleRequest)
        if req.sampling_session_id is not None:
            adapter = service.sampler(owner, req.sampling_session_id)
        elif req.model_path is not None:
            raise BadRequest("model_path: create a sampling session for it first")
        else:
            service.check_base_model(req.base_model)
            adapter = None
        prompt = []
        for j, chunk in enumerate(req.prompt.chunks):
            if chunk.type != "encoded_text":
                raise BadRequest(f"prompt.chunks[{j}]: chunk type {chunk.type!r} is not served "
                                 "(encoded_text)")
            prompt += list(chunk.tokens)
        if not prompt or not all(0 <= t < service.vocab for t in prompt):
            raise BadRequest(f"prompt: needs tokens, each in [0, {service.vocab})")
        for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if getattr(req, name):
                raise BadRequest(f"{name}: not served (0 only)")
        if req.target_prompt_logprobs is not None or req.prompt_logprobs_last_n is not None:
            raise BadRequest("target_prompt_logprobs / prompt_logprobs_last_n: not served")
        p = req.sampling_params
        room = service.max_context - len(prompt)
        max_tokens = p.max_tokens if p.max_tokens is not None else room
        if not 1 <= max_tokens <= room:
            raise BadRequest(f"sampling_params.max_tokens {max_tokens} must be in [1, {room}] "
                             f"(context {service.max_context} minus the prompt)")
        if not 1 <= req.num_samples <= 64:
            raise BadRequest(f"num_samples {req.num_samples} must be in [1, 64]")
        if not p.temperature >= 0 or not 0 < p.top_p <= 1:
            raise BadRequest("sampling_params: temperature must be >= 0 and top_p in (0, 1]")
        stop = p.stop if p.stop is not None else []
        stop = [stop] if isinstance(stop, str) else list(stop)
        stop_ids = {s for s in stop if isinstance(s, int)}
        stop_strings = [s for s in stop if isinstance(s, str)]
        if not stop:
            eos = service.tokenizer.eos_token_id
            stop_ids = {eos} if eos is not None else set()
        seed = p.seed if p.seed is not None else (req.seq_id or 0)
        params = dict(max_tokens=max_tokens, temperature=p.temperature, top_k=p.top_k,
                      top_p=p.top_p, seed=seed, stop_ids=stop_ids, stop_strings=stop_strings)
        request_id = service.submit("sample", dict(
            adapter=adapter, prompt=prompt, num_samples=req.num_samples, params=params,
            want_prompt_logprobs=bool(req.prompt_logprobs)))
        return {**future(request_id),
                "sample_sequence_ids": [f"{request_id}:{i}" for i in range(req.num_samples)]}

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        owner_of(request)
        req = await parsed(request, types.FutureRetrieveRequest)
        f = service.future(req.request_id)
        if not await wait(f, poll_s):
            return {"type": "try_again", "request_id": req.request_id,
                    "queue_state": "active"}
        service.forget(req.request_id)
        if f.error is not None:
            return {"error": f.error, "category": "user"}
        if isinstance(f.result, bytes):
            return Response(f.result, media_type=PROTO)
        return f.result

    return app
