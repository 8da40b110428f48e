"""model.vision.*: the vision tower of a model that takes images (models.vision, docs/vlm.md)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class VisionConfig:
    # frozen by default, as LLaMA-Factory's freeze_vision_tower; false: SFT trains it with the
    # language model (RL refuses it: engine.rl.checks)
    freeze: bool = True
