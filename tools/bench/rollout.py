"""Generate once per rollout batch vs once per micro-batch, HF rollout backend on CPU.

A rollout batch of MICRO_BATCHES x PROMPTS_PER_MB prompts x N responses (GRPO groups: each
prompt repeated N times) is generated either in ONE `engine.generate` call (what the RL loop
does, engine.rl.collect.collector) or in MICRO_BATCHES calls of PROMPTS_PER_MB x N prompts each
(what a loop that samples inside its gradient-accumulation loop does). Same engine, same
sampling parameters, same number of responses; the two variants alternate after one warm-up
each, and the speedup is the ratio of median wall times.

Cases (CASES): the CPU demo / test model size with short responses is the headline (per decode
step the fixed costs of a forward pass dominate, as in GPU decoding of small batches, so one
large batch amortises them); longer responses (attention over the KV cache grows and scales with
the batch) and a 4x wider model (compute-bound on a CPU core) show where batching gains less on
a CPU. Torch runs with THREADS intra-op threads (see common.torch_threads).

Each case also times the backend's eager loop against its static KV cache and compiled decode
step (rollout.hf.static_cache / rollout.hf.compile; tools/bench/rollout_static.py), one call
for the whole rollout batch, in the same run.
"""
from __future__ import annotations

import dataclasses
import os
import random
import tempfile
import time

from tools.bench.common import BenchResult, Table, fmt, median, torch_threads

SMALL = dict(vocab_size=512, hidden=64, layers=4, heads=8, kv_heads=2, intermediate=128,
             head_dim=8)
WIDE = dict(vocab_size=4096, hidden=256, layers=4, heads=8, kv_heads=4, intermediate=768,
            head_dim=32)
# (model label, build_tiny_model kwargs, max new tokens, repeats quick, repeats full, in quick);
# the first case is the headline
CASES = (
    ("CPU demo size (h64 L4)", SMALL, 32, 5, 9, True),
    ("CPU demo size (h64 L4)", SMALL, 128, 3, 5, False),
    ("compute-bound (h256 L4)", WIDE, 32, 2, 5, True),
)
MICRO_BATCHES, PROMPTS_PER_MB, N = 8, 4, 4
MIN_PROMPT, MAX_PROMPT = 16, 64
THREADS = 1


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """MICRO_BATCHES x PROMPTS_PER_MB distinct random prompts, each repeated N times in a row
    (the GRPO group layout), as token-id lists."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(MICRO_BATCHES * PROMPTS_PER_MB):
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(MIN_PROMPT, MAX_PROMPT))]
        prompts += [prompt] * N
    return prompts


def generate_once(engine, prompts: list[list[int]], params) -> int:
    """One call for the whole rollout batch; returns the number of generated tokens."""
    return sum(len(g.response_ids) for g in engine.generate(prompts, params))


def generate_per_micro_batch(engine, prompts: list[list[int]], params) -> int:
    """MICRO_BATCHES calls of equal size (same total, each response with its own seed);
    returns generated tokens."""
    size = len(prompts) // MICRO_BATCHES
    return sum(generate_once(engine, prompts[i:i + size],
                             dataclasses.replace(params, seeds=params.seeds[i:i + size]))
               for i in range(0, len(prompts), size))


def time_variants(engine, prompts: list[list[int]], repeats: int, max_new: int
                  ) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """Wall seconds and generated tokens per timed repeat of each variant (one warm-up each,
    order alternating between repeats)."""
    from engine.generation import SamplingParams
    from engine.generation.work_split import batch_seeds

    variants = {"once": generate_once, "per_micro_batch": generate_per_micro_batch}
    times: dict[str, list[float]] = {k: [] for k in variants}
    tokens: dict[str, list[int]] = {k: [] for k in variants}
    for i in range(repeats + 1):  # i == 0: warm-up of both
        order = list(variants) if i % 2 == 0 else list(variants)[::-1]
        for name in order:
            # per-response seeds, as the RL loop samples (engine.rl.collect.collector)
            seeds = batch_seeds(1000 + i, 0, len(prompts) // N, N)
            params = SamplingParams(max_new_tokens=max_new, temperature=1.0, seeds=seeds)
            start = time.perf_counter()
            n_tokens = variants[name](engine, prompts, params)
            elapsed = time.perf_counter() - start
            if i > 0:
                times[name].append(elapsed)
                tokens[name].append(n_tokens)
    return times, tokens


def run_rollout(quick: bool) -> BenchResult:
    """Time both variants for every case; returns tables and summary."""
    from engine.generation import make_rollout_engine
    from tools.tiny_models import build_tiny_model

    from engine.generation.work_split import batch_seeds
    from tools.bench.rollout_static import static_rows, static_table, time_engines

    t0 = time.perf_counter()
    rows, speedups, fast_rows, fast = [], [], [], {}
    with torch_threads(THREADS):
        for label, cfg, max_new, reps_quick, reps_full, in_quick in CASES:
            if quick and not in_quick:
                continue
            repeats = reps_quick if quick else reps_full
            with tempfile.TemporaryDirectory(prefix="bench_rollout_") as tmp:
                model_dir = build_tiny_model(os.path.join(tmp, "model"), "qwen3",
                                             tokenizer=False, seed=0, **cfg)
                engine = make_rollout_engine("hf", model_dir, device="cpu")
                prompts = make_prompts(cfg["vocab_size"])
                times, tokens = time_variants(engine, prompts, repeats, max_new)
                seeds = batch_seeds(2000, 0, len(prompts) // N, N)
                compared = time_engines(model_dir, prompts, seeds, max_new, repeats)
            case_rows, ratios = static_rows(label, max_new, compared)
            fast_rows += case_rows
            for name, x in ratios.items():
                fast[f"{label}, {max_new} new tokens, {name}"] = x
            speedup = median(times["per_micro_batch"]) / median(times["once"])
            speedups.append((label, max_new, speedup))
            for name, calls in (("once", 1), ("per_micro_batch", MICRO_BATCHES)):
                med = median(times[name])
                rows.append([label, str(max_new), f"{calls} x {len(prompts) // calls}",
                             fmt(med, 2), fmt(median(tokens[name]) / med, 0), str(repeats),
                             fmt(speedup, 2) + "x" if calls == 1 else ""])
    table = Table(
        "Rollout: one generate call per rollout batch vs one per micro-batch (HF backend, CPU)",
        ["model", "max new tokens", "calls x responses", "median s", "tokens/s", "repeats",
         "speedup"], rows,
        [f"{MICRO_BATCHES} micro-batches x {PROMPTS_PER_MB} prompts x n={N} = "
         f"{MICRO_BATCHES * PROMPTS_PER_MB * N} responses per rollout batch; prompts "
         f"{MIN_PROMPT}-{MAX_PROMPT} tokens (left-padded per call), temperature 1, one seed "
         f"per response (as the RL loop); timed repeats per variant after a warm-up, order "
         f"alternating; torch intra-op threads = "
         f"{THREADS}. speedup = median time of 8 calls / median time of 1 call."])
    summary = {"generate_once_speedup": speedups[0][2],
               "hf_static_vs_eager": fast,
               "generate_once_speedups": {f"{label}, {n} new tokens": x
                                          for label, n, x in speedups},
               "rollout_seconds": time.perf_counter() - t0}
    return BenchResult([table, static_table(fast_rows, len(prompts))], summary)
