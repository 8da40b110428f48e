"""Preference optimisation (DPO and relatives) entry point (docs/preference.md).

    torchrun --nproc_per_node N -m engine.dpo model.hf_path=DIR data.train_files=[pairs.jsonl] \
        dpo.loss_type=sigmoid dpo.beta=0.1 train.global_batch_size=64 train.max_steps=100
    python -m engine.dpo --config recipes/dpo/qwen3_8b_dpo_h100.yaml --validate --nodes 1

The configuration is parsed and validated here, before any process group exists (exit code 2
on an error); the run itself is engine.dpo.training.run.
"""
from __future__ import annotations

from engine.cli import entry_main, exit_process, hook


USAGE = "python -m engine.dpo [--config FILE.yaml] [key=value ...]  (or torchrun ... -m engine.dpo)"
EXAMPLES = [
    "python -m engine.dpo model.hf_path=DIR data.train_files=[pairs.jsonl] train.max_steps=100",
    "torchrun --nproc_per_node 8 -m engine.dpo --config recipes/dpo/qwen3_8b_dpo_h100.yaml "
    "model.hf_path=DIR dpo.loss_type=ipo",
    "python -m engine.dpo --config recipes/dpo/qwen3_8b_dpo_h100.yaml --validate --nodes 1",
]


def main(argv: list[str] | None = None, prog: str = "engine.dpo", usage: str = USAGE,
         examples: list[str] = EXAMPLES) -> int:
    """`python -m engine.dpo [--config FILE] [key=value ...] [--validate ...]`. `prog`, `usage`
    and `examples` are what --help prints (the console command passes its own)."""
    return entry_main(argv, prog, "engine.config.dpo_settings:DPOConfig", usage, examples,
                      hook("engine.dpo.recipe_check:main"), "engine.dpo.training:run",
                      validate=hook("engine.config.dpo_settings:validate_dpo"))


if __name__ == "__main__":
    exit_process(main())
