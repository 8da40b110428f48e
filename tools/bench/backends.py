"""Rollout throughput by backend: the same prompts, weights and sampling through
rollout.backend=hf and rollout.backend=vllm, tokens/s each and the ratio (goal: vllm >= 4x hf).
A third row, `vllm-plain`, is vLLM's own offline `LLM` with the same engine arguments, prompts and
per-request seeds but without the RL backend's glue (its log-prob wrapper, our Generation
records): the backend's tokens/s over it is what the glue costs.

A ~100M-parameter Qwen3-shaped checkpoint (hidden 768, 12 layers, 12 heads of 64, 4 KV heads,
SwiGLU 2048, vocabulary 32,000, tied embeddings; random weights, fp32), PROMPTS random prompts
of 32-96 tokens, MAX_NEW new tokens each, temperature 1, one seed per response (as the RL loop).
Each backend is built, warmed up with one short call, then timed over REPEATS full calls;
tokens/s = generated tokens / wall seconds of the call (engine start-up not counted, reported
apart). Both run with THREADS torch threads (vLLM's engine process: OMP_NUM_THREADS).
`--quick`: 16 prompts x 32 tokens, one repeat (a smoke run, not a measurement).

GRPO step-time split (`run_grpo_split`): the same checkpoint (with the tiny word-level tokenizer)
trained by `python -m engine.rl` (one process, THREADS threads, default GRPO settings with its
KL term to a reference model) for GRPO_STEPS steps of GRPO_PROMPTS prompts x GRPO_N responses of
GRPO_NEW new tokens, once per backend. The split is the run's own metrics (time/rollout_s,
time/logprob_s: old-policy and reference passes, time/train_s, time/weight_sync_s: export and
load into the engine, time/step_s) of the last step, the update being time/train_s (log-prob
passes and updates) minus time/logprob_s; step 1 also pays one-off warm-ups.
"""
from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time

from tools.bench.common import (REPO_ROOT, BenchResult, Table, fmt, machine_info, median,
                                run_launch, subprocess_env, torch_threads)

MODEL = dict(vocab_size=32000, hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048,
             head_dim=64, tie_word_embeddings=True)
PROMPTS, MAX_NEW, REPEATS = 64, 256, 1
QUICK = (16, 32, 1)
THREADS = 2
GRPO_PROMPTS, GRPO_N, GRPO_NEW, GRPO_STEPS = 8, 4, 64, 2
GRPO_QUICK = (2, 2, 8, 2)
SPLIT_KEYS = ("time/rollout_s", "time/logprob_s", "time/train_s", "time/weight_sync_s",
              "time/step_s")
COLUMNS = ("time/rollout_s", "time/logprob_s", "update_s", "time/weight_sync_s", "time/step_s")


def _prompts(count: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(32, 96))] for _ in range(count)]


def _time_backend(name: str, model_dir: str, prompts, max_new: int, repeats: int) -> dict:
    import torch

    from engine.generation import SamplingParams, make_rollout_engine
    from engine.generation.vllm.settings import engine_args

    start = time.perf_counter()
    if name == "vllm":
        from engine.config.rollout_settings import VLLMConfig
        kwargs = engine_args(VLLMConfig(), 1, not torch.cuda.is_available())
        engine = make_rollout_engine("vllm", model_dir, dtype=torch.float32, seed=0, **kwargs)
    else:
        engine = make_rollout_engine("hf", model_dir, dtype=torch.float32)
    load = time.perf_counter() - start

    def call(count: int, new: int) -> int:
        params = SamplingParams(max_new_tokens=new, temperature=1.0, seeds=list(range(count)))
        return sum(len(g.response_ids) for g in engine.generate(prompts[:count], params))

    try:
        return _timed(call, load, len(prompts), max_new, repeats)
    finally:
        engine.shutdown()


def _timed(call, load_s: float, count: int, max_new: int, repeats: int) -> dict:
    """`call(count, new_tokens)` -> generated tokens: one warm-up call (2 prompts, 4 tokens),
    then `repeats` timed calls; medians of seconds and tokens."""
    call(2, 4)
    times, tokens = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens.append(call(count, max_new))
        times.append(time.perf_counter() - start)
    return {"load_s": load_s, "seconds": median(times), "tokens": median(tokens),
            "tokens_per_s": median(tokens) / median(times)}


