"""`serve` on the vllm backend (`--backend hf`: the hf one): continuous batching (a step
driver under engine.api.stepping: VLLMStepDriver, or HFStepDriver's slot cache) against the
batch path (one generate call per batch, engine.serve.batching), side by side in one run on
one engine (docs/benchmarks.md, "serve on vLLM: ...").

(a) A long request (LONG tokens) is sent, and once it ran for SHORT_AT of its own time alone
    (measured first, on the same path) a short one (SHORT tokens): the short request's latency
    (sent -> answered) and the long one's, per path. On the batch path the short request
    waits for the long call, then runs in a call of its own; on the step path it joins the
    running batch at the next step.
(b) A streamed completion of STREAM tokens: the time to the first text chunk and to the whole
    reply, per path (the batch path cuts its stream from the finished reply).
Every request is seeded; the long reply is the same on both paths (checked). The clients run
in two processes of their own (timed there), so their JSON parsing never holds the server's
GIL. Model: a tiny
Llama (tools.tiny_models.build_eos_model, hidden 1024, 2 layers, 4 heads of 256, word-level
vocabulary of 200, RoPE positions up to MAX_CONTEXT; the long and streamed requests' seeds
are the first whose samples run their length without eos, `_seed_without_eos`), float32,
one engine in this process (vLLM's CPU backend on a CPU host: eager, serve's thread binding; or
transformers, eager). Medians over REPEATS; --quick:
LONG 128, STREAM 64, one repeat (a smoke run, not a measurement).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import tempfile
import threading
from concurrent.futures import ProcessPoolExecutor
import time
from pathlib import Path

from tools.bench.common import BenchResult, Table, fmt, median, timed_post

LONG, SHORT, STREAM, REPEATS, SHORT_AT = 512, 8, 256, 5, 0.25
QUICK = (128, 64, 1)
MAX_CONTEXT = 1024
SEEDS = 64
HIDDEN = 1024   # 4 heads of 256: a step long enough to see on 2 cores


def _serving(endpoint_cls, settings, tokenizer, backend):
    """A started endpoint served by `backend` on a thread: (endpoint, stop)."""
    endpoint = endpoint_cls(tokenizer, settings, request_log=None).start()
    stop = threading.Event()
    owner = threading.Thread(target=endpoint.serve, args=(backend, stop.is_set), daemon=True)
    owner.start()

    def close() -> None:
        stop.set()
        owner.join(timeout=60)
        endpoint.stop()
    return endpoint, close


def _timed_post(url: str, body: dict) -> tuple[float, dict]:
    """In a client process (picklable for the pool): common.timed_post on a fresh
    connection."""
    import httpx

    return timed_post(httpx, url, body)


def _stream(url: str, tokens: int, seed: int = 0) -> dict:
    """(b) once, in a client process: seconds to the first text chunk and to [DONE]."""
    import httpx

    body = {"prompt": STREAM_PROMPT, "max_tokens": tokens, "seed": seed, "stream": True}
    t0, first, usage = time.perf_counter(), None, None
    with httpx.stream("POST", url, json={**body, "stream_options": {"include_usage": True}},
                      timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter() - t0
    return {"first_s": first, "whole_s": time.perf_counter() - t0,
            "tokens": usage["completion_tokens"]}


LONG_PROMPT, STREAM_PROMPT = [10, 11, 12], [30, 31, 32]


def _seed_without_eos(engine, prompt: list[int], tokens: int) -> int:
    """The first seed in 0..SEEDS-1 whose sample of `prompt` runs `tokens` tokens without
    sampling eos (one generate call): the long and the streamed requests run their length."""
    from engine.generation.base import SamplingParams

    gens = engine.generate([prompt] * SEEDS, SamplingParams(
        max_new_tokens=tokens, temperature=1.0, seeds=list(range(SEEDS))))
    for seed, gen in enumerate(gens):
        if gen.finish_reason == "length":
            return seed
    raise RuntimeError(f"every one of {SEEDS} seeds samples eos within {tokens} tokens")


def _short_during_long(clients, url: str, long: dict, running, after_s: float) -> dict:
    """(a) once: latencies of the long and the short request (each timed in a client process
    of its own: the server's threads do not share a GIL with the clients), the long ids."""
    long_job = clients.submit(_timed_post, url, long)
    while not running():
        time.sleep(0.001)
    time.sleep(after_s)
    short_job = clients.submit(_timed_post, url, {"prompt": [20, 21], "max_tokens": SHORT,
                                                  "seed": 2})
    (long_s, body), (short_s, _) = long_job.result(), short_job.result()
    return {"long_s": long_s, "short_s": short_s,
            "ids": body["choices"][0]["token_ids"]}


def run_serve_steps(quick: bool, backend: str = "vllm") -> BenchResult:
    from engine.generation.hf.stepper import HFStepDriver
    from engine.generation.sampling_backend import SamplingBackend, StepBackend
    from engine.generation.vllm.stepper import VLLMStepDriver
    from engine.serve.endpoint import ServeEndpoint, ServeSettings
    from engine.serve.model import load_model
    from tools.tiny_models import build_eos_model

    long, stream, repeats = QUICK if quick else (LONG, STREAM, REPEATS)
    folder = tempfile.mkdtemp(prefix="bench_serve_steps_")
    path = build_eos_model(f"{folder}/llama", hidden=HIDDEN, eos_boost=0.0)
    config = json.loads((Path(path) / "config.json").read_text())   # room for prompt + LONG
    (Path(path) / "config.json").write_text(json.dumps({**config, "max_position_embeddings":
                                                        MAX_CONTEXT}))
    t0 = time.perf_counter()
    loaded = load_model(path, backend, "float32", 0, MAX_CONTEXT, enforce_eager=True)
    start_s = time.perf_counter() - t0
    engine, settings = loaded.engine, ServeSettings("tiny", max(long, stream), MAX_CONTEXT)
    driver = (VLLMStepDriver if backend == "vllm" else HFStepDriver)(engine)
    long_body = {"prompt": LONG_PROMPT, "max_tokens": long, "return_token_ids": True,
                 "seed": _seed_without_eos(engine, LONG_PROMPT, long)}
    stream_seed = _seed_without_eos(engine, STREAM_PROMPT, stream)
    paths = {
        "batch (one generate call per batch)": (
            SamplingBackend(engine.generate, max_len=MAX_CONTEXT, score=engine.score),
            lambda calls: engine.num_generate_calls > calls, lambda: engine.num_generate_calls),
        "steps (continuous batching)": (
            StepBackend(driver), lambda steps: driver.steps > steps, lambda: driver.steps)}
    rows_a, rows_b, out, ids = [], [], {}, []
    clients = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"))
    try:
        for name, (backend, moved, counter) in paths.items():
            endpoint, close = _serving(ServeEndpoint, settings, loaded.tokenizer, backend)
            try:
                url = f"{endpoint.base_url}/completions"
                clients.submit(_stream, url, 4).result()        # warm-up
                alone = clients.submit(_timed_post, url, long_body).result()[0]
                runs, streams = [], []
                for _ in range(repeats):
                    before = counter()
                    runs.append(_short_during_long(clients, url, long_body,
                                                   lambda: moved(before), SHORT_AT * alone))
                    streams.append(clients.submit(_stream, url, stream, stream_seed).result())
            finally:
                close()
            ids.append(runs[0]["ids"])
            stream_tokens = streams[0]["tokens"]
            short, lng = median([r["short_s"] for r in runs]), median([r["long_s"] for r in runs])
            first, whole = (median([s["first_s"] for s in streams]),
                            median([s["whole_s"] for s in streams]))
            key = "steps" if name.startswith("steps") else "batch"
            out.update({f"short_latency_{key}_s": short, f"long_latency_{key}_s": lng,
                        f"first_chunk_{key}_s": first, f"whole_stream_{key}_s": whole})
            rows_a.append([name, fmt(alone), fmt(short), fmt(lng), fmt(short / lng)])
            rows_b.append([name, fmt(first), fmt(whole), fmt(first / whole)])
    finally:
        clients.shutdown()
        engine.shutdown()
    if ids[0] != ids[1]:
        raise RuntimeError("the long request's reply differs between the two paths")
    if len(ids[0]) != long or stream_tokens != stream:
        raise RuntimeError(f"the replies ended early ({len(ids[0])} of {long}, {stream_tokens} "
                           f"of {stream} tokens): the eos logit is not low enough")
    out.update(long_reply_tokens=len(ids[0]), stream_reply_tokens=stream_tokens,
               load_avg_1m=round(os.getloadavg()[0], 2),
               short_latency_speedup=out["short_latency_batch_s"] / out["short_latency_steps_s"],
               engine_start_s=start_s, long_tokens=long,
               short_tokens=SHORT, stream_tokens=stream, repeats=repeats)
    notes = [f"medians of {repeats} run(s); engine start {start_s:.1f} s, not counted; the "
             f"long reply's ids ({len(ids[0])} tokens) are the same on both paths (checked); "
             f"the stream's reply has {stream_tokens} tokens; host load average "
             f"(1 min) at the end: {out['load_avg_1m']}"]
    return BenchResult([
        Table(f"(a) a {SHORT}-token request sent {SHORT_AT:g} of the way into a {long}-token "
              "one", ["path", "long alone s", "short latency s", "long latency s",
                      "short / long"], rows_a, notes),
        Table(f"(b) a streamed {stream}-token completion",
              ["path", "first chunk s", "whole reply s", "first / whole"], rows_b)], out)
