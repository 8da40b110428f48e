"""`python -m tools.bench agent_steps [--quick]`: the agent endpoint's RL rollout (env.agent,
engine.rl.agent.rollout) on the gather rule against continuous batching through the step
driver, side by side in one run on one vLLM engine built as an RL run builds it (rollout.vllm's
defaults: eager and every CPU bound to the worker on a CPU host; docs/benchmarks.md, "Agent
episodes").

Workload: PROMPTS prompts x N samples = one generation batch of episodes per RL step; each
episode is `tool_agent` (the real `openai` client): 3 or 4 chat calls (by its row's seed),
and after each reply a "tool" that sleeps 0-TOOL_MS ms (seeded random per row and turn), so
the episodes drift out of phase. Replies are sampled at temperature 1 up to MAX_NEW tokens
from a tiny qwen3 whose end-of-sequence embedding is scaled (tools.bench.partial
.eos_prone_model: reply lengths spread from 1 token to the limit).

Paths, on the same engine, prompts and seeds, one RL step each in turn (gather, then steps):
- gather: AgentRollout(gather_only=True): the gather rule of engine.api.batcher (gather_s
  0.2 s, max_wait_s 2 s: the agent endpoint's defaults), one vLLM generate call per batch
  through the pool; every wave waits for its longest reply;
- steps: AgentRollout's step path (VLLMStepDriver under engine.api.stepping): every call
  joins the running engine step and is answered at its own end; nothing gathers.
Reported per path: the RL rollout time per step (AgentRollout.generation_batch, the
collector's call), its median over STEPS steps, the engine's busy seconds, engine requests or
calls, and sampled tokens per second of rollout time. Checked: both paths give every episode
the same token ids (per-request seeds), else the run fails. --quick: 4 prompts, 2 steps (a
smoke run, not a measurement).
"""
from __future__ import annotations

import os
import random
import tempfile
import time

import torch

PROMPTS, N, MAX_NEW, TOOL_MS, STEPS = 8, 2, 128, 200, 3
QUICK = (4, 2)   # prompts, steps
HIDDEN, HEADS = 512, 8   # head_dim 64 (vLLM's CPU attention needs >= 32)
MAX_CONTEXT = 512   # the tiny model's max_position_embeddings


def tool_agent(base_url: str, row: dict) -> dict:
    """One episode (module docstring): 3 or 4 calls, each followed by a 0-TOOL_MS ms tool."""
    from openai import OpenAI

    rng = random.Random(row["seed"])
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    messages = [{"role": "user", "content": row["prompt"]}]
    turns = 3 + (rng.random() < 0.5)
    text = ""
    for turn in range(turns):
        reply = client.chat.completions.create(model="policy", messages=messages)
        text = reply.choices[0].message.content or ""
        time.sleep(rng.uniform(0.0, TOOL_MS / 1000))
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": f"again {turn}"}]
    return {"reward": float(len(text) % 3), "metrics": {"turns": float(turns)}}


def _config(path: str, prompts: int):
    from engine.config.schema import load_config
    from engine.rl.algo.presets import apply_algorithm_defaults, explicit_keys
    from engine.rl.config import RLConfig

    argv = [f"model.hf_path={path}", "env.agent=tools.bench.agent_steps:tool_agent",
            "env.max_turns=4", f"rollout.n={N}", f"train.prompts_per_step={prompts}",
            f"rollout.max_new_tokens={MAX_NEW}", f"train.seq_length={MAX_CONTEXT - 1}",
            "rollout.backend=vllm", "rollout.temperature=1.0", "data.shuffle=false"]
    cfg, _ = load_config(RLConfig, argv)
    return apply_algorithm_defaults(cfg, explicit_keys(argv))


def _step(rollout, rows, seeds, gen_batch: int) -> dict:
    """One RL step's generation batch on `rollout`: seconds, and what it produced."""
    t0 = time.perf_counter()
    part = rollout.generation_batch(rows, list(range(len(rows))), seeds, gen_batch)
    seconds = time.perf_counter() - t0
    outcomes = part["outcomes"]
    errors = [o.error for o in outcomes if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} episodes failed: {errors[0]}")
    return {"s": seconds, "engine_s": part["gen_s"], "calls": part["stats"].calls,
            "tokens": float(part["lengths"].sum()),
            "turns": sum(o.calls for o in outcomes),
            "ids": [[t.token_ids for t in o.trajectories] for o in outcomes],
            "logprobs": [[t.rollout_logprobs for t in o.trajectories] for o in outcomes]}


