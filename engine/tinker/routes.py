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

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool
from tinker import types

from engine.tinker.lora import LoraSpec
from engine.tinker.request_checks import checked_forward_backward, sample_request
from engine.tinker.request_io import (future_answer, install_refusals, parse_body, read_body,
                                      wait_for)
from engine.tinker.request_io import owner_of as request_owner
from engine.tinker.sampling_sessions import SamplingSession
from engine.tinker.service import BadRequest, Service

PROTO = "application/x-protobuf"


class Api:
    """What every route needs: the service, the caller's owner (engine.tinker.request_io), the
    body within the bound, and the future's answer."""

    def __init__(self, service: Service, keys: dict[str, str] | None, max_body_bytes: int,
                 poll_s: float) -> None:
        self.service, self.keys = service, keys
        self.max_body_bytes, self.poll_s = max_body_bytes, poll_s

    def owner(self, request: Request) -> str:
        return request_owner(request, self.keys)

    async def body(self, request: Request) -> bytes:
        return await read_body(request, self.max_body_bytes)

    async def parsed(self, request: Request, model):
        return await parse_body(request, model, self.max_body_bytes)

    async def owned(self, request: Request, model):
        """(the caller's owner, the body as `model`): the key is checked before the body."""
        return self.owner(request), await self.parsed(request, model)

    future = staticmethod(future_answer)


def build_app(service: Service, keys: dict[str, str] | None, max_body_bytes: int,
              poll_s: float = 10.0) -> FastAPI:
    """The FastAPI app of every route (module docstring)."""
    app = FastAPI(title="megatron-sft-engine tinker")
    app.state.service = service
    install_refusals(app)
    api = Api(service, keys, max_body_bytes, poll_s)
    for routes in (_session_routes, _training_routes, _weights_routes, _sampling_routes):
        routes(app, api)
    return app


def _session_routes(app: FastAPI, api: "Api") -> None:
    """client config, health, capabilities, sessions, telemetry."""
    service = api.service

    @app.post("/api/v1/client/config")
    async def client_config(request: Request):
        return {"pjwt_auth_enabled": False, "use_pyqwest_transport": False,
                "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False,
                "custom_loss_server_side": False, "sample_join_sampling_session": False}

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config(request: Request):
        api.owner(request)
        return {"refresh_interval_sec": 3600}

    @app.get("/api/v1/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities(request: Request):
        api.owner(request)
        return {"supported_models": [{"model_name": service.name, "trainable": True,
                                      "sampleable": True,
                                      "max_context_length": service.max_context}]}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request):
        owner = api.owner(request)
        await api.parsed(request, types.CreateSessionRequest)
        return {"type": "create_session", "session_id": service.create_session(owner)}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request):
        owner, req = await api.owned(request, types.SessionHeartbeatRequest)
        service.session(owner, req.session_id)
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/telemetry")
    async def telemetry(request: Request):
        await api.body(request)
        return {"status": "accepted"}


def _training_routes(app: FastAPI, api: "Api") -> None:
    """create_model, get_info, forward_backward, optim_step."""
    service = api.service

    @app.post("/api/v1/create_model")
    async def create_model(request: Request):
        owner, req = await api.owned(request, types.CreateModelRequest)
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
        if service.max_rank is not None and c.rank > service.max_rank:
            raise BadRequest(f"lora_config.rank {c.rank} is above {service.max_rank}, the "
                             "largest the server's vLLM sampler serves (--sampler-max-lora-rank)")
        if c.train_mlp and service.lora.unadapted_mlp is not None:
            raise BadRequest(f"lora_config.train_mlp: {service.lora.unadapted_mlp}; create the "
                             "model with train_mlp=False")
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        if model_id in service.models:
            raise BadRequest(f"model_seq_id {req.model_seq_id}: this session already has it")
        spec = LoraSpec(c.rank, c.train_attn, c.train_mlp, c.train_unembed, c.seed)
        return api.future(service.submit("create_model", dict(owner=owner, model_id=model_id,
                                                          spec=spec)), model_id)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        owner, req = await api.owned(request, types.GetInfoRequest)
        return service.info(owner, req.model_id)

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        owner = api.owner(request)
        raw = await api.body(request)
        if PROTO not in request.headers.get("content-type", ""):
            raise BadRequest(f"Content-Type must be {PROTO} (the SDK's ForwardBackwardRequest)")
        # decoding and checking a body of up to --max-body-mb is CPU work: off the event loop
        return await run_in_threadpool(checked_forward_backward, service, owner, raw,
                                       request.headers.get("content-encoding"))

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request):
        owner, req = await api.owned(request, types.OptimStepRequest)
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
        return api.future(service.submit("optim_step", dict(model=model, adam=adam)), req.model_id)


