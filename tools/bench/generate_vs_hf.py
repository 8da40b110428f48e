"""`python -m tools.bench generate_vs_hf [--quick] [--threads T]`: the embedded hf backend
against transformers' own `model.generate` on the same model, batch and lengths, side by side
in one process (docs/benchmarks.md, "Generation against transformers' generate").

Workload: `tools.bench trl`'s (tools/bench/trl_workload.py): the Qwen3-shaped hidden-384,
4-layer fp32 model and a GRPO step's batch, 2 prompts x 8 replies of 32 new tokens at
temperature 1, on both of its prompt sets (shared: a 300-character system prompt and a short
question, ~350 tokens; distinct: a 110-character question, ~125 tokens). Paths, each timed in
turn after one warm-up call, REPEATS rounds:
- transformers: `model.generate(do_sample=True, temperature=1, top_k=0, top_p=1)` on the
  left-padded batch (what TRL's GRPOTrainer calls without vLLM);
- engine generate: HFRolloutEngine.generate (the RL loop's call: the eager loop on a CPU,
  each distinct prompt prefilled once: engine.generation.hf.group_prefill);
- engine, batch prefill: the same with the whole left-padded batch in one prefill forward
  (the eager loop's path for engines group_prefill does not serve, and its only path before
  2026-11-29): what sharing the prefill saves;
- engine, copied KV heads: engine generate with transformers' `sdpa` attention, which copies
  the grouped KV heads on every masked call (the eager loop's attention before
  engine.generation.hf.gqa_attention): what reading them in place saves;
- step driver: HFStepDriver (serve's continuous batching): the 16 requests added at once,
  stepped until every one finished.
No path ignores eos: replies stop at eos or at 32 tokens (the random model rarely samples eos,
so each call runs ~32 decode steps; the tokens column says how many came out).
Reported per path: the median wall seconds and process CPU seconds of a call (CPU seconds
move less on a shared host), the ratio to transformers' and the spread (min-max of the wall
seconds). Checked, else the run fails: greedy (temperature 0) tokens of the engine generate
and the step driver equal transformers' greedy tokens on every row. --quick: the quick model
(hidden 64, 2 layers), one round (a smoke run).
"""
from __future__ import annotations

import json
import tempfile
import time

from tools.bench.common import BenchResult, Table, fmt, median, torch_threads

PROMPTS, N, MAX_NEW, REPEATS = 2, 8, 32, 5
PATHS = ("transformers", "engine generate", "engine, batch prefill", "engine, copied KV heads",
         "step driver")


def _batch(tokenizer, rows_file: str) -> list[list[int]]:
    """The first PROMPTS prompts of the rows, rendered as the engine renders them, N times
    each (group-major, as a GRPO rollout batch)."""
    from engine.data.render import render_prompt

    rows = [json.loads(line) for line in open(rows_file)][:PROMPTS]
    return [render_prompt(r["prompt"], tokenizer) for r in rows for _ in range(N)]


def _padded(batch: list[list[int]], pad: int):
    import torch

    longest = max(map(len, batch))
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in batch])
    return ids, mask


def hf_generate(model, batch, pad: int, temperature: float) -> list[list[int]]:
    """transformers' generate on the left-padded batch: each row's new tokens up to its eos."""
    import torch

    ids, mask = _padded(batch, pad)
    sample = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) \
        if temperature > 0 else dict(do_sample=False)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW,
                             pad_token_id=pad, **sample)[:, ids.shape[1]:]
    eos = set(model.generation_config.eos_token_id if isinstance(
        model.generation_config.eos_token_id, list) else [model.generation_config.eos_token_id])
    rows = []
    for row in out.tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:cut])
    return rows


def engine_generate(engine, batch, temperature: float, seed: int = 0) -> list[list[int]]:
    from engine.generation.base import SamplingParams

    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature, seed=seed)
    return [g.response_ids for g in engine.generate(batch, params)]


def batch_prefill(engine, batch) -> list[list[int]]:
    """engine_generate at temperature 1 with the batch's one left-padded prefill forward
    (group_prefill's fallback, forced for this call)."""
    from engine.generation.hf import backend

    problem = backend.shared_prefill_problem
    backend.shared_prefill_problem = lambda _: "measured: the batch prefill"
    try:
        return engine_generate(engine, batch, 1.0)
    finally:
        backend.shared_prefill_problem = problem


def copied_heads(engine, batch) -> list[list[int]]:
    """engine_generate at temperature 1 on transformers' `sdpa` attention (restored after)."""
    kept = engine.model.config._attn_implementation
    engine.model.set_attn_implementation("sdpa")
    try:
        return engine_generate(engine, batch, 1.0)
    finally:
        engine.model.set_attn_implementation(kept)


def driver_generate(engine, batch, temperature: float, seed: int = 0) -> list[list[int]]:
    """HFStepDriver: every row added at once (its own seed), stepped until all finished."""
    from engine.generation.base import SamplingParams
    from engine.generation.hf.stepper import HFStepDriver
    from engine.generation.sampling import row_seeds

    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature, seed=seed)
    seeds = row_seeds(params, len(batch))
    driver = HFStepDriver(engine)
    for i, prompt in enumerate(batch):
        driver.add(str(i), prompt, SamplingParams(max_new_tokens=MAX_NEW,
                                                  temperature=temperature, seeds=[seeds[i]]))
    done: dict[int, list[int]] = {}
    while driver.busy:
        for out in driver.step():
            if out.done is not None:
                done[int(out.key)] = out.done.response_ids
    return [done[i] for i in range(len(batch))]


