"""Rollout throughput by backend: the same prompts, weights and sampling through
rollout.backend=hf and rollout.backend=vllm, tokens/s each and the ratio (goal: vllm >= 4x hf).

A ~100M-parameter Qwen3-shaped checkpoint (hidden 768, 12 layers, 12 heads of 64, 4 KV heads,
SwiGLU 2048, vocabulary 32,000, tied embeddings; random weights, fp32), PROMPTS random prompts
of 32-96 tokens, MAX_NEW new tokens each, temperature 1, one seed per response (as the RL loop).
Each backend is built, warmed up with one short call, then timed over REPEATS full calls;
tokens/s = generated tokens / wall seconds of the call (engine start-up not counted, reported
apart). Both run with THREADS torch threads (vLLM's engine process: OMP_NUM_THREADS).
`--quick`: 16 prompts x 32 tokens, one repeat (a smoke run, not a measurement).
"""
from __future__ import annotations

import os
import random
import tempfile
import time

from tools.bench_common import BenchResult, Table, fmt, median, torch_threads

MODEL = dict(vocab_size=32000, hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048,
             head_dim=64, tie_word_embeddings=True)
PROMPTS, MAX_NEW, REPEATS = 64, 256, 1
QUICK = (16, 32, 1)
THREADS = 2


def _prompts(count: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(32, 96))] for _ in range(count)]


def _time_backend(name: str, model_dir: str, prompts, max_new: int, repeats: int) -> dict:
    import torch

    from engine.rl.rollout import SamplingParams, make_rollout_engine
    from engine.rl.rollout.vllm_settings import engine_args

    start = time.perf_counter()
    if name == "vllm":
        from engine.rl.config import VLLMConfig
        kwargs = engine_args(VLLMConfig(), 1, not torch.cuda.is_available())
        engine = make_rollout_engine("vllm", model_dir, dtype=torch.float32, seed=0, **kwargs)
    else:
        engine = make_rollout_engine("hf", model_dir, dtype=torch.float32)
    load = time.perf_counter() - start
    seeds = list(range(len(prompts)))
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, seeds=seeds[:2]))  # warm-up
    times, tokens = [], []
    for _ in range(repeats):
        params = SamplingParams(max_new_tokens=max_new, temperature=1.0, seeds=seeds)
        start = time.perf_counter()
        out = engine.generate(prompts, params)
        times.append(time.perf_counter() - start)
        tokens.append(sum(len(g.response_ids) for g in out))
    engine.shutdown()
    return {"load_s": load, "seconds": median(times), "tokens": median(tokens),
            "tokens_per_s": median(tokens) / median(times)}


def run_backends(quick: bool) -> BenchResult:
    from tools.tiny_models import build_tiny_model

    count, max_new, repeats = QUICK if quick else (PROMPTS, MAX_NEW, REPEATS)
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))  # vLLM's engine process reads it
    results = {}
    with torch_threads(THREADS), tempfile.TemporaryDirectory(prefix="bench_backends_") as tmp:
        model_dir = build_tiny_model(os.path.join(tmp, "model"), "qwen3", tokenizer=False,
                                     seed=0, eos_token_id=1, **MODEL)
        prompts = _prompts(count, MODEL["vocab_size"])
        for name in ("hf", "vllm"):
            results[name] = _time_backend(name, model_dir, prompts, max_new, repeats)
    ratio = results["vllm"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
    rows = [[name, fmt(r["load_s"], 1), fmt(r["seconds"], 1), str(int(r["tokens"])),
             fmt(r["tokens_per_s"], 0), fmt(ratio, 2) + "x" if name == "vllm" else ""]
            for name, r in results.items()]
    table = Table("Rollout throughput by backend (same prompts, weights and sampling)",
                  ["backend", "start-up s", "median s per call", "tokens", "tokens/s", "ratio"],
                  rows, [f"{count} prompts x up to {max_new} new tokens, ~100M-parameter "
                         f"Qwen3-shaped model, fp32, temperature 1, one seed per response, "
                         f"{THREADS} threads, median of {repeats} timed call(s) after a "
                         "warm-up; eos is a token random weights rarely sample"])
    return BenchResult([table], {"vllm_over_hf_tokens_per_s": ratio,
                                 "rollout_backends": results})
