"""The serving lifetime of `python -m engine.serve` (flags checked by engine.serve.__main__):
load the model, start the endpoint, serve on this thread (the one that owns the engine) until
SIGTERM or SIGINT, then answer what is queued with 503, stop listening and shut the engine down.
Request lines (unless --quiet) go to stdout through REQUEST_LOG ("[serve] <time> <line>").
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading

from engine.errors import RunError
from engine.generation.hf.stepper import HFStepDriver, step_problem
from engine.generation.sampling_backend import SamplingBackend, StepBackend
from engine.generation.vllm.attention import head_dim_problem, vllm_on_cpu
from engine.generation.vllm.stepper import VLLMStepDriver
from engine.serve.endpoint import REQUEST_LOG, ServeEndpoint, ServeSettings
from engine.serve.folder import model_vocab
from engine.serve.model import load_model


def serving_backend(backend: str, engine, max_context: int):
    """Continuous batching through the engine's step driver (vllm: VLLMStepDriver over
    vLLM's step API; hf: HFStepDriver over its slot cache), so requests join the running
    batch and streams are live (engine.api.stepping). An hf engine the step driver does not
    serve (hf.stepper.step_problem: a vision tower, layers other than full attention) gets one
    generate call per batch (SamplingBackend: max_len, a request never shares a budget that
    would take its prompt past the context; score, the raw-logit log-probs of requests with
    logprobs / echo, engine.api.evaluation), said on stdout."""
    if backend == "vllm":
        return StepBackend(VLLMStepDriver(engine, logprobs=False))   # scores: a scoring pass
    problem = step_problem(engine)
    if problem is None:
        return StepBackend(HFStepDriver(engine))
    print(f"[serve] one generate call per batch (no continuous batching): {problem}",
          flush=True)
    return SamplingBackend(engine.generate, max_len=max_context, score=engine.score)


def backend_problem(backend: str, path: str) -> str | None:
    """--backend vllm on vLLM's CPU platform (engine.generation.vllm.attention.vllm_on_cpu):
    why vLLM's CPU attention cannot run the folder's model (head_dim_problem: it would start,
    then fail every request), checked before vLLM is imported; else None."""
    if backend != "vllm" or not vllm_on_cpu():
        return None
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        why = head_dim_problem(json.load(f))
    return (f"--model {path!r} does not run on the vllm backend on a CPU host: {why}; "
            "use --backend hf") if why else None


def serve_model(args) -> int:
    """Serve `args` (the parsed, checked flags) until a signal: exit code 0, 2 when the model
    does not load (or the vllm backend cannot run it: backend_problem), 1 when the engine dies
    or the port cannot be bound."""
    problem = backend_problem(args.backend, args.model)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        loaded = load_model(args.model, args.backend, args.dtype, args.seed, args.max_context,
                            args.trust_remote_code, args.enforce_eager)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    settings = ServeSettings(name, args.max_tokens, args.max_context, args.temperature,
                             args.top_p, args.seed, max_choices=args.max_choices,
                             max_n=args.max_n,
                             max_score_gib=args.max_score_gib,
                             vocab_size=model_vocab(args.model))
    engine, stop = loaded.engine, threading.Event()
    previous = {}   # Python installs signal handlers from the main thread only
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, lambda *_: stop.set())
                    for s in (signal.SIGINT, signal.SIGTERM)}
    endpoint = ServeEndpoint(loaded.tokenizer, settings, args.host, args.port,
                             args.batch_wait_ms / 1000, args.max_batch, args.api_key,
                             int(args.max_body_mb * 2 ** 20), args.max_queue,
                             None if args.quiet else REQUEST_LOG)
    code, handler, level = 0, None, REQUEST_LOG.level
    if not args.quiet:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[serve] %(asctime)s %(message)s"))
        REQUEST_LOG.addHandler(handler)
        REQUEST_LOG.setLevel(logging.INFO)
    try:
        endpoint.start()
        keyed = f"; requests need the key of {args.api_key_from}" if args.api_key else ""
        print(f"[serve] {args.model} on the {args.backend} backend: {endpoint.base_url} "
              f"(model {name!r}{keyed})", flush=True)
        backend = serving_backend(args.backend, engine, args.max_context)
        endpoint.serve(backend, stop.is_set, alive=lambda: engine.is_alive)
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 1
    finally:
        endpoint.stop()
        engine.shutdown()
        for s, previous_handler in previous.items():
            signal.signal(s, previous_handler)
        if handler is not None:
            REQUEST_LOG.removeHandler(handler)
            REQUEST_LOG.setLevel(level)
    print("[serve] stopped", flush=True)
    return code
