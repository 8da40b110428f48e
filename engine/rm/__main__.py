"""Reward-model training entry point (docs/preference.md, "Reward models").

    torchrun --nproc_per_node N -m engine.rm model.hf_path=DIR data.train_files=[pairs.jsonl] \
        train.global_batch_size=64 train.max_steps=100
    python -m engine.rm --config recipes/rm/qwen3_8b_rm_h100.yaml --validate --nodes 1

The configuration is parsed and validated here, before any process group exists (exit code 2
on an error); the run itself is engine.rm.training.run.
"""
from __future__ import annotations

import sys

from engine.cli import entry_main, exit_process
from engine.config.rm_settings import RMConfig, validate_rm
from engine.rm.recipe_check import main as validate_main


USAGE = "python -m engine.rm [--config FILE.yaml] [key=value ...]  (or torchrun ... -m engine.rm)"
EXAMPLES = [
    "python -m engine.rm model.hf_path=DIR data.train_files=[pairs.jsonl] train.max_steps=100",
    "torchrun --nproc_per_node 8 -m engine.rm --config recipes/rm/qwen3_8b_rm_h100.yaml "
    "model.hf_path=DIR",
    "python -m engine.rm --config recipes/rm/qwen3_8b_rm_h100.yaml --validate --nodes 1",
    "python -m engine.rm score --model runs/rm/hf --data chats.jsonl  (an exported reward "
    "model's scores of chats; `score --help`)",
]


def main(argv: list[str] | None = None, prog: str = "engine.rm", usage: str = USAGE,
         examples: list[str] = EXAMPLES) -> int:
    """`python -m engine.rm [--config FILE] [key=value ...] [--validate ...]`, or
    `python -m engine.rm score ...` (engine.rm.score: a reward model's scores of chats). `prog`,
    `usage` and `examples` are what --help prints (the console command passes its own)."""
    argv = list(argv if argv is not None else sys.argv[1:])
    if argv[:1] == ["score"]:
        from engine.rm.score import main as score_main   # loads transformers' model classes

        return score_main(argv[1:], prog=f"{prog} score")
    return entry_main(argv, prog, RMConfig, usage, examples, validate_main,
                      "engine.rm.training:run", validate=validate_rm)


if __name__ == "__main__":
    exit_process(main())