def run_agent_steps(quick: bool):
    from engine.generation.pool import RolloutPool
    from engine.rl.agent.rollout import AgentRollout
    from engine.generation.work_split import batch_seeds
    from engine.generation.eos import folder_tokenizer
    from engine.generation.vllm.backend import VLLMRolloutEngine
    from tools.bench.common import BenchResult, Table, fmt, median
    from tools.bench.partial import eos_prone_model

    prompts, steps = QUICK if quick else (PROMPTS, STEPS)
    path = eos_prone_model(tempfile.mkdtemp(prefix="bench_agent_steps_") + "/qwen3",
                           hidden=HIDDEN, heads=HEADS, head_dim=HIDDEN // HEADS)
    cfg = _config(path, prompts)
    cfg.rollout.vllm.max_model_len = MAX_CONTEXT
    t0 = time.perf_counter()   # the engine as an RL run builds it (eager on a CPU host)
    engine = VLLMRolloutEngine.from_config(path, cfg.rollout, torch.float32, 0)
    start_s = time.perf_counter() - t0
    tokenizer = folder_tokenizer(path)
    pool = RolloutPool.local(engine, cfg.rollout)
    paths = {"gather": AgentRollout(pool, tokenizer, cfg, gather_only=True),
             "steps": AgentRollout(pool, tokenizer, cfg)}
    runs: dict[str, list[dict]] = {k: [] for k in paths}
    worst_lp = 0.0
    try:
        for k in range(steps + 1):     # step 0: warm-up of both paths, not counted
            rows = [{"prompt": f"what is {i} plus {k} ?", "seed": 1000 * k + i}
                    for i in range(prompts) for _ in range(N)]
            seeds = batch_seeds(cfg.seed, k, prompts, N)
            got = {name: _step(r, rows, seeds, k) for name, r in paths.items()}
            if got["gather"]["ids"] != got["steps"]["ids"]:
                raise RuntimeError(f"step {k}: the episodes' token ids differ between paths")
            for a, b in zip(got["gather"]["logprobs"], got["steps"]["logprobs"]):
                for x, y in zip(a, b):
                    worst_lp = max([worst_lp] + [abs(u - v) for u, v in zip(x, y)])
            if k:
                for name in paths:
                    runs[name].append(got[name])
    finally:
        for r in paths.values():
            r.close()
        engine.shutdown()
    out, rows_t = {}, []
    for name, rs in runs.items():
        s, eng = median([r["s"] for r in rs]), median([r["engine_s"] for r in rs])
        tok_s = sum(r["tokens"] for r in rs) / sum(r["s"] for r in rs)
        out.update({f"rollout_step_{name}_s": s, f"engine_busy_{name}_s": eng,
                    f"tokens_per_s_{name}": tok_s})
        rows_t.append([name, fmt(s), fmt(eng), fmt(median([r["calls"] for r in rs]), 1),
                       fmt(median([r["turns"] for r in rs]), 1),
                       fmt(median([r["tokens"] for r in rs]), 1), fmt(tok_s, 1)])
    out.update(step_time_ratio=out["rollout_step_steps_s"] / out["rollout_step_gather_s"],
               episodes=prompts * N, steps=steps, max_logprob_diff=worst_lp,
               engine_start_s=start_s, load_avg_1m=round(os.getloadavg()[0], 2))
    notes = [f"medians of {steps} RL step(s) per path after one warm-up step each; "
             f"{prompts * N} episodes per step, 3-4 calls each, tools 0-{TOOL_MS} ms, replies "
             f"<= {MAX_NEW} tokens; the episodes' token ids are the same on both paths "
             f"(checked), log-probs within {worst_lp:.1e}; engine start {start_s:.1f} s, not "
             f"counted; host load average (1 min) at the end: {out['load_avg_1m']}"]
    table = Table("agent episodes: RL rollout time per step, gather rule vs step driver",
                  ["path", "rollout s / step", "engine busy s", "engine calls / requests",
                   "turns", "sampled tokens", "tokens / s"], rows_t, notes)
    return BenchResult([table], out)
