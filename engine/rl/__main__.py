"""GRPO / DAPO entry point.

    torchrun --nproc_per_node N -m engine.rl algorithm=grpo|dapo model.hf_path=DIR \
        data.train_files=[prompts.jsonl] rollout.n=8 train.prompts_per_step=32 \
        train.mini_batches_per_step=2 parallel.tp=2
    python -m engine.rl --config recipes/rl/qwen3_8b_grpo_h100.yaml --validate --nodes 4
                                       (layout and rollout placement of a recipe; no training)

The configuration (algorithm presets applied, explicit keys win) is validated here, before
any process group exists (exit code 2 on an error); the run itself is engine.rl.loop.run.
"""
from __future__ import annotations

import sys

from engine.cli import entry_main, exit_process, hook


def rl_validator(argv: list[str]):
    """The `validate` hook for engine.run.launch.run_entry: algorithm defaults (explicit keys from
    `argv` win), then validate_rl."""
    def validate(cfg, world_size: int) -> dict:
        explicit = hook("engine.rl.algo.presets:explicit_keys")(argv)
        # ConfigError for an unknown algorithm
        hook("engine.rl.algo.presets:apply_algorithm_defaults")(cfg, explicit)
        return hook("engine.rl.checks:validate_rl")(cfg, world_size)

    return validate


USAGE = "python -m engine.rl [--config FILE.yaml] [key=value ...]  (or torchrun ... -m engine.rl)"
EXAMPLES = [
    "python -m engine.rl algorithm=grpo model.hf_path=DIR data.train_files=[prompts.jsonl] "
    "reward.fn=math rollout.n=8",
    "torchrun --nproc_per_node 8 -m engine.rl --config recipes/rl/qwen3_8b_grpo_h100.yaml "
    "model.hf_path=DIR",
    "python -m engine.rl --config recipes/rl/qwen3_8b_grpo_h100.yaml --validate --nodes 4",
]


def main(argv: list[str] | None = None, prog: str = "engine.rl", usage: str = USAGE,
         examples: list[str] = EXAMPLES) -> int:
    """`python -m engine.rl [--config FILE] [key=value ...] [--validate ...]`. `prog`, `usage`
    and `examples` are what --help prints (the console command passes its own)."""
    argv = list(argv if argv is not None else sys.argv[1:])
    return entry_main(argv, prog, "engine.rl.config:RLConfig", usage, examples,
                      hook("engine.rl.recipe_check:rl_validate_main"), "engine.rl.loop:run",
                      validate=rl_validator(argv), split=start_split)


def start_split(cfg) -> tuple[str, str] | None:
    """rollout.placement=disaggregated: split the job into training and rollout worlds
    (engine.rl.disaggregated.world); the rollout ranks run engine.rl.disaggregated.rollout_ranks."""
    if cfg.rollout.placement != "disaggregated":
        return None
    split = hook("engine.rl.disaggregated.world:init_split_world")(cfg.rollout.num_ranks,
                                                                   cfg.rollout.peer_timeout_s)
    return split.role, "engine.rl.disaggregated.rollout_ranks:run_rollout"


if __name__ == "__main__":
    exit_process(main())
