"""Rollout engine scaling: tokens/s and weight-sync time by engine count (HF backend).

`python -m tools.bench rollout --engines 1,2` runs, per engine count E, one torchrun launch of
WORLD gloo ranks on this machine (one "node", training layout DP=WORLD, TP1: every rank holds a
model replica). E HF engines are placed by engine.generation.placement (owners: ranks 0, ...,
one engine per rank at most) and driven through engine.generation.pool exactly as the RL loop
does: rank 0 splits a fixed rollout batch (PROMPTS prompts x N samples, seeded per response)
over the engines, each owner makes one generate call, results come back to rank 0. Timed:
REPEATS generation batches after one warm-up, and REPEATS weight syncs
(engine.rl.policy.weight_sync.sync_to_rollout into every engine, each fed by its own replica).
Every rank runs torch with one intra-op thread.

What a 2-core machine can show: with E engines on E cores the generation wall time falls
because E processes decode in parallel; it says nothing about GPU decoding, where one engine
is rarely compute-bound and scaling comes from more GPUs. The sync time shows that E engines
fill in parallel (one stream per replica) instead of E times one stream through rank 0.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from tools.bench.common import (BenchResult, Table, fmt, free_port, last_json_line,
                          median, run_launch, subprocess_env)

# compute-bound on a CPU core (rollout.py's WIDE case), so decoding dominates the fixed costs
MODEL = dict(vocab_size=4096, hidden=256, layers=4, heads=8, kv_heads=4, intermediate=768,
             head_dim=32)
WORLD = 2
PROMPTS, N, MAX_NEW = 16, 4, 32


def engines_worker(model_dir: str, engines: int, repeats: int) -> None:
    """One torchrun rank: build the replica and this rank's engine, time generation batches
    and weight syncs; rank 0 prints one JSON line."""
    import random

    import torch
    import torch.distributed as dist

    from engine.generation import SamplingParams, make_rollout_engine
    from engine.generation.placement import resolve_placement
    from engine.generation.pool import RolloutPool
    from engine.generation.work_split import batch_seeds
    from engine.rl.policy.weight_sync import sync_to_rollout
    from models.bridge.weights import load_hf_weights
    from models.build.factory import build_model_chunks
    from models.hf.io import SafetensorsReader, read_config
    from parallel.layout import ParallelLayout
    from parallel.process_groups import init_distributed, setup_model_parallel, shutdown

    torch.set_num_threads(1)
    rank, world = init_distributed()
    setup_model_parallel(ParallelLayout(world))
    hf_config = read_config(model_dir)
    chunks = build_model_chunks(hf_config)
    load_hf_weights(chunks, SafetensorsReader(model_dir), hf_config)
    placement = resolve_placement(engines, 1, world, world)
    mine = placement.engine_of(rank)
    engine = make_rollout_engine("hf", model_dir, device="cpu") if mine is not None else None

    class _Cfg:  # the rollout keys the pool reads
        max_retries, retry_wait_s, backend = 0, 0.0, "hf"

    pool = RolloutPool(placement, engine, _Cfg())
    rng = random.Random(0)
    prompts = []
    for _ in range(PROMPTS):
        prompt = [rng.randrange(4, MODEL["vocab_size"]) for _ in range(rng.randint(16, 48))]
        prompts += [prompt] * N
    gen_s, tokens, sync_s, sync_bytes = [], [], [], 0
    for i in range(repeats + 1):  # i == 0: warm-up
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0,
                                    seeds=batch_seeds(1, i, PROMPTS, N))
            gens, _stats = pool.generate(prompts, params, N, i)
            pool.finish(None)
            count = sum(len(g.response_ids) for g in gens)
        else:
            pool.serve()
        elapsed = time.perf_counter() - start
        dist.barrier()
        start = time.perf_counter()
        stats = sync_to_rollout(chunks, hf_config, engine, 512.0, placement.owners)
        dist.barrier()
        if i > 0 and rank == 0:
            gen_s.append(elapsed)
            tokens.append(count)
            sync_s.append(time.perf_counter() - start)
            sync_bytes = stats.total_bytes
    if rank == 0:
        print(json.dumps({"engines": engines, "gen_s": gen_s, "tokens": tokens,
                          "sync_s": sync_s, "sync_bytes": sync_bytes,
                          "owners": list(placement.owners)}), flush=True)
    shutdown()


def _launch(model_dir: str, engines: int, repeats: int, timeout_s: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           "-m", "tools.bench", "_engines_worker", "--model-dir", model_dir,
           "--engines", str(engines), "--repeats", str(repeats)]
    out, _ = run_launch(cmd, subprocess_env(threads=1), timeout_s, "engines worker")
    return last_json_line(out)


def run_engines(counts: list[int], quick: bool, timeout_s: int = 900) -> BenchResult:
    """One launch per engine count; tables and summary (tokens/s and sync seconds)."""
    from tools.tiny_models import build_tiny_model

    bad = [c for c in counts if not 1 <= c <= WORLD]
    if bad:
        raise ValueError(f"--engines {bad}: this benchmark runs {WORLD} ranks, so 1..{WORLD} "
                         "engines")
    repeats = 3 if quick else 7
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_engines_") as tmp:
        model_dir = build_tiny_model(os.path.join(tmp, "model"), "qwen3", tokenizer=False,
                                     seed=0, **MODEL)
        raws = [_launch(model_dir, c, repeats, timeout_s) for c in counts]
    rows, per_count = [], {}
    base = None
    for raw in raws:
        rate = median([t / s for t, s in zip(raw["tokens"], raw["gen_s"])])
        base = base or rate
        sync = median(raw["sync_s"])
        per_count[str(raw["engines"])] = {"tokens_per_s": rate, "sync_s": sync}
        rows.append([str(raw["engines"]), str(raw["owners"]), fmt(median(raw["gen_s"]), 3),
                     fmt(rate, 0), fmt(rate / base, 2) + "x", fmt(sync, 3),
                     fmt(raw["sync_bytes"] / 1e6, 2)])
    table = Table(
        "Rollout engine scaling (HF backend, CPU, one thread per rank)",
        ["engines", "owner ranks", "median generate s", "tokens/s", "vs first", "median sync s",
         "MB per engine"], rows,
        [f"{WORLD} gloo ranks, DP{WORLD} replicas of a qwen3 h{MODEL['hidden']} "
         f"L{MODEL['layers']} model; rollout batch {PROMPTS} prompts x n={N}, {MAX_NEW} new "
         f"tokens, temperature 1, per-response seeds; {repeats} timed batches and syncs per "
         "engine count after one warm-up. tokens/s: generated tokens / wall time of the "
         "generation batch on rank 0 (split, generate, gather)."])
    summary = {"engine_scaling": per_count, "engines_seconds": time.perf_counter() - t0}
    return BenchResult([table], summary)
