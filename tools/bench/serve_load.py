"""`serve --backend vllm` against vLLM's own OpenAI server under a mixed load
(docs/benchmarks.md, "serve under load against vLLM's server").

Both servers run as processes of their own, side by side, on the same local checkpoint
in float32 with the same --max-model-len and KV cache bytes (KV_BYTES; vLLM's server otherwise
with its own defaults, serve with rollout.vllm's), and get
the same workload from asyncio clients in this process: CLIENTS completions whose max_tokens
are drawn uniformly from [MIN_TOKENS, MAX_TOKENS] and whose send times from [0, SPREAD_S)
(seeded: the same draws for both servers), each with its own `seed`, temperature 1. Both
servers sample a request with its `seed` as vLLM's per-request seed (serve: choice 0 of a
request samples with its seed itself), so the same request gets the same reply from both. The
seeds are picked on vLLM's server before its rounds (`pick_seeds`: per request the first of
seed, seed + SEED_STRIDE, ... whose reply runs its max_tokens without eos), so every reply runs
its max_tokens on both sides and both do the same work (checked: the completion token totals
must be equal, else the run is refused). Model: tools.tiny_models.build_eos_model (hidden
HIDDEN, 2 layers, 4 heads, eos_boost 0: eos is rare). Reported per server, medians
over REPEATS rounds (alternating between the servers) after one warm-up round: completion
tokens per second (all completion tokens / seconds from the first send to the last answer),
p50 and p99 of the request latency (sent -> answered), and the ratio serve / vLLM of tokens
per second (the issue's goal: >= 0.9).

    python -m tools.bench serve_load [--quick]

--quick: 8 clients, max_tokens in [8, 64], one round (a smoke run, not a measurement). A server
start costs about a minute on a 2-core host and is not counted.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.bench.common import BenchResult, Table, fmt, median, quantile

CLIENTS, MIN_TOKENS, MAX_TOKENS, SPREAD_S, REPEATS = 16, 8, 256, 2.0, 3
QUICK = (8, 64, 1)
HIDDEN, MAX_CONTEXT, SEED_STRIDE, SEED_TRIES = 512, 512, 7919, 16
KV_BYTES = 1 << 30   # the KV cache of both: serve's rollout.vllm.kv_cache_gib default on a CPU
PORTS = {"vllm": 8131, "serve": 8132}


def workload(clients: int, max_tokens: int, seed: int = 0) -> list[dict]:
    """The requests' (send offset s, body), the same for both servers: seeded draws."""
    rng = random.Random(seed)
    return [{"at": rng.uniform(0, SPREAD_S),
             "body": {"model": "tiny", "prompt": [10 + i % 50, 11, 12], "temperature": 1.0,
                      "max_tokens": rng.randint(MIN_TOKENS, max_tokens), "seed": 1000 + i}}
            for i in range(clients)]


async def _one(client, url: str, job: dict, t0: float) -> tuple[float, int]:
    await asyncio.sleep(max(0.0, t0 + job["at"] - time.perf_counter()))
    sent = time.perf_counter()
    r = await client.post(url, json=job["body"], timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"{url}: {r.status_code}: {r.text[:300]}")
    return time.perf_counter() - sent, int(r.json()["usage"]["completion_tokens"])


async def _round(url: str, jobs: list[dict]) -> dict:
    """One round of the workload: tokens/s, latencies, completion tokens."""
    import httpx

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(jobs))) as client:
        t0 = time.perf_counter()
        done = await asyncio.gather(*[_one(client, url, j, t0) for j in jobs])
        wall = time.perf_counter() - t0 - min(j["at"] for j in jobs)
    latencies = sorted(s for s, _ in done)
    tokens = sum(n for _, n in done)
    return {"tokens_per_s": tokens / wall, "tokens": tokens, "wall_s": wall,
            "p50_s": quantile(latencies, 0.5), "p99_s": quantile(latencies, 0.99)}


def _command(name: str, model: str, port: int) -> list[str]:
    if name == "vllm":
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--port", str(port), "--dtype", "float32", "--served-model-name", "tiny",
                "--max-model-len", str(MAX_CONTEXT), "--kv-cache-memory-bytes", str(KV_BYTES)]
    return [sys.executable, "-m", "engine.serve", "--model", model, "--backend", "vllm",
            "--port", str(port), "--dtype", "float32", "--served-model-name", "tiny",
            "--max-context", str(MAX_CONTEXT), "--max-tokens", str(MAX_TOKENS), "--quiet"]


def _wait_up(url: str, proc: subprocess.Popen, log: Path, limit_s: float = 600,
             health: str = "/health") -> float:
    """Seconds until `url` + `health` answers 200; raises when the server exits or never
    does."""
    import httpx

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited ({proc.returncode}); its output: "
                               f"{log.read_text()[-2000:]}")
        try:
            if httpx.get(url + health, timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url}: not up after {limit_s:g} s")


