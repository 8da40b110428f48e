"""The checkpoint.* keys (CheckpointConfig), shared by every entry point's schema; their
checks are engine.config.schema.checkpoint_config_problems."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class CheckpointConfig:
    """Training checkpoints (engine.checkpoint.checkpointing): `dir`/iter_NNNNNNN/ per save."""

    dir: Optional[str] = None          # run directory of checkpoints; null: never save
    save_interval: int = 0             # save every N optimizer steps (0: only on exit)
    keep_last: Optional[int] = None    # keep the newest N complete checkpoints (null: all)
    resume: str = "auto"               # auto (newest complete in dir) | never | <path>
    # a resumed run whose LR schedule (optim.lr, min_lr, warmup_steps, schedule, weight_decay,
    # train.max_steps) differs from the checkpoint's: same (stop, naming the keys) | checkpoint
    # (keep the checkpoint's) | config (this config's, at the resumed step)
    schedule: str = "same"
    save_on_exit: bool = True          # save at the end, at exit_interval/duration, on signal
    # also write iter_NNNNNNN/hf/ at every save: the folder `tools/convert.py mcore-to-hf`
    # writes from that checkpoint (docs/checkpoints.md#hugging-face-folders-during-training)
    save_hf: bool = False