def _weights_routes(app: FastAPI, api: "Api") -> None:
    """save_weights, save_weights_for_sampler, load_weights."""
    service = api.service

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request):
        owner, req = await api.owned(request, types.SaveWeightsRequest)
        model = service.model(owner, req.model_id)
        name = req.path or f"step-{model.steps}"
        service.path_file(f"tinker://{req.model_id}/weights/{name}")
        return api.future(service.submit("save", dict(model_id=req.model_id, model=model,
                                                  kind="weights", name=name,
                                                  with_optimizer=True)), req.model_id)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request):
        owner, req = await api.owned(request, types.SaveWeightsForSamplerRequest)
        model = service.model(owner, req.model_id)
        if req.path is not None:
            service.path_file(f"tinker://{req.model_id}/sampler_weights/{req.path}")
            return api.future(service.submit("save", dict(
                model_id=req.model_id, model=model, kind="sampler_weights", name=req.path,
                with_optimizer=False)), req.model_id)
        if req.kind != "snapshot":
            raise BadRequest(f"kind {req.kind!r} is not served (snapshot)")
        session_id = req.model_id.split(":train:")[0]
        sampler_id = f"{session_id}:sample:{req.sampling_session_seq_id}"
        return api.future(service.submit("snapshot", dict(owner=owner, model=model,
                                                      sampling_session_id=sampler_id)),
                      req.model_id)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request):
        owner, req = await api.owned(request, types.LoadWeightsRequest)
        state = await run_in_threadpool(service.read_state, owner, req.path)
        if not req.path.split("/")[-2] == "weights" and req.optimizer:
            raise BadRequest(f"path {req.path!r} holds sampler weights, no optimizer state")
        if req.model_id is not None:
            model = service.model(owner, req.model_id)
            return api.future(service.submit("load_into", dict(model=model, state=state,
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
            state = dict(state, adam=None, steps=0)
        return api.future(service.submit("create_model", dict(owner=owner, model_id=model_id,
                                                          spec=LoraSpec(**state["spec"]),
                                                          state=state, path=req.path)),
                      model_id)


def _sampling_routes(app: FastAPI, api: "Api") -> None:
    """sampling sessions, asample, retrieve_future."""
    service = api.service

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        owner, req = await api.owned(request, types.CreateSamplingSessionRequest)
        service.session(owner, req.session_id)
        sampler_id = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
        if req.model_path is None:
            service.check_base_model(req.base_model)
            service.samplers.add(sampler_id, SamplingSession(owner, None))
        else:
            state = await run_in_threadpool(service.read_state, owner, req.model_path)
            rid = service.submit("sampler_from_path", dict(
                owner=owner, state=state, sampling_session_id=sampler_id, path=req.model_path))
            f = service.future(rid)
            await wait_for(f, float("inf"))
            service.forget(rid)
            if f.error:
                raise BadRequest(f.error)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request):
        owner = api.owner(request)
        service.sampler(owner, sampler_id)
        return {"sampler_id": sampler_id, "base_model": service.name}

    @app.post("/api/v1/asample")
    async def asample(request: Request):
        owner, req = await api.owned(request, types.SampleRequest)
        if req.sampling_session_id is not None:
            service.sampler(owner, req.sampling_session_id)
        elif req.model_path is not None:
            raise BadRequest("model_path: create a sampling session for it first")
        else:
            service.check_base_model(req.base_model)
        prompt, params = sample_request(service, req)
        request_id = service.submit("sample", dict(
            session=req.sampling_session_id, prompt=prompt, num_samples=req.num_samples,
            params=params,
            want_prompt_logprobs=bool(req.prompt_logprobs)))
        return {**api.future(request_id),
                "sample_sequence_ids": [f"{request_id}:{i}" for i in range(req.num_samples)]}

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        api.owner(request)
        req = await api.parsed(request, types.FutureRetrieveRequest)
        f = service.future(req.request_id)
        if not await wait_for(f, api.poll_s):
            return {"type": "try_again", "request_id": req.request_id,
                    "queue_state": "active"}
        service.forget(req.request_id)
        if f.error is not None:
            return {"error": f.error, "category": "user"}
        if isinstance(f.result, bytes):
            return Response(f.result, media_type=PROTO)
        return f.result