async def pick_seeds(url: str, jobs: list[dict]) -> None:
    """Set each job's seed to the first of seed + k * SEED_STRIDE (k < SEED_TRIES) whose reply
    runs its max_tokens (module docstring); raises when one never does."""
    import httpx

    pending = list(jobs)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(jobs))) as client:
        for _ in range(SEED_TRIES):
            replies = await asyncio.gather(*[client.post(url, json=j["body"], timeout=600)
                                             for j in pending])
            short = []
            for job, r in zip(pending, replies):
                if r.status_code != 200:
                    raise RuntimeError(f"{url}: {r.status_code}: {r.text[:300]}")
                if r.json()["usage"]["completion_tokens"] < job["body"]["max_tokens"]:
                    job["body"]["seed"] += SEED_STRIDE
                    short.append(job)
            pending = short
            if not pending:
                return
    raise RuntimeError(f"{len(pending)} request(s) sampled eos with each of {SEED_TRIES} seeds")


def _start(name: str, model: str, folder: str) -> tuple[subprocess.Popen, str, float]:
    """Server `name` started and answering: (process, completions URL, seconds to start)."""
    port = PORTS[name]
    log = Path(folder) / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(_command(name, model, port), stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        start_s = _wait_up(f"http://127.0.0.1:{port}", proc, log)
    except BaseException:
        proc.terminate()
        raise
    return proc, f"http://127.0.0.1:{port}/v1/completions", start_s


def _measure_both(model: str, jobs: list[dict], repeats: int, folder: str) -> dict:
    """Both servers started one after the other and kept up; the jobs' seeds picked on vLLM's;
    one warm-up round each, then `repeats` rounds alternating vLLM, serve, vLLM, ... (so a
    change of the host's load meets both alike); both stopped. {name: its figures}."""
    procs, urls, starts = {}, {}, {}
    try:
        for name in ("vllm", "serve"):
            procs[name], urls[name], starts[name] = _start(name, model, folder)
        asyncio.run(pick_seeds(urls["vllm"], jobs))
        for url in urls.values():
            asyncio.run(_round(url, jobs[:2]))                           # warm-up
        rounds: dict[str, list[dict]] = {name: [] for name in urls}
        for _ in range(repeats):
            for name, url in urls.items():
                rounds[name].append(asyncio.run(_round(url, jobs)))
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(timeout=120)
    return {name: {"start_s": starts[name], "rounds": r, "tokens": r[0]["tokens"],
                   **{k: median([x[k] for x in r]) for k in ("tokens_per_s", "p50_s", "p99_s")}}
            for name, r in rounds.items()}


def run_serve_load(quick: bool) -> BenchResult:
    from tools.tiny_models import build_eos_model

    clients, max_tokens, repeats = QUICK if quick else (CLIENTS, MAX_TOKENS, REPEATS)
    folder = tempfile.mkdtemp(prefix="bench_serve_load_")
    model = build_eos_model(f"{folder}/llama", hidden=HIDDEN, eos_boost=0.0)
    config = json.loads((Path(model) / "config.json").read_text())
    (Path(model) / "config.json").write_text(json.dumps(
        {**config, "max_position_embeddings": MAX_CONTEXT}))
    jobs = workload(clients, max_tokens)
    asked = sum(j["body"]["max_tokens"] for j in jobs)
    res = _measure_both(model, jobs, repeats, folder)
    for name, r in res.items():
        if r["tokens"] != asked:
            raise RuntimeError(f"{name}: {r['tokens']} completion tokens of the {asked} asked: "
                               "a reply ended at eos; the comparison needs equal work")
    ratio = res["serve"]["tokens_per_s"] / res["vllm"]["tokens_per_s"]
    rows = [[label, fmt(r["tokens_per_s"], 1), fmt(r["p50_s"]), fmt(r["p99_s"]),
             fmt(r["start_s"], 1)]
            for label, r in (("vLLM's OpenAI server", res["vllm"]),
                             ("serve --backend vllm (step driver)", res["serve"]))]
    summary = {"serve_over_vllm_tokens_per_s": ratio, "clients": clients,
               "completion_tokens": asked, "repeats": repeats,
               "load_avg_1m": round(os.getloadavg()[0], 2),
               **{f"{k}_{name}": r[k] for name, r in res.items()
                  for k in ("tokens_per_s", "p50_s", "p99_s", "start_s")}}
    notes = [f"{clients} clients, max_tokens uniform in [{MIN_TOKENS}, {max_tokens}] "
             f"({asked} completion tokens, every reply ran its max_tokens on both servers), "
             f"sent at uniform times in [0, {SPREAD_S:g}) s; medians of {repeats} round(s) "
             f"per server, alternating, after a warm-up; serve / vLLM tokens per second {ratio:.3f} (goal >= 0.9); "
             f"host load average (1 min) at the end: {summary['load_avg_1m']}"]
    return BenchResult([Table("(c) mixed clients: serve against vLLM's own server",
                              ["server", "completion tokens/s", "p50 latency s",
                               "p99 latency s", "start s (not counted)"], rows, notes)],
                       summary)
