"""Training the checkpoint's multi-token-prediction (MTP) layer alongside the model.

Keys (`model.mtp.*`):
- `enabled` (default false): build, load and train the MTP layer (models.layers.mtp) instead of
  carrying it unchanged (models.hf.passthrough). SFT, DPO, KTO and RL train it on the batch's
  own tokens: at each trained position t the layer predicts labels[t+1] from the trunk's state
  at t and the embedding of token t+1 (engine.training.mtp), weighted by the per-sequence
  weights each trainer passes (DPO: the chosen completions, KTO: the desirable ones; docs/mtp.md).
  Reward models refuse it (engine.config.rm_settings).
  Exported under the checkpoint's own names (model.layers.{N}.*), so a vLLM MTP drafter loads it.
- `loss_scale` (default 0.1, megatron's mtp_loss_scaling_factor default): the step's loss is
  main + loss_scale x mtp/loss.
- `detach_trunk` (null: false for SFT-shaped runs, true for RL): the MTP loss gives no gradient
  to the trunk, the embedding or the output head. RL requires true: the policy gradient must
  stay exactly the policy's own (SkyRL trains its draft with a separate loss the same way).

Refused by name (`mtp_problems`, before any process group starts): a checkpoint without MTP
layers or of a family whose MTP layer is not built here (models.families.mtp), LoRA (the base
and so the MTP layer are frozen), the unchunked loss head
(train.loss_chunk_tokens=0), MoE routing replay (its rollout records have no MTP layer), and
detach_trunk=false in RL.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from engine.training.settings import MTPTraining
from models.families.mtp import mtp_training_problems


@dataclass
class MTPConfig:
    enabled: bool = False  # build, load and train the checkpoint's MTP layer (engine.config.mtp_settings)
    loss_scale: float = 0.1  # the step's loss is main + loss_scale x the MTP loss
    detach_trunk: Optional[bool] = None   # null: false (SFT-shaped runs), true (RL)


def is_rl(cfg: Any) -> bool:
    """Whether `cfg` is an RL run's configuration (it has rollout keys)."""
    return hasattr(cfg, "rollout")


def mtp_problems(cfg: Any, hf_config: dict) -> list[str]:
    """Every problem of the model.mtp keys for this model and run (empty when off)."""
    mtp = cfg.model.mtp
    if not mtp.enabled:
        return []
    p = list(mtp_training_problems(hf_config))
    if isinstance(mtp.loss_scale, bool) or not isinstance(mtp.loss_scale, (int, float)) \
            or not mtp.loss_scale > 0:
        p.append(f"model.mtp.loss_scale={mtp.loss_scale!r} must be a number > 0")
    if cfg.model.lora.rank or cfg.model.lora.init_from:
        p.append("model.mtp.enabled=true with LoRA is not supported: LoRA freezes the base "
                 "model, the MTP layer with it; train it in full (model.lora off)")
    if not cfg.train.loss_chunk_tokens:
        p.append("model.mtp.enabled=true needs the chunked loss head: train.loss_chunk_tokens "
                 f"must be > 0 (got {cfg.train.loss_chunk_tokens!r})")
    moe = getattr(cfg, "moe", None)
    if moe is not None and getattr(moe, "routing_replay", None):
        p.append(f"model.mtp.enabled=true with moe.routing_replay={moe.routing_replay} is not "
                 "supported: the rollout's routing records have no MTP layer")
    if is_rl(cfg) and mtp.detach_trunk is False:
        p.append("model.mtp.detach_trunk=false is not allowed in RL: the MTP loss would change "
                 "the policy gradient; use true or null")
    return p


def mtp_training(cfg: Any) -> MTPTraining | None:
    """The TrainEngine's MTP settings of a run (None when model.mtp.enabled is false)."""
    mtp = cfg.model.mtp
    if not mtp.enabled:
        return None
    detach = is_rl(cfg) if mtp.detach_trunk is None else bool(mtp.detach_trunk)
    return MTPTraining(float(mtp.loss_scale), detach)
