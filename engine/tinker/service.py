"""The Tinker service's state and its one worker thread.

`Service` owns the base model through its backend (engine.tinker.adapters.Adapters: the
transformers model of `transformers_backend`, loaded once in float32 and wrapped by
engine.tinker.lora.MultiLora, or on several ranks engine.tinker.lockstep.Lockstep over the
Megatron backend's), the registry of sessions, training models and sampling sessions
(each with its owner: the API key's owner; another owner's id is answered as unknown, 404),
the futures and the work queue. Every request that touches the model is queued as work and
answered with a future id at once; the worker thread runs the queue in arrival order, but
forward / forward_backward items queued together (within `batch_wait_s` of the first) run as
one batch through the base model (engine.tinker.compute.run_losses), each row with its own
adapter; likewise sample requests (with one temperature and top_p) queued together run as
one generate call of the sampler, each row with its sampling session's adapter
(engine.tinker.sampler.sample_on, each request's rows seeded as alone; which requests join:
engine.tinker.batching). A model's optimizer state and gradient accumulators belong to its
adapter alone.
The queue is bounded (`QueueFull`, a 429); finished futures are kept until retrieved, at most
`max_futures` of them (the oldest first dropped): a client that went away leaves no work or
unbounded memory behind.

State files (save_state / save_weights_for_sampler) live under `state_dir`: a path
tinker://MODEL_ID/weights/NAME is the file STATE_DIR/quote(MODEL_ID)/weights/NAME.pt holding the
owner, the LoRA spec, the adapter tensors, the AdamW state and the step count, so a restarted
server with the same --state-dir serves them."""
from __future__ import annotations

import collections
import dataclasses
import itertools
import queue
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import quote

import torch
from transformers import AutoTokenizer

from engine.tinker.adapters import Adapters
from engine.tinker.futures import Future
from engine.tinker.legacy_state import legacy_optimizer
from engine.tinker.lora import LoraSpec, MultiLora
from engine.tinker.ranks import OneProcess
from engine.tinker.batching import joins
from engine.tinker.samplers import SamplerSettings, make_sampler
from engine.tinker.sampling_sessions import SamplingSession, SamplingSessions
from engine.tinker.wire import forward_backward_output, sample_response
from parallel.openmp import release_thread_team


class NotFound(LookupError):
    """An id the caller does not own or that does not exist (404; the message names it)."""


class BadRequest(ValueError):
    """A request the service refuses (400; the message names the field)."""


class QueueFull(RuntimeError):
    """The work queue is full (429)."""


def _message(e: Exception) -> str:
    """A failed request's error as its future reports it: a refusal's own message, else the
    exception's type and message."""
    return str(e) if isinstance(e, (BadRequest, NotFound, ValueError)) else \
        f"{type(e).__name__}: {e}"


@dataclasses.dataclass
class TrainModel:
    owner: str
    adapter: str
    spec: LoraSpec
    steps: int = 0


