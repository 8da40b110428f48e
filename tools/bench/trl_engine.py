"""The engine's side of `python -m tools.bench trl` (tools/bench/trl.py): the command of one
run (`python -m engine.rl | engine.sft | engine.dpo` with hydra overrides: the workload's
sizes, everything else the engine's DEFAULTS, plus a row's own overrides) and its per-step
records read from the run's metrics.jsonl.

Settings (tools/bench/trl_side.py's, the same workload): GRPO 2 prompts per step x rollout.n 8
replies of at most 32 tokens, temperature 1, kl.beta 0.01 (a reference model), optim.lr 1e-5,
reward.fn tools.bench.trl_workload:reward; SFT 8 rows and DPO 8 pairs per step (dpo.beta 0.1),
lr 1e-5. No checkpoint is written.

Stages per step (`engine_records`), from the engine's own time/* metrics:
- GRPO: generation = time/rollout_s (generation, rewards, advantages), log-prob stage =
  time/logprob_s (the reference's pass, and the old policy's where the engine runs one),
  update = time/train_s - time/logprob_s, step = time/step_s (also the weight sync);
- DPO: log-prob stage = time/reference_s, update = time/step_s - it;
- SFT: the step alone.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

GRPO = ("rollout.n=8", "train.prompts_per_step=2", "rollout.max_new_tokens=32",
        "rollout.temperature=1.0", "kl.beta=0.01", "optim.lr=1e-5",
        "reward.fn=tools.bench.trl_workload:reward")
SFT = ("train.global_batch_size=8", "optim.lr=1e-5")
DPO = SFT + ("dpo.beta=0.1",)
ENTRY = {"grpo_shared": ("engine.rl", GRPO), "grpo_distinct": ("engine.rl", GRPO),
         "sft": ("engine.sft", SFT), "dpo": ("engine.dpo", DPO)}


def engine_command(workload: str, model: str, data: str, steps: int, log_dir: str,
                   overrides: tuple[str, ...] = ()) -> list[str]:
    """argv of one engine run of `workload` (module docstring); `overrides` last."""
    if workload not in ENTRY:
        raise ValueError(f"workload {workload!r} unknown; valid: {', '.join(ENTRY)}")
    module, sizes = ENTRY[workload]
    log = Path(log_dir)
    common = [f"model.hf_path={model}", f"data.train_files=[{data}]",
              f"train.max_steps={steps}", f"logging.dir={log}", "logging.progress_bar=false",
              f"checkpoint.dir={log / 'ckpt'}", "checkpoint.save_on_exit=false"]
    if module != "engine.rl":
        common.append(f"data.cache_dir={log / 'cache'}")
    return [sys.executable, "-m", module, *common, *sizes, *overrides]


def engine_records(workload: str, metrics: list[dict]) -> list[dict[str, float]]:
    """One record per step ({"step_s", and the stages of the module docstring}) from the
    run's metrics.jsonl rows."""
    out = []
    for m in metrics:
        step = m["time/step_s"]
        record = {"step_s": step}
        if workload.startswith("grpo"):
            logprob = m.get("time/logprob_s", 0.0)
            record.update(generation_s=m["time/rollout_s"], logprob_s=logprob,
                          update_s=m["time/train_s"] - logprob)
        elif workload == "dpo":
            ref = m.get("time/reference_s", 0.0)
            record.update(logprob_s=ref, update_s=step - ref)
        out.append(record)
    return out


def read_metrics(log_dir: str) -> list[dict]:
    """The step rows of a run's metrics.jsonl (validation rows, without time/step_s, left
    out)."""
    rows = [json.loads(line) for line in (Path(log_dir) / "metrics.jsonl").read_text()
            .splitlines() if line.strip()]
    return [r for r in rows if "time/step_s" in r]


def header_lines(output: str) -> list[str]:
    """The engine's run-header lines that say what its defaults chose for the step (micro-
    batches, prefix sharing, old log-probs)."""
    keys = ("prefix", "micro", "old log-probs", "token budget")
    return [line.strip() for line in output.splitlines()
            if line.startswith("[") and any(k in line for k in keys)][:6]
