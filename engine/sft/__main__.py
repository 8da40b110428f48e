"""Supervised fine-tuning entry point.

    torchrun --nproc_per_node N -m engine.sft model.hf_path=DIR data.train_files=[a.jsonl] \
        parallel.tp=2 train.global_batch_size=16 train.max_steps=100 loss.agg_mode=token-mean \
        checkpoint.dir=runs/x/checkpoints checkpoint.save_interval=50
    python -m engine.sft --config recipes/sft/qwen3_8b_h100.yaml --validate --world-size 16 \
        --nodes 2                      (layout/memory check of a recipe; no training)

The configuration is parsed and validated here, before any process group exists (exit code 2
on an error); the run itself is engine.sft.training.run.
"""
from __future__ import annotations

from engine.cli import entry_main, exit_process, hook


USAGE = "python -m engine.sft [--config FILE.yaml] [key=value ...]  (or torchrun ... -m engine.sft)"
EXAMPLES = [
    "python -m engine.sft model.hf_path=DIR data.train_files=[train.jsonl] train.max_steps=100",
    "torchrun --nproc_per_node 8 -m engine.sft --config recipes/sft/qwen3_8b_h100.yaml "
    "model.hf_path=DIR parallel.tp=2",
    "python -m engine.sft --config recipes/sft/qwen3_8b_h100.yaml --validate --world-size 16 "
    "--nodes 2",
]


def main(argv: list[str] | None = None, prog: str = "engine.sft", usage: str = USAGE,
         examples: list[str] = EXAMPLES) -> int:
    """`python -m engine.sft [--config FILE] [key=value ...] [--validate ...]`. `prog`, `usage`
    and `examples` are what --help prints (the console command passes its own)."""
    return entry_main(argv, prog, "engine.config.schema:SFTConfig", usage, examples,
                      hook("engine.config.recipe_validation:validate_main"),
                      "engine.sft.training:run", validate=hook("engine.config.schema:validate_sft"))


if __name__ == "__main__":
    exit_process(main())
