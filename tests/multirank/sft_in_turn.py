"""Several `engine.sft` runs one after another in one pool rank (tests/test_moe_sft_cli.py: MoE
models of different depths trained in turn by one process, as a policy and a deeper critic
are; megatron-core's router-loss tracker is process-wide)."""
from __future__ import annotations

from engine.sft.__main__ import main


def sft_in_turn(argvs: list[list[str]]) -> list[int]:
    """engine.sft's exit code for each argv, run in order in this process."""
    return [main(list(argv)) for argv in argvs]
