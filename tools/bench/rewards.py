"""`python -m tools.bench rewards [--quick]`: reward scoring (engine.rl.rewards), side by side
in one process (docs/rewards.md, docs/benchmarks.md "Rewards"):

1. math_verify: MATH_ITEMS items (fractions, decimals, sets, intervals, matrices, each with
   its own numbers so math-verify's parse cache does not help) scored serially in this
   process's main thread, then in the reward pool (reward.num_workers = the CPUs this process
   may use; its start-up timed apart). Goal: pool >= 1.8x serial on 2 cores. Scores equal.
2. overlap: a GRPO rollout on the hf step driver (rollout.partial_driver, a tiny qwen3 with
   reply lengths spread from 1 to MAX_NEW tokens, mean ~17: tools.bench.partial.eos_prone_model
   at EOS_SCALE; the replies that hit the cap all end in the same driver step, which is the
   tail overlapping cannot hide) with a reward of ~20 ms of CPU
   per item (tools.bench.reward_fns.busy_reward), STEPS steps scored after generation
   (`overlap_scoring = False`: each group scored when it completes, the rollout waiting) and
   overlapped (replies scored as they finish). Reported: time/reward_wait_s and
   time/rollout_s summed over the steps. Goal: overlapped wait <= 0.2x of after. Batches equal.
3. code: CODE_ITEMS items of stdin tests (2 tests each, half the solutions wrong) scored
   serially, then in the pool. Scores equal.
--quick: a smoke size (not a measurement).
"""
from __future__ import annotations

import tempfile
import time

import torch

from engine.config.schema import load_config
from engine.generation.hf.backend import HFRolloutEngine
from engine.rl.algo.presets import apply_algorithm_defaults, explicit_keys
from engine.rl.collect.partial import PartialCollector
from engine.rl.config import RLConfig
from engine.rl.rewards import load_reward_fn
from engine.rl.rewards.code import CodeReward
from engine.rl.rewards.pool import RewardPool
from tools.bench.common import BenchResult, Table, fmt, machine_info
from tools.bench.partial import eos_prone_model
from tools.bench.reward_fns import WORK_S, busy_reward

MATH_ITEMS, CODE_ITEMS, STEPS, PROMPTS, N = 2048, 256, 3, 8, 8
# reply lengths spread from 1 token to MAX_NEW (mean ~17; a few hit the cap together)
EOS_SCALE, MAX_NEW = 2.5, 64
QUICK = (128, 8, 1)   # math items, code items, overlap steps


def math_items(count: int) -> list[dict]:
    """`count` answer/response pairs, a few kinds of tricky agreement and disagreement."""
    kinds = [
        lambda i: (rf"\frac{{{i}}}{{{i + 1}}}",
                   rf"so $\boxed{{\dfrac{{{2 * i}}}{{{2 * i + 2}}}}}$"),
        lambda i: (f"{i}.5", rf"The answer is $\boxed{{\frac{{{2 * i + 1}}}{{2}}}}$."),
        lambda i: (rf"\{{{i},{i + 2}\}}", rf"$\boxed{{\{{{i + 2}, {i}\}}}}$"),
        lambda i: (f"({i},{i + 3}]", rf"$\boxed{{({i}, {i + 3})}}$"),
        lambda i: (rf"\begin{{pmatrix}}{i}&1\\0&{i}\end{{pmatrix}}",
                   rf"$\boxed{{\begin{{bmatrix}}{i}&1\\0&{i}\end{{bmatrix}}}}$"),
        lambda i: (rf"{i}\sqrt{{2}}", rf"$\boxed{{\sqrt{{{2 * i * i}}}}}$"),
        lambda i: (f"-{i}", f"First {i}, then the sign: the result is -{i}."),
        lambda i: (rf"{i}\%", rf"$\boxed{{{i}}}$ percent"),
    ]
    return [dict(zip(("answer", "response"), kinds[i % len(kinds)](i + 2)), prompt="")
            for i in range(count)]


def code_items(count: int) -> list[dict]:
    """`count` stdin items: a + b * k, half the solutions right."""
    out = []
    for i in range(count):
        k = i % 5 + 1
        body = f"print(a + b * {k})" if i % 2 == 0 else f"print(a * b + {k})"
        response = f"```python\na, b = map(int, input().split())\n{body}\n```"
        tests = [{"input": f"{i} {j}\n", "output": f"{i + j * k}\n"} for j in (1, 2)]
        out.append({"prompt": "", "response": response, "answer": "", "tests": tests})
    return out