def _timed(fn) -> tuple[float, float, int]:
    """(wall s, process CPU s, tokens) of one call of `fn`."""
    w, c = time.perf_counter(), time.process_time()
    rows = fn()
    return time.perf_counter() - w, time.process_time() - c, sum(map(len, rows))


def compare(model_dir: str, rows_file: str, repeats: int) -> dict:
    """One prompt set's side by side (module docstring): {path: {wall, cpu, tokens}} with
    every round's numbers, and the greedy check."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.generation.hf.backend import HFRolloutEngine

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = _batch(tokenizer, rows_file)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = HFRolloutEngine(model_dir, device="cpu" if not torch.cuda.is_available() else None,
                             dtype=torch.float32)
    model.to(engine.device)
    pad = engine.pad_token_id
    greedy = hf_generate(model, batch, pad, 0.0)
    for name, got in (("engine generate", engine_generate(engine, batch, 0.0)),
                      ("step driver", driver_generate(engine, batch, 0.0))):
        if got != greedy:
            bad = next(i for i, (a, b) in enumerate(zip(got, greedy)) if a != b)
            raise RuntimeError(f"{name}: greedy row {bad} differs from transformers' generate "
                               f"({got[bad][:8]}... vs {greedy[bad][:8]}...)")
    calls = {"transformers": lambda: hf_generate(model, batch, pad, 1.0),
             "engine generate": lambda: engine_generate(engine, batch, 1.0),
             "engine, batch prefill": lambda: batch_prefill(engine, batch),
             "engine, copied KV heads": lambda: copied_heads(engine, batch),
             "step driver": lambda: driver_generate(engine, batch, 1.0)}
    for fn in calls.values():   # warm-up
        fn()
    runs = {p: [] for p in PATHS}
    for _ in range(repeats):
        for path in PATHS:
            runs[path].append(_timed(calls[path]))
    return {"prompt_tokens": sum(map(len, batch)), "runs": runs, "greedy_equal": True}


def summarize(name: str, result: dict) -> tuple[list[list[str]], dict]:
    """Table rows and summary keys of one prompt set's `compare` result."""
    runs = result["runs"]
    base_wall = median([r[0] for r in runs["transformers"]])
    base_cpu = median([r[1] for r in runs["transformers"]])
    rows, out = [], {}
    for path in PATHS:
        wall = [r[0] for r in runs[path]]
        cpu = [r[1] for r in runs[path]]
        key = path.replace(",", "").replace(" ", "_").lower()
        out[f"generate_{name}_{key}_s"] = median(wall)
        out[f"generate_{name}_{key}_cpu_s"] = median(cpu)
        rows.append([name, path, fmt(median(wall)), f"{min(wall):.3f}-{max(wall):.3f}",
                     fmt(median(cpu)), fmt(base_wall / median(wall), 2),
                     fmt(base_cpu / median(cpu), 2), fmt(median([r[2] for r in runs[path]]), 0)])
    out[f"generate_{name}_speedup"] = base_wall / out[f"generate_{name}_engine_generate_s"]
    out[f"generate_{name}_cpu_speedup"] = base_cpu / out[f"generate_{name}_engine_generate_cpu_s"]
    return rows, out


def run_generate_vs_hf(quick: bool, threads: int = 2) -> BenchResult:
    """Both prompt sets side by side (module docstring)."""
    import os

    from tools.bench.trl_workload import workdir_files

    repeats = 1 if quick else REPEATS
    rows, summary = [], {"generate_threads": threads, "generate_repeats": repeats}
    with tempfile.TemporaryDirectory(prefix="bench_generate_") as tmp, torch_threads(threads):
        files = workdir_files(tmp, quick)
        for name in ("grpo_shared", "grpo_distinct"):
            result = compare(files["model"], files[name], repeats)
            r, s = summarize(name.removeprefix("grpo_"), result)
            rows += r
            summary.update(s)
            summary[f"generate_{name.removeprefix('grpo_')}_prompt_tokens"] = \
                result["prompt_tokens"]
    summary["load_avg_1m"] = round(os.getloadavg()[0], 2)
    notes = [f"{PROMPTS} prompts x {N} replies of <= {MAX_NEW} tokens, temperature 1; torch "
             f"threads {threads}; medians of {repeats} round(s) after one warm-up call per "
             "path; speedup = transformers' seconds / the path's (> 1: faster than "
             "transformers); greedy tokens of both engine paths equal transformers' on every "
             f"row (checked); host load average (1 min) at the end {summary['load_avg_1m']}"]
    head = ["prompts", "path", "wall s", "wall min-max", "CPU s", "speedup (wall)",
            "speedup (CPU)", "tokens"]
    return BenchResult([Table("Generation: the hf backend against transformers' generate",
                              head, rows, notes)], summary)
