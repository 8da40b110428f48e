"""KTO entry point (docs/preference.md, "KTO").

    torchrun --nproc_per_node N -m engine.kto model.hf_path=DIR data.train_files=[kto.jsonl] \
        kto.beta=0.1 train.global_batch_size=64 train.max_steps=100
    python -m engine.kto --config RECIPE.yaml --validate --nodes 1

The configuration is parsed and validated here, before any process group exists (exit code 2
on an error); the run itself is engine.kto.training.run.
"""
from __future__ import annotations

from engine.cli import entry_main, exit_process, hook


USAGE = "python -m engine.kto [--config FILE.yaml] [key=value ...]  (or torchrun ... -m engine.kto)"
EXAMPLES = [
    "python -m engine.kto model.hf_path=DIR data.train_files=[kto.jsonl] train.max_steps=100",
    "torchrun --nproc_per_node 8 -m engine.kto model.hf_path=DIR data.train_files=[kto.jsonl] "
    "kto.desirable_weight=1.33 parallel.tp=2",
    "python -m engine.kto --config RECIPE.yaml --validate --nodes 1",
]


def main(argv: list[str] | None = None, prog: str = "engine.kto", usage: str = USAGE,
         examples: list[str] = EXAMPLES) -> int:
    """`python -m engine.kto [--config FILE] [key=value ...] [--validate ...]`. `prog`, `usage`
    and `examples` are what --help prints (the console command passes its own)."""
    return entry_main(argv, prog, "engine.config.kto_settings:KTOConfig", usage, examples,
                      hook("engine.kto.recipe_check:main"), "engine.kto.training:run",
                      validate=hook("engine.config.kto_settings:validate_kto"))


if __name__ == "__main__":
    exit_process(main())
