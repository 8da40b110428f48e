"""TRL's side of `python -m tools.bench trl` (tools/bench/trl.py): one of TRL's own trainers on
the workload's model and rows, in a process of its own, seconds per optimizer step written to
a JSON file.

    python -m tools.bench.trl_side WORKLOAD --model DIR --data FILE --steps N --out JSON
                                   [--vllm]

WORKLOAD: grpo_shared | grpo_distinct (GRPOTrainer), sft (SFTTrainer), dpo (DPOTrainer). The
settings are the workload's (tools/bench/trl.py: 2 prompts x 8 replies of at most 32 tokens,
temperature 1, KL beta 0.01 with a reference model, lr 1e-5; SFT 8 rows and DPO 8 pairs per
step), fp32 (`bf16=False`), `use_cpu` without CUDA; everything else is TRL's default. `--vllm`:
GRPO generates with TRL's vLLM colocate mode (`use_vllm=True, vllm_mode="colocate"`).

Timing, nothing of TRL edited: a TrainerCallback takes each optimizer step's wall time
(on_step_begin -> on_step_end); for GRPO a subclass of GRPOTrainer wraps its methods with
timers (TimedGRPO): `_generate_and_score_completions` (prompt tokenisation, generation,
rewards, advantages, and the log-prob passes), within it `_get_per_token_logps_and_entropies`
(the log-prob stage: the reference's pass, and the old policy's where TRL runs one) and
`_generate` (generation alone). A step's stages: generation = the first minus the log-prob
stage (as the engine's time/rollout_s, which holds its rewards too), log-prob stage, update =
step - both (the policy's forward, backward and optimizer step). For DPO the reference
model's forward is wrapped (the log-prob stage; update = step - it). The out file:
{"workload", "steps": [{"step_s", "generation_s", "generate_only_s", "logprob_s",
"update_s"}, ...], "settings": {...}, "versions": {...}}.
"""
from __future__ import annotations

import argparse
import json
import time

from tools.bench.trl_workload import WORKLOADS, trl_reward

GRPO = dict(num_generations=8, per_device_train_batch_size=16, max_completion_length=32,
            temperature=1.0, beta=0.01)
BATCH = 8               # SFT rows, DPO pairs per step
LR = 1e-5


class StageTimes:
    """Seconds per stage of the current optimizer step, and the finished steps' records."""

    def __init__(self) -> None:
        self.current: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []
        self.depth = 0          # > 0 inside _generate_and_score_completions

    def add(self, key: str, seconds: float) -> None:
        self.current[key] = self.current.get(key, 0.0) + seconds

    def close(self, step_s: float) -> dict[str, float]:
        """The record of a finished step of `step_s` seconds (module docstring's stages)."""
        c = self.current
        record = {"step_s": step_s}
        if "rollout_s" in c:
            logprob = c.get("logprob_s", 0.0)
            record.update(generation_s=c["rollout_s"] - logprob,
                          generate_only_s=c.get("generate_s", 0.0), logprob_s=logprob,
                          update_s=step_s - c["rollout_s"])
        elif "reference_s" in c:
            record.update(logprob_s=c["reference_s"], update_s=step_s - c["reference_s"])
        self.steps.append(record)
        self.current = {}
        return record


