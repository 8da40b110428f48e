"""The optimizer and LR schedule of the optim.* keys (`build_optimizer`, `build_scheduler`),
for every objective's TrainEngine (engine.training.train_engine): megatron-core's AdamW, or
megatron-core's Muon with AdamW for the non-matrix parameters (engine.training.muon,
docs/optimizers.md); torch's fused AdamW kernel per optim.fused (engine.training.fused_adamw)."""
from __future__ import annotations

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from engine.training.fused_adamw import use_fused
from engine.training.layer_wise import with_fp32_checkpoints
from engine.training.muon import (build_muon_optimizer, layer_wise_muon,
                                  megatron_distributed_optimizer, muon_config_kwargs)


def build_optimizer(chunks: list, optim_cfg, dtype: torch.dtype):
    """megatron-core's AdamW (optim.name=adamw) or Muon with AdamW for the non-matrix
    parameters (optim.name=muon: engine.training.muon), for every objective."""
    config = OptimizerConfig(
        optimizer="adam", lr=optim_cfg.lr, min_lr=optim_cfg.min_lr,
        weight_decay=optim_cfg.weight_decay, adam_beta1=optim_cfg.betas[0],
        adam_beta2=optim_cfg.betas[1], adam_eps=optim_cfg.eps, clip_grad=optim_cfg.clip_grad,
        bf16=dtype == torch.bfloat16, params_dtype=dtype,
        use_distributed_optimizer=megatron_distributed_optimizer(optim_cfg))
    if getattr(optim_cfg, "name", "adamw") != "muon":
        optimizer = get_megatron_optimizer(config, chunks)
    else:
        for key, value in muon_config_kwargs(optim_cfg.muon).items():
            setattr(config, key, value)
        layer_wise = layer_wise_muon(optim_cfg)
        optimizer = build_muon_optimizer(chunks, config, layer_wise=layer_wise)
        if layer_wise:   # megatron-core's layer-wise optimizer, its fp32 checkpoints fixed
            optimizer = with_fp32_checkpoints(optimizer)
    use_fused(optimizer, getattr(optim_cfg, "fused", None))   # torch's fused AdamW: optim.fused
    return optimizer


def build_scheduler(optimizer, optim_cfg, total_steps: int) -> OptimizerParamScheduler:
    """megatron's LR (and constant weight-decay) schedule over `total_steps` optimizer steps:
    linear warmup over optim.warmup_steps, then cosine to optim.min_lr or constant."""
    decay_steps = max(total_steps, optim_cfg.warmup_steps + 1)
    cosine = optim_cfg.schedule == "cosine"
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if optim_cfg.warmup_steps else optim_cfg.lr,
        max_lr=optim_cfg.lr, min_lr=optim_cfg.min_lr if cosine else optim_cfg.lr,
        lr_warmup_steps=optim_cfg.warmup_steps, lr_decay_steps=decay_steps,
        lr_decay_style="cosine" if cosine else "constant",
        start_wd=optim_cfg.weight_decay, end_wd=optim_cfg.weight_decay,
        wd_incr_steps=decay_steps, wd_incr_style="constant")