def serial_vs_pool(fn, items: list[dict]) -> dict:
    """Seconds scoring `items` serially here and in a pool of default_num_workers()."""
    t0 = time.perf_counter()
    serial = [fn(**item) for item in items]
    serial_s = time.perf_counter() - t0
    pool = RewardPool(fn, timeout_s=120.0)
    try:
        t0 = time.perf_counter()
        report = pool.score(items)
        pool_s = time.perf_counter() - t0
    finally:
        pool.close()
    if report.scores != serial:
        raise RuntimeError("the pool's scores differ from serial scoring")
    return {"serial_s": serial_s, "pool_s": pool_s, "startup_s": pool.startup_s,
            "speedup": serial_s / pool_s, "workers": pool.num_workers,
            "mean": sum(serial) / len(serial)}


def overlap(steps: int) -> dict:
    """The GRPO rollout on the step driver, scored after generation vs overlapped."""
    model_dir = eos_prone_model(tempfile.mkdtemp(prefix="bench-rewards-") + "/qwen3",
                                eos_scale=EOS_SCALE)
    from transformers import AutoTokenizer   # after the model folder exists
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [{"prompt": f"what is {i % 10} plus {(3 * i + 1) % 10} ?", "answer": str(i % 7)}
            for i in range(64)]
    argv = [f"rollout.n={N}", f"train.prompts_per_step={PROMPTS}",
            f"rollout.max_new_tokens={MAX_NEW}", "data.shuffle=false", "train.seq_length=128",
            "rollout.partial=true", "rollout.partial_max_new_tokens=16",
            "rollout.partial_driver=true"]
    cfg = apply_algorithm_defaults(load_config(RLConfig, argv)[0], explicit_keys(argv))
    out = {}
    for mode, on in (("after", False), ("overlapped", True)):
        collector = PartialCollector(HFRolloutEngine(model_dir, dtype=torch.float32), rows,
                                     tokenizer, busy_reward, cfg)
        collector.overlap_scoring = on
        collector.scorer.pool   # started before the steps (timed apart from them)
        try:
            batches = [collector.collect(dump_step=s) for s in range(1, steps + 1)]
        finally:
            collector.scorer.close()
        out[mode] = {k: sum(b.metrics[f"time/{k}"] for b in batches)
                     for k in ("reward_wait_s", "reward_s", "rollout_s")}
        out[mode]["rewards"] = [b.rewards for b in batches]
        out[mode]["items"] = sum(len(b.rewards) for b in batches)
    if out["after"]["rewards"] != out["overlapped"]["rewards"]:
        raise RuntimeError("overlapped scoring changed the rewards")
    out["wait_ratio"] = out["overlapped"]["reward_wait_s"] / out["after"]["reward_wait_s"]
    return out


def run_rewards(quick: bool = False) -> BenchResult:
    math_n, code_n, steps = QUICK if quick else (MATH_ITEMS, CODE_ITEMS, STEPS)
    info = machine_info()
    m = serial_vs_pool(load_reward_fn("math_verify"), math_items(math_n))
    c = serial_vs_pool(CodeReward(timeout_s=30.0), code_items(code_n))
    o = overlap(steps)
    pools = Table(f"Serial vs the reward pool ({m['workers']} workers, "
                  f"{info.get('cpu', '?')})",
                  ["reward", "items", "serial s", "pool s", "speedup", "pool start-up s",
                   "mean score"],
                  [["math_verify", str(math_n), fmt(m["serial_s"], 2), fmt(m["pool_s"], 2),
                    fmt(m["speedup"], 2), fmt(m["startup_s"], 2), fmt(m["mean"], 3)],
                   ["code (2 stdin tests)", str(code_n), fmt(c["serial_s"], 2),
                    fmt(c["pool_s"], 2), fmt(c["speedup"], 2), fmt(c["startup_s"], 2),
                    fmt(c["mean"], 3)]],
                  ["goal: math_verify speedup >= 1.8 on 2 cores; scores equal serial scoring"])
    rollout = Table(f"GRPO rollout on the step driver, {PROMPTS} x {N} replies, "
                    f"{WORK_S * 1000:.0f} ms CPU reward, {steps} steps",
                    ["scoring", "reward_wait_s", "reward_s", "rollout_s", "items"],
                    [[mode, fmt(o[mode]["reward_wait_s"], 3), fmt(o[mode]["reward_s"], 3),
                      fmt(o[mode]["rollout_s"], 2), str(o[mode]["items"])]
                     for mode in ("after", "overlapped")],
                    [f"wait ratio overlapped / after: {o['wait_ratio']:.3f} (goal <= 0.2); "
                     "rewards equal"])
    summary = {"rewards_math_verify_speedup": m["speedup"],
               "rewards_math_verify_serial_s": m["serial_s"], "rewards_pool_startup_s":
               m["startup_s"], "rewards_code_speedup": c["speedup"],
               "rewards_overlap_wait_ratio": o["wait_ratio"],
               "rewards_after_wait_s": o["after"]["reward_wait_s"],
               "rewards_overlapped_wait_s": o["overlapped"]["reward_wait_s"],
               "rewards_workers": float(m["workers"]), "machine": info}
    return BenchResult([pools, rollout], summary)

