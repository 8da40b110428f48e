"""The trained engine of an SFT-shaped run (SFT, DPO, reward models): one builder from the configuration tree.

Collective: every rank builds its model chunks (HF weights, or resumed from checkpoint.dir by
engine.run.run_loop.build_or_resume at any layout).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from engine.checkpoint.checkpointing import DataPosition
from engine.config.compile_settings import compile_overrides
from engine.config.fusion_settings import fusion_overrides
from engine.config.lora_settings import lora_build_kwargs
from engine.config.micro_batch_defaults import apply_sft_micro_batching
from engine.config.model_settings import describe as describe_settings, megatron_overrides
from engine.config.moe_settings import moe_overrides
from engine.config.mtp_settings import mtp_training
from engine.training.muon import megatron_distributed_optimizer
from engine.config.parallel_settings import overlap_settings
from engine.run.run_loop import build_or_resume
from engine.training.loss_head import DEFAULT_LOSS_CHUNK_TOKENS
from engine.training.train_engine import BatchSettings, TrainEngine


def build_train_engine(cfg, hf_config: dict, pad_id: int, position: DataPosition,
                       tag: str, reader=None, prepare=None, hidden_states: bool = False
                       ) -> tuple[TrainEngine, DataPosition]:
    """The trained engine of an SFT-shaped run (SFT, DPO, reward models) from the model, optim,
    parallel, train (train.compile included), MoE, fusion, LoRA and vision keys, with HF weights or resumed from
    checkpoint.dir (build_or_resume; collective). Returns (engine, the data position to
    continue from). `reader`, `prepare`: as TrainEngine.build's (a reward model's trunk and
    score head); `hidden_states`: the loss functions take hidden states (the chunked head's
    path, train.loss_chunk_tokens or its default), as a score head needs."""
    micro = apply_sft_micro_batching(cfg, hf_config)   # before anything reads train.*
    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    chunk_tokens = cfg.train.loss_chunk_tokens or (DEFAULT_LOSS_CHUNK_TOKENS if hidden_states
                                                   else None)
    engine, resumed, _ = build_or_resume(cfg, lambda load: TrainEngine.build(
        hf_config, cfg.optim, dtype, cfg.train.max_steps, BatchSettings.from_config(cfg.train),
        pad_id, weights_dir=cfg.model.hf_path, load_weights=load, reader=reader,
        prepare=prepare,
        overlap=overlap_settings(cfg.parallel, megatron_distributed_optimizer(cfg.optim)),
        loss_chunk_tokens=chunk_tokens,
        **megatron_overrides(cfg.parallel, cfg.train), **moe_overrides(cfg, hf_config),
        **fusion_overrides(cfg, hf_config), **lora_build_kwargs(cfg, hf_config),
        **compile_overrides(cfg), train_vision=not cfg.model.vision.freeze, mtp=mtp_training(cfg)),
        position)
    if dist.get_rank() == 0:
        print(f"[{tag}] model: {describe_settings(engine.chunks[0].config)}", flush=True)
        print(f"[{tag}] {micro}", flush=True)
    return engine, resumed
