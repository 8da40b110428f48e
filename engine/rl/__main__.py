"""GRPO / DAPO entry point.

    torchrun --nproc_per_node N -m engine.rl algorithm=grpo|dapo model.hf_path=DIR \
        data.train_files=[prompts.jsonl] rollout.n=8 train.prompts_per_step=32 \
        train.mini_batches_per_step=2 parallel.tp=2

The configuration (algorithm presets applied, explicit keys win) is validated here, before
any process group exists (exit code 2 on an error); the run itself is engine.rl.loop.run.
"""
from __future__ import annotations

import sys

from engine.cli import run_entry
from engine.rl.config import RLConfig, rl_validator


def main(argv: list[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    return run_entry("engine.rl.loop:run", argv, schema=RLConfig, validate=rl_validator(argv))


if __name__ == "__main__":
    raise SystemExit(main())
