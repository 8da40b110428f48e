"""Several `engine.sft` runs one after another in one pool rank (tests/test_moe_sft_cli.py: MoE
models of different depths trained in turn by one process, as a notebook would; megatron-core's
router-loss tracker is process-wide), and what that tracker holds."""
from __future__ import annotations

import os

from engine.sft.__main__ import main
from engine.training.router_losses import _tracker


def sft_in_turn(argvs: list[list[str]]) -> list[int]:
    """engine.sft's exit code for each argv, run in order in this process."""
    return [main(list(argv)) for argv in argvs]


def tracker_names() -> tuple[int, list[str]]:
    """(this process's pid, the names of megatron's router-loss records it holds)."""
    return os.getpid(), sorted(_tracker())


def sft_in_turn_then_names(argvs: list[list[str]]) -> tuple[int, tuple[list[int], list[str]]]:
    """(pid, (sft_in_turn's exit codes, the router-loss record names left afterwards))."""
    codes = sft_in_turn(argvs)
    pid, names = tracker_names()
    return pid, (codes, names)