def timed(times: StageTimes, key: str, method, inside_rollout: bool = False):
    """`method` (bound) wrapped: its wall seconds added to `key` of the current step (with
    `inside_rollout`: only while _generate_and_score_completions runs)."""
    def wrapper(*args, **kwargs):
        if inside_rollout and not times.depth:
            return method(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            times.add(key, time.perf_counter() - t0)
    return wrapper


def step_callback(times: StageTimes):
    """A TrainerCallback closing one record per optimizer step."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.close(time.perf_counter() - self.t0)
    return StepClock()


def instrument_grpo(trainer, times: StageTimes) -> None:
    """Wrap the GRPO trainer's stage methods with timers (module docstring)."""
    rollout = trainer._generate_and_score_completions

    def generate_and_score(*args, **kwargs):
        times.depth += 1
        t0 = time.perf_counter()
        try:
            return rollout(*args, **kwargs)
        finally:
            times.depth -= 1
            times.add("rollout_s", time.perf_counter() - t0)
    trainer._generate_and_score_completions = generate_and_score
    trainer._generate = timed(times, "generate_s", trainer._generate)
    trainer._get_per_token_logps_and_entropies = timed(
        times, "logprob_s", trainer._get_per_token_logps_and_entropies, inside_rollout=True)


def common_args(out_dir: str, steps: int) -> dict:
    """TrainingArguments shared by the three trainers: fp32, no logging or saving."""
    import torch

    return dict(output_dir=out_dir, learning_rate=LR, max_steps=steps, bf16=False,
                use_cpu=not torch.cuda.is_available(), report_to="none",
                save_strategy="no", logging_steps=1, disable_tqdm=True,
                dataloader_num_workers=0, seed=0)


def build_trainer(workload: str, model_dir: str, rows: list[dict], steps: int, out_dir: str,
                  vllm: bool, times: StageTimes):
    """The TRL trainer of `workload` (module docstring) with the step clock attached."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if workload not in WORKLOADS:
        raise ValueError(f"workload {workload!r} unknown; valid: {', '.join(WORKLOADS)}")
    if vllm and not workload.startswith("grpo"):
        raise ValueError(f"--vllm: only the GRPO workloads generate; {workload!r} does not")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    data = Dataset.from_list(rows)
    clock = [step_callback(times)]
    args = common_args(out_dir, steps)
    if workload.startswith("grpo"):
        from trl import GRPOConfig, GRPOTrainer

        extra = dict(use_vllm=True, vllm_mode="colocate",
                     vllm_gpu_memory_utilization=0.3) if vllm else {}
        trainer = GRPOTrainer(model=model, reward_funcs=trl_reward,
                              args=GRPOConfig(**args, **GRPO, **extra), train_dataset=data,
                              processing_class=tok, callbacks=clock)
        instrument_grpo(trainer, times)
        return trainer
    if workload == "sft":
        from trl import SFTConfig, SFTTrainer

        return SFTTrainer(model=model, args=SFTConfig(**args, per_device_train_batch_size=BATCH,
                                                      max_length=None),
                          train_dataset=data, processing_class=tok, callbacks=clock)
    from trl import DPOConfig, DPOTrainer

    trainer = DPOTrainer(model=model, ref_model=AutoModelForCausalLM.from_pretrained(model_dir),
                      args=DPOConfig(**args, per_device_train_batch_size=BATCH, beta=0.1,
                                     max_length=None),
                      train_dataset=data, processing_class=tok, callbacks=clock)
    trainer.ref_model.forward = timed(times, "reference_s", trainer.ref_model.forward)
    return trainer


def settings(workload: str, vllm: bool) -> dict:
    """What the run set (the out file's "settings")."""
    if workload.startswith("grpo"):
        return {**GRPO, "lr": LR, "vllm": vllm}
    return {"batch": BATCH, "lr": LR, **({"beta": 0.1} if workload == "dpo" else {})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.trl_side",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("workload", choices=WORKLOADS)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--vllm", action="store_true")
    args = p.parse_args(argv)
    import tempfile
    from importlib.metadata import version

    from tools.bench.common import quiet_libraries

    quiet_libraries()
    rows = [json.loads(line) for line in open(args.data) if line.strip()]
    times = StageTimes()
    with tempfile.TemporaryDirectory(prefix="bench_trl_side_") as tmp:
        trainer = build_trainer(args.workload, args.model, rows, args.steps, tmp, args.vllm,
                                times)
        trainer.train()
    with open(args.out, "w") as f:
        json.dump({"workload": args.workload, "steps": times.steps,
                   "settings": settings(args.workload, args.vllm),
                   "versions": {d: version(d) for d in ("trl", "transformers", "torch")}}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
