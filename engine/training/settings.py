"""The settings a config resolves to for a TrainEngine, as plain dataclasses without megatron-core,
so engine.config reads them when it checks a config (`--validate`, before any process group):

- `OverlapSettings`: the resolved DDP communication settings (engine.config.parallel_settings;
  engine.training.comm_overlap, which re-exports it, says what each does inside megatron and
  turns them into its DistributedDataParallelConfig);
- `MTPTraining`: how the MTP layer trains (engine.config.mtp_settings; engine.training.mtp,
  which re-exports it, computes the loss).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MIB = 2 ** 20


@dataclass(frozen=True)
class OverlapSettings:
    """Resolved DDP communication settings (the defaults are the engine's behaviour before
    the overlap keys existed: nothing overlapped, fp32 gradient reduction)."""

    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    bucket_mb: float | None = None       # MiB of gradient buffer per DDP bucket (None: megatron)
    grad_reduce_in_fp32: bool = True

    def bucket_elements(self, params_dtype: torch.dtype) -> int | None:
        """megatron's `bucket_size` (parameters per bucket) of `bucket_mb` MiB of gradients:
        4 bytes each with grad_reduce_in_fp32, else the parameter dtype's size."""
        if self.bucket_mb is None:
            return None
        grad_bytes = 4 if self.grad_reduce_in_fp32 else torch.finfo(params_dtype).bits // 8
        return max(1, int(self.bucket_mb * MIB) // grad_bytes)


@dataclass(frozen=True)
class MTPTraining:
    """How a TrainEngine trains the MTP layer: `loss_scale` (model.mtp.loss_scale) times the
    MTP loss joins the step's loss; `detach`: no MTP gradient reaches the trunk, embedding or
    output head (model.mtp.detach_trunk; RL always)."""

    loss_scale: float
    detach: bool
