"""The parallel.* keys (shared by SFT and RL) and the DDP communication settings they resolve to.

Overlap keys (engine.training.comm_overlap says what each does inside megatron):

- parallel.overlap_grad_reduce: null (default) = on with megatron-core's distributed optimizer
  (optim.distributed_optimizer with optim.name=adamw) on a CUDA host, off otherwise; true/false force it. Memory: none beyond the fp32 gradient buffer the
  engine always keeps; buckets (parallel.ddp_bucket_mb) only change when reductions start.
- parallel.overlap_param_gather: the same null rule; true needs megatron-core's distributed
  optimizer (refused otherwise, Muon's layer-wise one included) and refuses parallel.overlap_grad_reduce=false (megatron supports the
  parameter-gather overlap only together with the gradient one; null then resolves to on).
  Memory: none (the gather writes into the existing parameter buffer).
- parallel.ddp_bucket_mb: MiB of gradient buffer per DDP bucket (null: megatron's default of
  max(40M, 1M x dp) parameters). Only meaningful while gradients are reduced in buckets, so
  it is refused with parallel.overlap_grad_reduce=false.
- parallel.grad_reduce_in_fp32: true (default) keeps the gradient buffer and its reduction in
  fp32; false reduces bf16 gradients in bf16: half the gradient memory and reduce-scatter
  bytes, faster, and less exact (sums of many bf16 gradients round at every step).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.training.muon import megatron_distributed_optimizer
from engine.training.settings import OverlapSettings


@dataclass
class ParallelConfig:
    tp: int = 1                  # tensor parallel size
    pp: int = 1                  # pipeline parallel size (stages)
    vpp: Optional[int] = None    # virtual pipeline chunks per stage (interleaved); null: none
    cp: int = 1                  # context parallel size; dp = world / (tp x pp x cp)
    cp_comm_type: str = "a2a"    # a2a | p2p | all_gather (p2p/all_gather need Transformer Engine)
    ep: int = 1                  # expert parallel (MoE models): carved out of dp x cp
    # Megatron TP sequence parallelism (engine.config.model_settings); null: on whenever tp > 1
    sequence_parallel: Optional[bool] = None
    # DDP communication (engine.config.parallel_settings); null: on with megatron's distributed
    # optimizer on CUDA
    overlap_grad_reduce: Optional[bool] = None
    # gather updated parameter shards in the next forward (needs megatron's distributed
    # optimizer and overlap_grad_reduce); null: as overlap_grad_reduce
    overlap_param_gather: Optional[bool] = None
    ddp_bucket_mb: Optional[float] = None     # MiB of gradients per DDP bucket; null: megatron's
    grad_reduce_in_fp32: bool = True  # fp32 gradient buffer and reduction; false: bf16, less exact


def cuda_host() -> bool:
    """Whether this host trains on CUDA (the null overlap keys resolve to on only there)."""
    return torch.cuda.is_available()


def overlap_settings(parallel_cfg, distributed_optimizer: bool,
                     cuda: bool | None = None) -> OverlapSettings:
    """The OverlapSettings of the parallel.* keys (the null rules of the module docstring;
    `cuda`: the host has CUDA, default: this host). Call after overlap_problems is empty."""
    p = parallel_cfg
    cuda = cuda_host() if cuda is None else cuda
    auto = bool(distributed_optimizer and cuda)
    gather = auto if p.overlap_param_gather is None else bool(p.overlap_param_gather)
    grad = (auto or gather) if p.overlap_grad_reduce is None else bool(p.overlap_grad_reduce)
    bucket = None if p.ddp_bucket_mb is None else float(p.ddp_bucket_mb)
    return OverlapSettings(overlap_grad_reduce=grad, overlap_param_gather=gather,
                           bucket_mb=bucket, grad_reduce_in_fp32=bool(p.grad_reduce_in_fp32))


def overlap_problems(cfg) -> list[str]:
    """The overlap keys against each other and optim.distributed_optimizer (no host facts:
    the same answer on the CPU host that validates a recipe and the GPUs that run it)."""
    p, problems = cfg.parallel, []
    if p.overlap_param_gather and not megatron_distributed_optimizer(cfg.optim):
        problems.append("parallel.overlap_param_gather=true needs optim.distributed_optimizer="
                        "true with optim.name=adamw (only megatron-core's distributed optimizer "
                        "shards parameters that must be gathered; Muon's layer-wise one gathers "
                        "them at the end of its step); set parallel.overlap_param_gather=false "
                        "or null")
    if p.overlap_param_gather and p.overlap_grad_reduce is False:
        problems.append("parallel.overlap_param_gather=true with parallel.overlap_grad_reduce="
                        "false is not supported by megatron; set parallel.overlap_grad_reduce="
                        "true or null, or parallel.overlap_param_gather=false")
    bucket = p.ddp_bucket_mb
    if bucket is not None and (isinstance(bucket, bool) or not bucket > 0):
        problems.append(f"parallel.ddp_bucket_mb={bucket!r} must be null or a number > 0 "
                        "(MiB of gradients per DDP bucket)")
    elif bucket is not None and p.overlap_grad_reduce is False:
        problems.append(f"parallel.ddp_bucket_mb={bucket} has no effect with parallel."
                        "overlap_grad_reduce=false (gradients are then reduced in one bucket "
                        "per buffer); remove it or set parallel.overlap_grad_reduce=true/null")
    return problems


def resolved_overlap_problems(cfg, cuda: bool | None = None) -> list[str]:
    """At run time, on this host: parallel.ddp_bucket_mb while the gradient overlap resolves
    to off (null on a host without CUDA or without the distributed optimizer)."""
    s = overlap_settings(cfg.parallel, megatron_distributed_optimizer(cfg.optim), cuda)
    if cfg.parallel.ddp_bucket_mb is not None and not s.overlap_grad_reduce:
        return [f"parallel.ddp_bucket_mb={cfg.parallel.ddp_bucket_mb} has no effect: "
                "parallel.overlap_grad_reduce=null resolves to off here (no CUDA or "
                "optim.distributed_optimizer=false); set parallel.overlap_grad_reduce=true or "
                "remove parallel.ddp_bucket_mb"]
    return []
