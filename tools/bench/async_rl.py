"""Asynchronous RL: the same GRPO job synchronous (s = 0) and asynchronous (s = 1), side by side.

`python -m tools.bench async [--quick]` runs two launches of `python -m torch.distributed.run
--nproc_per_node 2 -m engine.rl` with rollout.placement=disaggregated rollout.num_ranks=1 (one
training rank, one rollout rank, OMP_NUM_THREADS=1: one core each on a 2-core host), identical
but for rollout.max_staleness (0, then 1), and reads each run's metrics.jsonl. Model: a tiny
local Qwen3 (tools.tiny_models, h64 L4, vocab 200; nothing downloaded), prompts generated here.

On a CPU host generation is HF transformers sampling on one core. Its duration is made
comparable to the training step by the response length: MAX_NEW_TOKENS was chosen by measuring
time/generate_s ~ time/train_s on a 2-core VM (2026-11-23); the table prints both (s = 0 run) so
the reader sees how comparable they were on the host at hand.

All times are seconds (wall clock, per RL step); fractions are in [0, 1]. Step 0 is warm-up and
is left out of every mean. Per run over steps 1..N-1:
- step time: mean time/step_s (trainer: receive batch + train + send weights);
- trainer idle: sum time/rollout_wait_s / sum time/step_s (waiting for the batch);
- weight sync share: sum time/weight_sync_s / sum time/step_s (the trainer's export and send of
  a version, in the steps that send one; the engine owner receives it in a background thread,
  engine.rl.disaggregated.inbox, so the send does not wait for the batch in progress);
- rollout idle: sum rollout/idle_s / sum (time/generate_s + rollout/idle_s) (the rollout rank
  waiting for the version a batch needs, and loading it).
Headline: async_step_time_ratio = step time (s = 1) / step time (s = 0); goal <= 0.6 (perfect
overlap of equal generation and training gives 0.5).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.bench.common import REPO_ROOT, BenchResult, Table, fmt, free_port, subprocess_env

MODEL = dict(vocab_size=200, hidden=64, layers=4, heads=8, kv_heads=2, intermediate=128)
PROMPTS_PER_STEP, N, MAX_NEW_TOKENS, SEQ_LENGTH = 8, 4, 192, 256
STEPS, STEPS_QUICK = 8, 4
NUM_PROMPTS = 64
WARMUP = 1  # steps left out of the means


def digit_reward(prompt: str, response: str, answer: str, **fields) -> float:
    """Share of digits in the response (a reward with spread, so GRPO updates are non-zero)."""
    return sum(ch.isdigit() for ch in response) / max(1, len(response))


def _write_prompts(path: Path) -> None:
    path.write_text("".join(json.dumps({"prompt": f"what is {i % 10} plus {(3 * i + 1) % 10} ?",
                                        "answer": 0}) + "\n" for i in range(NUM_PROMPTS)))


def _launch(model: str, prompts: Path, log_dir: Path, s: int, steps: int,
            timeout_s: int) -> tuple[list[dict], float]:
    """One disaggregated run with rollout.max_staleness=s; (metrics per step, wall seconds)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", "engine.rl",
           f"model.hf_path={model}", f"data.train_files=[{prompts}]", f"rollout.n={N}",
           f"rollout.max_new_tokens={MAX_NEW_TOKENS}", f"train.prompts_per_step={PROMPTS_PER_STEP}",
           f"train.max_steps={steps}", f"train.seq_length={SEQ_LENGTH}", "kl.beta=0",
           "reward.fn=tools.bench.async_rl:digit_reward", "logging.progress_bar=false",
           "rollout.placement=disaggregated", "rollout.num_ranks=1",
           f"rollout.max_staleness={s}", f"logging.dir={log_dir}"]
    env = subprocess_env(threads=1)  # the repo root on PYTHONPATH: the reward fn
    start = time.perf_counter()
    _run(cmd, env, timeout_s, f"engine.rl (rollout.max_staleness={s})")
    wall = time.perf_counter() - start
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()], wall


def _run(cmd: list[str], env: dict, timeout_s: int, what: str) -> None:
    """common.run_launch, but a failure names the ranks' error lines (torchrun's own
    summary, which hides them, is 25 lines long)."""
    proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:  # torchrun's workers may sit in sessions of their own
        import psutil

        children = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGKILL)
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        proc.communicate()
        raise RuntimeError(f"{what} timed out after {timeout_s} s") from None
    if proc.returncode != 0:
        errors = [ln for ln in out.splitlines() if ("Error" in ln or "error" in ln)
                  and not any(x in ln for x in ("Warning", "ChildFailedError", "error_file"))]
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): " + " | ".join(errors[-8:]))


def run_stats(metrics: list[dict], warmup: int = WARMUP) -> dict:
    """Means and idle fractions of one run over steps warmup..end (module docstring)."""
    timed = metrics[warmup:]
    if not timed:
        raise ValueError(f"{len(metrics)} steps: nothing left after {warmup} warm-up step(s)")
    total = lambda key: sum(m.get(key, 0.0) for m in timed)  # no weight send: key absent
    step, gen, idle = total("time/step_s"), total("time/generate_s"), total("rollout/idle_s")
    return {"step_s": step / len(timed), "train_s": total("time/train_s") / len(timed),
            "generate_s": gen / len(timed),
            "rollout_wait_s": total("time/rollout_wait_s") / len(timed),
            "trainer_idle_fraction": total("time/rollout_wait_s") / step,
            "weight_sync_fraction": total("time/weight_sync_s") / step,
            "rollout_idle_fraction": idle / (gen + idle),
            "response_tokens": total("response/length_mean") / len(timed),
            "staleness": [m["rollout/staleness"] for m in metrics], "steps_timed": len(timed)}


