"""`python -m tools.bench trl [--quick] [--steps N] [--rounds R] [--workloads W,..] [--threads T]`:
TRL 1.16's own trainers and the engine on the same model, rows and sizes, one after the other in
one call, one process each (docs/benchmarks.md, "Against TRL's trainers").

Workloads (tools/bench/trl_workload.py: a Qwen3-shaped hidden-384, 4-layer fp32 model with a
character-level chat tokenizer, built locally):
  grpo_shared    GRPOTrainer: 2 prompts x 8 replies of <= 32 tokens per step, temperature 1,
                 KL beta 0.01 with a reference model, lr 1e-5; every prompt a 300-character
                 system prompt and a short question;
  grpo_distinct  the same on prompts that share nothing (a 110-character question each);
  sft            SFTTrainer: 8 prompt-completion chat rows per step (the completion trained);
  dpo            DPOTrainer: 8 preference pairs per step, beta 0.1, a reference model.
Rows per workload, each a fresh process with OMP_NUM_THREADS=T (default 2), in this order:
TRL's trainer (tools/bench/trl_side.py: TRL's defaults but for the workload's sizes, fp32,
`use_cpu` without CUDA; its stages timed by wrapping its methods); on a CUDA host with vLLM's
CUDA build also TRL with `use_vllm=True, vllm_mode="colocate"` (GRPO); the engine with its
DEFAULTS (tools/bench/trl_engine.py: only the workload's sizes set); and for grpo_shared the
engine with train.prefix_sharing=true and =false (not in --quick); on a CUDA host with vLLM's
CUDA build also the engine with rollout.backend=vllm (GRPO). A run that fails is a row
"failed: ERROR" (summary "errors", exit status 1) and the other rows still run.
--rounds R (default 1) runs a workload's rows R times, interleaved (every row once, then
again), so that a slow spell of a shared host falls on every row alike instead of on one.

Reported per row: seconds per optimizer step and per stage (GRPO: generation, log-prob
stage, update; DPO: the reference's pass and the update) as the median over steps 2..N (the
first step, warm-up, is left out; with rounds, over every round's steps 2..N pooled) with the
step's min-max over those steps, and the speedup against TRL's row (TRL seconds / the row's
seconds, > 1: faster than TRL) of the step and of each stage; with rounds also each round's
step speedup (TRL's median in that round / the row's: summary ..._round_speedups, the table's
min-max of them); the host's 1-minute load average before and after each run; the engine's
run-header lines on what its defaults chose. Summary keys: trl_<workload>_<row>_step_s,
..._speedup (rows: trl, trl_vllm, engine, engine_prefix_on, engine_prefix_off,
engine_vllm) and the goals (docs/benchmarks.md; trl_grpo_shared_speedup >= 2.5, ..._prefix_off
and grpo_distinct >= 1.1, sft and dpo >= 1.0). --quick: the quick model (hidden 64, 2
layers), 2 steps, TRL and engine-defaults rows only (a smoke run of both sides, not a
measurement).
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass, field

from tools.bench.common import (REPO_ROOT, BenchResult, Table, fmt, median, run_launch,
                                subprocess_env)
from tools.bench.trl_engine import engine_command, engine_records, header_lines, read_metrics
from tools.bench.trl_workload import WORKLOADS, workdir_files

STEPS, QUICK_STEPS = 5, 2
TIMEOUT_S, QUICK_TIMEOUT_S = 1800, 600
TRAINER = {"grpo_shared": "GRPOTrainer", "grpo_distinct": "GRPOTrainer", "sft": "SFTTrainer",
           "dpo": "DPOTrainer"}
STAGES = {"grpo": ("generation_s", "logprob_s", "update_s"), "dpo": ("logprob_s", "update_s"),
          "sft": ()}


@dataclass(frozen=True)
class Row:
    """One run: `side` trl | engine, `key` its summary name, `args` (TRL: trl_side flags;
    engine: hydra overrides)."""
    workload: str
    key: str
    label: str
    side: str
    args: tuple[str, ...] = ()


@dataclass
class RunResult:
    """One row's runs: `records` the first run's per-step records (step 1 the warm-up),
    `rounds` every run's (records is rounds[0]; empty: `records` alone), `load` the host's
    1-minute load average at the first run's start and the last run's end."""
    records: list[dict] = field(default_factory=list)
    load: tuple[float, float] = (0.0, 0.0)
    wall_s: float = 0.0
    header: list[str] = field(default_factory=list)
    rounds: list[list[dict]] = field(default_factory=list)

    def runs(self) -> list[list[dict]]:
        return self.rounds or [self.records]

    def add_round(self, other: "RunResult") -> None:
        """Append `other` (the same row's next run) as a round."""
        self.rounds = self.runs() + [other.records]
        self.load = (self.load[0], other.load[1])
        self.wall_s += other.wall_s


def stages_of(workload: str) -> tuple[str, ...]:
    return STAGES[workload.split("_")[0]]


def vllm_rows_possible() -> bool:
    """TRL's and the engine's vLLM rows need CUDA and vLLM's CUDA build."""
    import torch

    from tools.bench.gpu.plan import vllm_is_cuda

    return torch.cuda.is_available() and vllm_is_cuda()


def plan_rows(workloads: list[str], quick: bool, with_vllm: bool) -> list[Row]:
    """The rows of the call in run order (module docstring)."""
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad:
        raise ValueError(f"--workloads: {bad} unknown; valid: {', '.join(WORKLOADS)}")
    rows = []
    for w in workloads:
        grpo = w.startswith("grpo")
        rows.append(Row(w, "trl", f"TRL {TRAINER[w]}", "trl"))
        if grpo and with_vllm:
            rows.append(Row(w, "trl_vllm", f"TRL {TRAINER[w]} + vLLM colocate", "trl",
                            ("--vllm",)))
        rows.append(Row(w, "engine", "engine, defaults", "engine"))
        if w == "grpo_shared" and not quick:
            for on in ("true", "false"):
                rows.append(Row(w, f"engine_prefix_{'on' if on == 'true' else 'off'}",
                                f"engine, train.prefix_sharing={on}", "engine",
                                (f"train.prefix_sharing={on}",)))
        if grpo and with_vllm:
            rows.append(Row(w, "engine_vllm", "engine, rollout.backend=vllm", "engine",
                            ("rollout.backend=vllm",)))
    return rows


def row_command(row: Row, files: dict[str, str], steps: int, out: str) -> list[str]:
    """argv of `row`'s run; `out` is its result file (TRL) or log folder (engine)."""
    if row.side == "trl":
        return [sys.executable, "-m", "tools.bench.trl_side", row.workload, "--model",
                files["model"], "--data", files[row.workload], "--steps", str(steps),
                "--out", out, *row.args]
    return engine_command(row.workload, files["model"], files[row.workload], steps, out,
                          row.args)


def run_row(row: Row, files: dict[str, str], steps: int, threads: int, work: str,
            timeout_s: int, round_: int = 0) -> RunResult:
    """`row`'s run number `round_` in a process of its own (OMP_NUM_THREADS=threads), with
    an output file or log folder of its own: its step records."""
    import json

    out = os.path.join(work, f"{row.workload}_{row.key}_r{round_}"
                       + (".json" if row.side == "trl" else ""))
    cmd = row_command(row, files, steps, out)
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    stdout, stderr = run_launch(cmd, subprocess_env(threads), timeout_s,
                                f"{row.label} ({row.workload})", cwd=str(REPO_ROOT))
    result = RunResult(load=(load0, os.getloadavg()[0]), wall_s=time.perf_counter() - t0)
    if row.side == "trl":
        result.records = json.loads(open(out).read())["steps"]
    else:
        result.records = engine_records(row.workload, read_metrics(out))
        result.header = header_lines(stdout + "\n" + stderr)
    if len(result.records) != steps:
        raise RuntimeError(f"{row.label} ({row.workload}): {len(result.records)} step "
                           f"records, {steps} expected")
    return result


def spread(records: list[dict], key: str) -> tuple[float, float, float]:
    """(median, min, max) of `key` over steps 2..N (the first step, warm-up, left out)."""
    return _stats([r[key] for r in records[1:]], len(records))


def pooled(result: RunResult, key: str) -> tuple[float, float, float]:
    """spread() over every round's steps 2..N together."""
    runs = result.runs()
    return _stats([r[key] for run in runs for r in run[1:]], sum(map(len, runs)))


def _stats(values: list[float], steps: int) -> tuple[float, float, float]:
    if not values:
        raise ValueError(f"{steps} step(s): nothing left after the warm-up step")
    return median(values), min(values), max(values)


def round_speedups(base: RunResult, result: RunResult) -> list[float]:
    """Per round k: TRL's median step in round k / the row's (rounds both ran)."""
    return [spread(b, "step_s")[0] / spread(r, "step_s")[0]
            for b, r in zip(base.runs(), result.runs())]


def workload_table(workload: str, rows: list[Row], results: dict[str, RunResult | str],
                   threads: int) -> tuple[Table, dict]:
    """The side-by-side table of one workload and its summary keys; a row whose run failed
    (its error text in `results`) shows the error, and without TRL's row no speedup."""
    stages = stages_of(workload)
    base = results["trl"] if isinstance(results.get("trl"), RunResult) else None
    base_step = pooled(base, "step_s")[0] if base else None
    base_stage = {s: pooled(base, s)[0] for s in stages} if base else {}
    rounds = max((len(r.runs()) for r in results.values() if isinstance(r, RunResult)),
                 default=1)
    table_rows, summary = [], {}
    for row in rows:
        res = results[row.key]
        if not isinstance(res, RunResult):
            table_rows.append([row.label, f"failed: {res}"]
                              + [""] * (3 + len(stages) + (rounds > 1)))
            continue
        step, lo, hi = pooled(res, "step_s")
        speed = base_step / step if base_step else None
        prefix = f"trl_{workload}_{row.key}"
        summary.update({f"{prefix}_step_s": step, f"{prefix}_step_range_s": [lo, hi],
                        f"{prefix}_speedup": speed})
        cells = [row.label, fmt(step, 2), f"{lo:.2f}-{hi:.2f}",
                 "n/a" if speed is None else f"x{speed:.2f}"]
        if rounds > 1:
            per = round_speedups(base, res) if base else []
            summary[f"{prefix}_round_speedups"] = per
            cells.append(f"x{min(per):.2f}-{max(per):.2f}" if per else "n/a")
        for s in stages:
            value = pooled(res, s)[0]
            summary[f"{prefix}_{s}"] = value
            cells.append(f"{value:.2f} (x{base_stage[s] / value:.2f})"
                         if value > 0 and s in base_stage else fmt(value, 2))
        cells.append(f"{res.load[0]:.1f}-{res.load[1]:.1f}")
        table_rows.append(cells)
    # the goals' names: trl_<workload>_speedup (the defaults), trl_<workload>_prefix_off_speedup
    for key, goal in (("engine", "speedup"), ("engine_prefix_off", "prefix_off_speedup")):
        if f"trl_{workload}_{key}_speedup" in summary:
            summary[f"trl_{workload}_{goal}"] = summary[f"trl_{workload}_{key}_speedup"]
    names = {"generation_s": "generation s", "logprob_s": "log-prob stage s",
             "update_s": "update s"}
    head = (["row", "step s", "step min-max", "speedup"]
            + (["speedup per round"] if rounds > 1 else []) + [names[s] for s in stages]
            + ["load"])
    steps = max((len(r.records) for r in results.values() if isinstance(r, RunResult)),
                default=0)
    runs = "one run per row" if rounds == 1 else \
        f"{rounds} runs per row, interleaved, their steps pooled"
    notes = [f"medians over steps 2..{steps} of {runs} (the first step is warm-up); "
             "speedup = TRL's seconds / the row's (> 1: faster than TRL), per stage in "
             f"brackets; one process per row, OMP_NUM_THREADS={threads}; load: the host's "
             "1-minute load average when the run started and ended"]
    headers = sorted({line for r in rows if r.side == "engine"
                      and isinstance(results[r.key], RunResult)
                      for line in results[r.key].header})
    if headers:
        notes.append("engine header: " + " | ".join(headers))
    return Table(f"{workload}: TRL {TRAINER[workload]} vs the engine", head, table_rows,
                 notes), summary


def run_trl(quick: bool, steps: int | None = None, workloads: str | None = None,
            threads: int = 2, rounds: int = 1) -> BenchResult:
    """Every workload's rows in turn, `rounds` times interleaved (module docstring)."""
    steps = steps or (QUICK_STEPS if quick else STEPS)
    if steps < 2:
        raise ValueError(f"--steps {steps}: at least 2 (the first step is left out)")
    if rounds < 1:
        raise ValueError(f"--rounds {rounds}: at least 1")
    names = workloads.split(",") if workloads else list(WORKLOADS)
    with_vllm = vllm_rows_possible()
    rows = plan_rows(names, quick, with_vllm)
    timeout = QUICK_TIMEOUT_S if quick else TIMEOUT_S
    tables, summary = [], {"trl_steps": steps, "trl_threads": threads, "trl_quick": quick,
                           "trl_vllm_rows": with_vllm, "trl_rounds": rounds}
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench_trl_") as work:
        files = workdir_files(work, quick)
        for name in names:
            mine = [r for r in rows if r.workload == name]
            results: dict[str, RunResult | str] = {}
            for k in range(rounds):
                for row in mine:
                    if isinstance(results.get(row.key), str):
                        continue   # failed in an earlier round
                    print(f"[bench trl] {name}: {row.label} (round {k + 1}/{rounds}) ...",
                          file=sys.stderr, flush=True)
                    try:
                        res = run_row(row, files, steps, threads, work, timeout, k)
                    except Exception as e:  # noqa: BLE001 - recorded; the other rows still run
                        results[row.key] = f"{type(e).__name__}: {e}".splitlines()[0]
                        errors[f"{name}/{row.key}"] = results[row.key]
                        continue
                    if row.key in results:
                        results[row.key].add_round(res)
                    else:
                        results[row.key] = res
            table, keys = workload_table(name, mine, results, threads)
            tables.append(table)
            summary.update(keys)
    if not with_vllm:
        tables[-1].notes.append("no vLLM rows: they need CUDA and vLLM's CUDA build")
    if errors:
        summary["errors"] = errors
    return BenchResult(tables, summary)