class Service:
    def __init__(self, model_dir: str, name: str, state_dir: str, batch_wait_s: float = 0.01,
                 max_queue: int = 256, max_futures: int = 4096, max_context: int | None = None,
                 backend=None, sampler: SamplerSettings = SamplerSettings(),
                 max_samplers: int = 32):
        """`backend`: the model's Adapters (engine.tinker.adapters), or on several ranks the
        root's engine.tinker.lockstep.Lockstep over them; None: `transformers_backend` with
        `sampler`'s sampler. `max_samplers`: sampling sessions whose adapters the sampler
        holds at once (engine.tinker.sampling_sessions)."""
        self.model_dir, self.name, self.state_dir = model_dir, name, Path(state_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.backend = backend or transformers_backend(model_dir, self.tokenizer, sampler)
        # the root's sampler (engine.tinker.sampler) and the largest LoRA rank it serves
        self.sample_engine = self.backend.sampler
        self.max_rank = self.sample_engine.max_rank
        self.lora = self.backend.lora   # the root's model (its vocab, context, architecture)
        self.max_context, self.vocab = max_context or self.lora.max_context, self.lora.vocab
        self.batch_wait_s, self.max_futures = batch_wait_s, max_futures
        self.sessions: dict[str, str] = {}
        self.models: dict[str, TrainModel] = {}
        self.samplers = SamplingSessions(max_samplers, self.backend, self.read_state,
                                         lambda: f"s{next(self.counter)}")
        self.futures: collections.OrderedDict[str, Future] = collections.OrderedDict()
        self.lock, self.counter = threading.Lock(), itertools.count()
        self.work: queue.Queue = queue.Queue(maxsize=max_queue)
        # rows of the latest generate calls (tests); bounded, as everything a long run keeps
        self.sample_batches: collections.deque[int] = collections.deque(maxlen=1024)
        self.worker = threading.Thread(target=self._run, daemon=True, name="tinker-worker")
        release_thread_team()   # the model was built here; the worker computes (parallel.openmp)
        self.worker.start()

    # -- registry ---------------------------------------------------------------------------
    def create_session(self, owner: str) -> str:
        session = f"session-{uuid.uuid4().hex[:12]}"
        with self.lock:
            self.sessions[session] = owner
        return session

    def session(self, owner: str, session_id: str) -> str:
        if self.sessions.get(session_id) != owner:
            raise NotFound(f"session_id {session_id!r} is not a session of this API key")
        return session_id

    def model(self, owner: str, model_id: str) -> TrainModel:
        m = self.models.get(model_id)
        if m is None or m.owner != owner:
            raise NotFound(f"model_id {model_id!r} is not a model of this API key")
        return m

    def sampler(self, owner: str, sampling_session_id: str) -> SamplingSession:
        s = self.samplers.get(sampling_session_id)
        if s is None or s.owner != owner:
            raise NotFound(f"sampling_session_id {sampling_session_id!r} is not a sampling "
                           "session of this API key")
        return s

    def check_base_model(self, base_model: str | None) -> None:
        if base_model is not None and base_model != self.name:
            raise BadRequest(f"base_model {base_model!r} is not served; served: {self.name!r}")

    def info(self, owner: str, model_id: str) -> dict:
        m = self.model(owner, model_id)
        return {"type": "get_info", "model_id": model_id, "is_lora": True,
                "lora_rank": m.spec.rank, "model_name": self.name,
                "model_data": {"arch": self.lora.arch, "model_name": self.name,
                               "tokenizer_id": self.model_dir}}

    # -- futures and the queue -------------------------------------------------------------
    def submit(self, kind: str, payload: dict) -> str:
        request_id = f"req-{next(self.counter)}-{uuid.uuid4().hex[:8]}"
        future = Future()
        try:
            self.work.put_nowait((kind, payload, future))
        except queue.Full:
            raise QueueFull(f"the work queue holds {self.work.maxsize} requests; retry later") \
                from None
        with self.lock:
            self.futures[request_id] = future
            while len(self.futures) > self.max_futures:
                self.futures.popitem(last=False)
        return request_id

    def future(self, request_id: str) -> Future:
        with self.lock:
            f = self.futures.get(request_id)
        if f is None:
            raise NotFound(f"request_id {request_id!r} is not a pending or finished request")
        return f

    def forget(self, request_id: str) -> None:
        with self.lock:
            self.futures.pop(request_id, None)

    def _run(self) -> None:
        """The worker: forever take the next work item (with the forward_backward items queued
        right behind it, as one batch) and resolve every taken item's future, with its result
        or with the error that stopped it. Nothing a request does ends this loop."""
        while True:
            batch = [self.work.get()]
            try:
                if batch[0][0] in ("forward_backward", "sample"):
                    time.sleep(self.batch_wait_s)
                    while True:   # the items queued behind it that join it, in order
                        with self.work.mutex:
                            head = self.work.queue[0] if self.work.queue else None
                        if head is None or not joins(batch, head, self.samplers.limit):
                            break
                        batch.append(self.work.get_nowait())
                self._execute(batch)
            except BaseException as e:   # the worker itself must survive; report, go on
                for _, _, future in batch:
                    future.fail(f"internal error: {type(e).__name__}: {e}")

    def _execute(self, batch: list) -> None:
        """Run one work item, or a batch of forward_backward items (`_forward_backward`), and
        resolve its futures; an error fails the item's future with the message."""
        if batch[0][0] in ("forward_backward", "sample"):
            getattr(self, f"_{batch[0][0]}")(batch)
            return
        kind, payload, future = batch[0]
        try:
            future.resolve(getattr(self, f"_do_{kind}")(**payload))
        except Exception as e:
            future.fail(_message(e))

    # -- work ------------------------------------------------------------------------------
    def _forward_backward(self, batch) -> None:
        """One forward and backward over every item of `batch`. If it fails, each item runs
        again alone (the backward is run_losses' last step, so a failed run added no
        gradient), so one user's failing request fails only that user's future."""
        items = [dict(p, backward=not p["forward_only"]) for _, p, _ in batch]
        rows = sum(len(i["data"]) for i in items)
        results = self._or_each_alone(batch, self._forward_backward, lambda: (
            self.backend.run_losses(items, any(i["backward"] for i in items))))
        if results is None:
            return
        for (_, _, future), result in zip(batch, results):
            try:
                metrics = dict(result["metrics"], **{"batch_rows:max": float(rows)})
                future.resolve(forward_backward_output(result["outputs"], metrics))
            except Exception as e:
                future.fail(_message(e))

    @staticmethod
    def _or_each_alone(batch: list, again, run):
        """run()'s results; if it raises, None, and each item of a batch of several runs
        again alone (`again([item])`), a single item's future failing with the error: one
        request's failure fails only its own future."""
        try:
            return run()
        except Exception as e:
            if len(batch) > 1:
                for item in batch:
                    again([item])
            else:
                batch[0][2].fail(_message(e))
            return None

    def _do_create_model(self, owner: str, model_id: str, spec: LoraSpec,
                         state: dict | None = None, path: str | None = None) -> dict:
        adapter = f"a{next(self.counter)}"
        self.backend.create(adapter, spec, state)
        model = TrainModel(owner, adapter, spec)
        if state is not None and state.get("adam") is not None:
            model.steps = state["steps"]
        self.models[model_id] = model
        if path is not None:   # created by load_weights
            return {"type": "load_weights", "model_id": model_id, "path": path}
        return {"type": "create_model", "model_id": model_id}

    def _do_optim_step(self, model: TrainModel, adam: dict) -> dict:
        metrics = self.backend.optim_step(model.adapter, adam)
        model.steps += 1
        return {"metrics": metrics}

    def path_file(self, path: str) -> Path:
        if not path.startswith("tinker://"):
            raise BadRequest(f"path {path!r} must start with tinker://")
        model_id, _, rest = path[len("tinker://"):].partition("/")
        kind, _, name = rest.partition("/")
        if kind not in ("weights", "sampler_weights") or not name or "/" in name \
                or name in (".", ".."):
            raise BadRequest(f"path {path!r} is not tinker://MODEL_ID/weights/NAME or "
                             "tinker://MODEL_ID/sampler_weights/NAME")
        return self.state_dir / quote(model_id, safe="") / kind / f"{quote(name, safe='')}.pt"

    def _do_save(self, model_id: str, model: TrainModel, kind: str, name: str,
                 with_optimizer: bool) -> dict:
        path = f"tinker://{model_id}/{kind}/{name}"
        file = self.path_file(path)
        file.parent.mkdir(parents=True, exist_ok=True)
        exported = self.backend.export(model.adapter, with_optimizer)
        torch.save({"owner": model.owner, "spec": dataclasses.asdict(model.spec),
                    "adapter": exported["adapter"], "adam": exported["adam"],
                    "steps": model.steps}, file)
        return {"path": path, "type": "save_weights" if kind == "weights"
                else "save_weights_for_sampler"}

    def read_state(self, owner: str, path: str) -> dict:
        file = self.path_file(path)
        if not file.is_file():
            raise NotFound(f"path {path!r}: no such checkpoint")
        state = torch.load(file, weights_only=True)
        if state["owner"] != owner:
            raise NotFound(f"path {path!r}: no such checkpoint")
        return legacy_optimizer(state)

    def _do_load_into(self, model: TrainModel, state: dict, optimizer: bool, path: str) -> dict:
        spec = LoraSpec(**state["spec"])
        if spec.suffixes() != model.spec.suffixes() or spec.rank != model.spec.rank:
            raise BadRequest(f"path {path!r} holds a rank-{spec.rank} adapter of other "
                             "targets than this model's; create a training client from it")
        self.backend.remove(model.adapter)
        self.backend.create(model.adapter, spec, state if optimizer else
                            {"adapter": state["adapter"]})
        if optimizer and state.get("adam") is not None:
            model.steps = state["steps"]
        return {"type": "load_weights", "path": path}

    def _do_snapshot(self, owner: str, model: TrainModel, sampling_session_id: str) -> dict:
        self.samplers.load(sampling_session_id, owner, model.spec, source=model.adapter)
        return {"type": "save_weights_for_sampler", "sampling_session_id": sampling_session_id}

    def _do_sampler_from_path(self, owner: str, state: dict, sampling_session_id: str,
                              path: str) -> dict:
        self.samplers.load(sampling_session_id, owner, LoraSpec(**state["spec"]), state=state,
                           path=path)
        return {}

    def _sample(self, batch) -> None:
        """One generate call for every sample request of `batch` (engine.tinker.batching; each
        row with its session's adapter: engine.tinker.sampler.sample_on). If it fails, each
        request runs again alone, so one request's failure fails only its own future."""
        def run():
            adapters = self.samplers.adapters_of(list(dict.fromkeys(
                p["session"] for _, p, _ in batch)))
            return self.backend.sample([
                {**{k: v for k, v in p.items() if k != "session"},
                 "adapter": adapters[p["session"]]} for _, p, _ in batch])
        results = self._or_each_alone(batch, self._sample, run)
        if results is None:
            return
        self.sample_batches.append(sum(p["num_samples"] for _, p, _ in batch))
        for (_, _, future), (seqs, lps) in zip(batch, results):
            future.resolve(sample_response(seqs, lps))


def transformers_backend(model_dir: str, tokenizer, sampler: SamplerSettings) -> Adapters:
    """The one-process backend: the HF model in float32 with engine.tinker.lora's adapters
    (MultiLora.from_folder), sampled by the engine's hf generation backend on the same model
    or by vLLM (engine.tinker.samplers.make_sampler)."""
    lora = MultiLora.from_folder(model_dir)
    return Adapters(lora, OneProcess(), make_sampler(sampler, model_dir, tokenizer.decode, lora))