def check_runs(s0: list[dict], s1: list[dict]) -> None:
    """The two runs are the comparison they claim to be: s = 0 trains on fresh batches, s = 1
    lags one version from step 1 on, and step 0 (same batch, same weights) agrees."""
    want0, want1 = [0.0] * len(s0), [0.0] + [1.0] * (len(s1) - 1)
    got0, got1 = [m["rollout/staleness"] for m in s0], [m["rollout/staleness"] for m in s1]
    if got0 != want0 or got1 != want1:
        raise RuntimeError(f"rollout/staleness s=0 {got0}, s=1 {got1}: expected {want0}, {want1}")
    if s0[0]["reward/mean"] != s1[0]["reward/mean"]:
        raise RuntimeError(f"step 0 reward/mean differs: s=0 {s0[0]['reward/mean']}, "
                           f"s=1 {s1[0]['reward/mean']} (the runs are not the same job)")


def async_summary(s0: list[dict], s1: list[dict]) -> dict:
    """Flat summary keys of the two runs (seconds and fractions; see the module docstring)."""
    a, b = run_stats(s0), run_stats(s1)
    out = {"async_step_time_ratio": b["step_s"] / a["step_s"],
           "async_ideal_ratio": max(a["generate_s"], a["train_s"]) / a["step_s"],
           "async_generate_over_train": a["generate_s"] / a["train_s"]}
    for tag, st in (("s0", a), ("s1", b)):
        for key in ("step_s", "train_s", "generate_s", "rollout_wait_s", "trainer_idle_fraction",
                    "weight_sync_fraction", "rollout_idle_fraction"):
            out[f"async_{key}_{tag}"] = st[key]
    out["async_staleness_s1"] = b["staleness"]
    return out


def _rows(s0: list[dict], s1: list[dict]) -> list[list[str]]:
    rows, base = [], run_stats(s0)["step_s"]
    for s, metrics in ((0, s0), (1, s1)):
        st = run_stats(metrics)
        rows.append([str(s), str(st["steps_timed"]), fmt(st["step_s"]), fmt(st["step_s"] / base, 2),
                     fmt(st["generate_s"]), fmt(st["train_s"]), fmt(st["rollout_wait_s"]),
                     fmt(st["trainer_idle_fraction"], 2), fmt(st["weight_sync_fraction"], 2),
                     fmt(st["rollout_idle_fraction"], 2), fmt(st["response_tokens"], 1),
                     ",".join(str(int(x)) for x in st["staleness"])])
    return rows


def run_async(quick: bool, timeout_s: int = 900) -> BenchResult:
    """Both launches (s = 0 first); tables and summary."""
    from tools.tiny_models import build_tiny_model

    steps = STEPS_QUICK if quick else STEPS
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        root = Path(tmp)
        model = build_tiny_model(str(root / "model"), "qwen3", seed=0, **MODEL)
        _write_prompts(root / "prompts.jsonl")
        runs = {s: _launch(model, root / "prompts.jsonl", root / f"s{s}", s, steps, timeout_s)
                for s in (0, 1)}
    s0, s1 = runs[0][0], runs[1][0]
    check_runs(s0, s1)
    summary = async_summary(s0, s1)
    summary.update(async_steps=steps, async_launch_s={f"s{s}": runs[s][1] for s in runs},
                   async_seconds=time.perf_counter() - t0)
    table = Table(
        "Asynchronous RL: s = 0 vs s = 1 (1 training rank + 1 rollout rank, CPU)",
        ["s", "steps timed", "step s", "vs s=0", "generate s", "train s", "trainer wait s",
         "trainer idle", "weight sync share", "rollout idle", "response tokens",
         "staleness by step"],
        _rows(s0, s1),
        [f"GRPO, tiny qwen3 h{MODEL['hidden']} L{MODEL['layers']} vocab {MODEL['vocab_size']}; "
         f"{PROMPTS_PER_STEP} prompts x n={N} per step, up to {MAX_NEW_TOKENS} new tokens, "
         f"kl.beta=0; {steps} steps per run, means over steps {WARMUP}..{steps - 1} (step 0 is "
         "warm-up); seconds per step. trainer idle = rollout_wait / step; weight sync share = "
         "weight_sync / step (export and send of a version); "
         "rollout idle = idle / (generate + idle); response tokens: mean length (the same work "
         "in both runs: optim.lr is the RL default 1e-6, so the policies barely move).",
         "On a CPU host generation is HF transformers sampling on one core; it is made "
         f"comparable to training by the response length (max_new_tokens={MAX_NEW_TOKENS}, "
         "fixed, measured on a 2-core VM): in the s = 0 run here generate "
         f"{fmt(summary['async_generate_s_s0'])} s vs train {fmt(summary['async_train_s_s0'])} s "
         f"per step (ratio {fmt(summary['async_generate_over_train'], 2)}). Perfect overlap "
         "would give max(generate, train) / s=0 step = "
         f"{fmt(summary['async_ideal_ratio'], 2)}. Goal: s=1 / s=0 step <= 0.6."])
    return BenchResult([table], summary)