def _grpo_split(backend: str, model_dir: str, prompts_file: str, out: str,
                shape: tuple[int, int, int, int]) -> dict:
    """time/* of the last step of a GRPO run with rollout.backend=`backend` (one process) of
    `shape` = (prompts per step, responses per prompt, new tokens, steps)."""
    prompts, n, new, steps = shape
    cmd = [sys.executable, "-m", "engine.rl", f"model.hf_path={model_dir}",
           f"data.train_files=[{prompts_file}]", f"rollout.backend={backend}",
           f"rollout.n={n}", f"rollout.max_new_tokens={new}", f"train.prompts_per_step={prompts}",
           "train.micro_batch_size=4", f"train.max_steps={steps}", "train.seq_length=256",
           "optim.lr=1e-6", "data.num_workers=0", f"data.cache_dir={out}/cache",
           f"logging.dir={out}/run", "logging.progress_bar=false"]
    start = time.perf_counter()
    run_launch(cmd, subprocess_env(THREADS), 3600, f"GRPO on rollout.backend={backend}",
               cwd=str(REPO_ROOT))
    wall = time.perf_counter() - start
    with open(f"{out}/run/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    last = rows[-1]
    return {"wall_s": wall, "steps": len(rows), **{k: last.get(k) for k in SPLIT_KEYS},
            "update_s": last["time/train_s"] - last["time/logprob_s"],
            "response_length_mean": last.get("response/length_mean")}


def run_grpo_split(model_dir: str, tmp: str, quick: bool) -> tuple[Table, dict]:
    """The GRPO step-time split per backend on `model_dir` (which needs a tokenizer)."""
    shape = GRPO_QUICK if quick else (GRPO_PROMPTS, GRPO_N, GRPO_NEW, GRPO_STEPS)
    prompts, n, new, steps = shape
    rng = random.Random(1)
    prompts_file = os.path.join(tmp, "prompts.jsonl")
    with open(prompts_file, "w") as f:
        for _ in range(64):
            words = " ".join(f"w{rng.randrange(30000)}" for _ in range(rng.randint(32, 96)))
            f.write(json.dumps({"prompt": words, "answer": "7"}) + "\n")
    split = {b: _grpo_split(b, model_dir, prompts_file, os.path.join(tmp, f"grpo_{b}"), shape)
             for b in ("hf", "vllm")}
    rows = [[b, *(fmt(r[k], 1) for k in COLUMNS), fmt(r["response_length_mean"], 0)]
            for b, r in split.items()]
    hf_step, vllm_step = split["hf"]["time/step_s"], split["vllm"]["time/step_s"]
    table = Table("GRPO step-time split by backend (seconds, last step)",
                  ["backend", "rollout", "log-probs", "update", "weight sync", "step",
                   "response length"], rows,
                  [f"`python -m engine.rl`, one process, {THREADS} threads, {prompts} prompts x "
                   f"{n} responses x up to {new} new tokens, {steps} steps, the same checkpoint "
                   "as above with a word-level tokenizer; log-probs: old-policy and reference "
                   "passes; weight sync: export and load into the engine. hf / vllm step time: "
                   f"{fmt(hf_step / vllm_step if hf_step and vllm_step else None, 2)}x"])
    return table, split


def _time_vllm_plain(model_dir: str, prompts, max_new: int, repeats: int) -> dict:
    """vLLM's offline LLM alone (no RL glue), as _time_backend times a backend: the same
    engine arguments and thread binding as rollout.backend=vllm, the sampled token's log-prob
    requested (vLLM's default mode), one seed per request."""
    import torch
    import vllm

    from engine.config.rollout_settings import VLLMConfig
    from engine.generation.vllm.process import engine_process_env
    from engine.generation.vllm.settings import engine_args

    on_cpu = not torch.cuda.is_available()
    start = time.perf_counter()
    with engine_process_env(on_cpu):
        llm = vllm.LLM(model=model_dir, dtype="float32", seed=0, skip_tokenizer_init=True,
                       **engine_args(VLLMConfig(), 1, on_cpu))
    load = time.perf_counter() - start

    def call(count: int, new: int) -> int:
        params = [vllm.SamplingParams(temperature=1.0, max_tokens=new, seed=i, logprobs=0,
                                      detokenize=False) for i in range(count)]
        out = llm.generate([{"prompt_token_ids": p} for p in prompts[:count]], params,
                           use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in out)

    try:
        return _timed(call, load, len(prompts), max_new, repeats)
    finally:
        llm.llm_engine.engine_core.shutdown()


def run_backends(quick: bool) -> BenchResult:
    from tools.tiny_models import build_tiny_model

    count, max_new, repeats = QUICK if quick else (PROMPTS, MAX_NEW, REPEATS)
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))  # vLLM's engine process reads it
    results = {}
    with torch_threads(THREADS), tempfile.TemporaryDirectory(prefix="bench_backends_") as tmp:
        model_dir = build_tiny_model(os.path.join(tmp, "model"), "qwen3", seed=0,
                                     eos_token_id=1, **MODEL)
        prompts = _prompts(count, MODEL["vocab_size"])
        for name in ("hf", "vllm"):
            results[name] = _time_backend(name, model_dir, prompts, max_new, repeats)
        results["vllm-plain"] = _time_vllm_plain(model_dir, prompts, max_new, repeats)
        split_table, split = run_grpo_split(model_dir, tmp, quick)
    host = machine_info()
    hf_rate = results["hf"]["tokens_per_s"]
    ratio = results["vllm"]["tokens_per_s"] / hf_rate
    glue = results["vllm"]["tokens_per_s"] / results["vllm-plain"]["tokens_per_s"]
    rows = [[name, fmt(r["load_s"], 1), fmt(r["seconds"], 1), str(int(r["tokens"])),
             fmt(r["tokens_per_s"], 0), "" if name == "hf" else
             fmt(r["tokens_per_s"] / hf_rate, 2) + "x"] for name, r in results.items()]
    table = Table("Rollout throughput by backend (same prompts, weights and sampling)",
                  ["backend", "start-up s", "median s per call", "tokens", "tokens/s", "ratio"],
                  rows, [f"{count} prompts x up to {max_new} new tokens, ~100M-parameter "
                         f"Qwen3-shaped model, fp32, temperature 1, one seed per response, "
                         f"{THREADS} threads, median of {repeats} timed call(s) after a "
                         "warm-up; eos is a token random weights rarely sample; vllm-plain: "
                         f"vLLM's LLM without the RL glue (vllm / vllm-plain = {glue:.2f})",
                         f"host: {host['cpu']} ({host['cpu_vector_units']}), "
                         f"{host['cpu_cores']} cores: the ratio depends on the CPU"])
    return BenchResult([table, split_table], {"vllm_over_hf_tokens_per_s": ratio,
                                              "vllm_over_plain_vllm_tokens_per_s": glue,
                                              "rollout_backends": results, "machine": host,
                                              "grpo_step_split": split})
