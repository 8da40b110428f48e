"""Model, DDP, optimizer and LR schedule for one run, under megatron's current parallel state.

Gradient contract (see engine.loss): DDP with `calculate_per_token_loss=True` sums gradients
over DP x CP; `finalize_grads` calls megatron's `finalize_model_grads` with `num_tokens=None`,
so gradients are never divided by a token or micro-batch count.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.nonfinite import NonFiniteGuard


@dataclass
class TrainState:
    chunks: list            # DDP-wrapped GPTModel chunks of this rank (pipeline order)
    optimizer: object       # megatron optimizer (distributed by default)
    scheduler: object       # megatron OptimizerParamScheduler
    hf_config: dict
    vocab_size: int
    guard: NonFiniteGuard = field(default_factory=NonFiniteGuard)  # skipped-step accounting


def finalize_grads(model, num_tokens=None, **kwargs):
    """Megatron's finalize_model_grads with the token count dropped: our losses are already
    globally normalised weighted sums (engine.loss)."""
    from megatron.core.distributed import finalize_model_grads
    return finalize_model_grads(model, None, **kwargs)


def build_train_state(hf_config: dict, optim_cfg, dtype: torch.dtype, max_steps: int,
                      weights_dir: str | None = None, load_weights: bool = True,
                      **model_overrides) -> TrainState:
    """Build this rank's model chunks, load HF weights from `weights_dir`, wrap them in megatron
    DDP and create the optimizer and LR scheduler. `model_overrides` go to the
    TransformerConfig (e.g. cp_comm_type)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from models.bridge import load_hf_weights
    from models.factory import build_model_chunks
    from models.hf_io import SafetensorsReader

    raw = build_model_chunks(hf_config, params_dtype=dtype, **model_overrides)
    if load_weights:
        load_hf_weights(raw, SafetensorsReader(weights_dir), hf_config)
    config = raw[0].config
    config.finalize_model_grads_func = finalize_grads
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=optim_cfg.distributed_optimizer,
        overlap_grad_reduce=False,
        average_in_collective=False,
    )
    chunks = [DistributedDataParallel(config, ddp_config, module=c,
                                      disable_bucketing=i > 0)
              for i, c in enumerate(raw)]
    for c in chunks:
        c.broadcast_params()
    opt_config = OptimizerConfig(
        optimizer="adam", lr=optim_cfg.lr, min_lr=optim_cfg.min_lr,
        weight_decay=optim_cfg.weight_decay, adam_beta1=optim_cfg.betas[0],
        adam_beta2=optim_cfg.betas[1], adam_eps=optim_cfg.eps, clip_grad=optim_cfg.clip_grad,
        bf16=dtype == torch.bfloat16, params_dtype=dtype,
        use_distributed_optimizer=optim_cfg.distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, chunks)
    decay_steps = max(max_steps, optim_cfg.warmup_steps + 1)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if optim_cfg.warmup_steps else optim_cfg.lr,
        max_lr=optim_cfg.lr,
        min_lr=optim_cfg.min_lr if optim_cfg.schedule == "cosine" else optim_cfg.lr,
        lr_warmup_steps=optim_cfg.warmup_steps, lr_decay_steps=decay_steps,
        lr_decay_style="cosine" if optim_cfg.schedule == "cosine" else "constant",
        start_wd=optim_cfg.weight_decay, end_wd=optim_cfg.weight_decay,
        wd_incr_steps=decay_steps, wd_incr_style="constant")
    return TrainState(chunks, optimizer, scheduler, hf_config, hf_config["vocab_size"])


def current_lr(optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])
