"""One SFT run: data, TrainEngine, and the run loop (docs/design/architecture.md).

One optimizer step: the global mini-batch of step k (layout-independent order,
engine.data.datasets.global_batch_indices) -> `train_step`: TrainEngine.train_batch with the weighted
token cross-entropy (weights from the GlobalLossNormalizer over the DP group) -> metrics,
logged by engine.run.run_loop.RunLoop on rank 0 (metrics.jsonl, TensorBoard).

Checkpoints (engine.checkpoint.checkpointing): with checkpoint.dir set, the run saves every
checkpoint.save_interval steps and on exit, and (checkpoint.resume=auto) continues from the
newest complete checkpoint in that directory, at any layout: steps already done are not re-run,
the data stream continues at the saved step.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from engine.checkpoint.checkpointing import DataPosition
from engine.config.schema import SFTConfig
from engine.data.datasets import global_batch_indices, load_sft_dataset
from engine.data.images import image_context
from engine.training.loss import GlobalLossNormalizer, aggregate, weights_from_counts
from engine.training.micro_batches import SequenceData
from engine.training.nonfinite import NonFiniteGuard
from engine.run.run_loop import RunLoop
from engine.run.train_engine_build import build_train_engine
from engine.training.schedule import LossFn
from engine.training.token_losses import token_logprobs
from engine.training.train_engine import TrainEngine
from models.hf.custom_code import load_tokenizer
from models.vision.spec import vision_spec

SFT_REPORT_KEYS = ("loss", "num_loss_tokens")


def sft_loss_fn(vocab_size: int) -> LossFn:
    """Weighted token cross-entropy (engine.training.loss contract), reporting SFT_REPORT_KEYS.
    `logits`: [b, s, V/tp] or, with the chunked loss head, a loss_head.HiddenStates."""

    def loss_fn(logits, mb):
        nll = -token_logprobs(logits, mb.labels, vocab_size)
        loss = aggregate(nll, mb.token_weights)
        return loss, {"loss": loss, "num_loss_tokens": mb.loss_mask.sum()}

    return loss_fn


def samples_to_sequences(samples) -> list[SequenceData]:
    return [SequenceData(s.tokens, s.labels, s.loss_mask, vision=s.vision) for s in samples]


def train_step(engine: TrainEngine, seqs: list[SequenceData],
               normalizer: GlobalLossNormalizer) -> dict[str, float]:
    """One optimizer step on the mini-batch `seqs`; returns globally reduced metrics. A
    non-finite loss or gradient skips the update (engine.training.nonfinite), counted in engine.guard."""
    out = engine.train_batch(seqs, normalizer, sft_loss_fn(engine.vocab_size), SFT_REPORT_KEYS)
    tokens, padding, dt = out["batch/num_tokens"], out["batch/num_padding"], out["time/step_s"]
    memory = {}
    if torch.cuda.is_available():  # False on a CPU host: no memory/* metric there
        memory["memory/max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return {
        "loss": out["loss"], "grad_norm": out["grad_norm"], "lr": out["lr"],
        "num_tokens": int(tokens), "num_loss_tokens": out["num_loss_tokens"],
        "num_sequences": len(seqs), "time/step_s": dt,
        "throughput/tokens_per_s": tokens / dt if dt > 0 else 0.0,
        "batch/dp_imbalance": out["batch/dp_imbalance"],
        "batch/padding_fraction": padding / max(padding + tokens, 1),
        "train/update_skipped": out["train/update_skipped"],
        "train/skipped_steps": float(engine.guard.skipped),
        "train/prefix_token_ratio": out["train/prefix_token_ratio"],   # train.prefix_sharing
        **{k: v for k, v in out.items() if k.startswith("moe/")},  # MoE models only
        **{k: v for k, v in out.items() if k.startswith("mtp/")},  # model.mtp.enabled only
        **{k: v for k, v in out.items() if k.startswith("compile/")},  # train.compile only
        **memory,  # this rank's peak allocated GPU memory so far (GPU runs only)
    }


def evaluate(engine: TrainEngine, eval_seqs: list[SequenceData], cfg: SFTConfig) -> float:
    """Exact global eval loss of the configured aggregation mode over the whole eval set:
    weights from the counts of all eval sequences, forward-only in chunks of the global batch."""
    counts = torch.tensor([int(sum(s.loss_mask)) for s in eval_seqs])
    seqs_counted = counts.numel() if cfg.loss.count_empty_sequences else int((counts > 0).sum())
    horizon = cfg.loss.norm_horizon or cfg.train.seq_length
    weights = weights_from_counts(counts, float(counts.sum()), float(seqs_counted),
                                  cfg.loss.agg_mode, horizon)
    gbs = cfg.train.global_batch_size
    return sum(engine.forward_only(eval_seqs[i:i + gbs], weights[i:i + gbs],
                                   sft_loss_fn(engine.vocab_size), ["loss"])["loss"]
               for i in range(0, len(eval_seqs), gbs))


def _load_data(cfg: SFTConfig, tokenizer, hf_config: dict):
    """(train dataset, eval sequences or None); rank 0 prints what was loaded."""
    cache = dict(cache_dir=cfg.data.cache_dir, num_workers=cfg.data.num_workers,
                 images=image_context(cfg.model.hf_path, vision_spec(hf_config)))
    dataset = load_sft_dataset(cfg.data.train_files, tokenizer, cfg.train.seq_length,
                               cfg.data.truncation, **cache)
    eval_seqs = None
    if cfg.data.eval_files and cfg.train.eval_interval > 0:
        eval_ds = load_sft_dataset(cfg.data.eval_files, tokenizer, cfg.train.seq_length,
                                   cfg.data.truncation, **cache)
        eval_seqs = samples_to_sequences([eval_ds[i] for i in range(len(eval_ds))])
        if dist.get_rank() == 0:
            print(f"[sft] eval data: {eval_ds.describe()}", flush=True)
    if dist.get_rank() == 0:
        print(f"[sft] train data: {dataset.describe()}", flush=True)
    return dataset, eval_seqs


def _log_sample_ids(log_dir: str, step: int, indices: list[int]) -> None:
    """Rank 0: append the dataset indices of optimizer step `step` to samples.jsonl."""
    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(log_dir, "samples.jsonl"), "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, "indices": indices}) + "\n")


def run(cfg: SFTConfig, hf_config: dict, flags: list[str]) -> int:
    """The SFT run on every rank (process groups and megatron state exist)."""
    tokenizer = load_tokenizer(cfg.model.hf_path, cfg.model.trust_remote_code)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    dataset, eval_seqs = _load_data(cfg, tokenizer, hf_config)
    gbs, n = cfg.train.global_batch_size, len(dataset)

    def position(done: int) -> DataPosition:
        return DataPosition(done, gbs, n, cfg.seed, cfg.data.shuffle)

    engine, resumed = build_train_engine(cfg, hf_config, pad_id, position(0), "sft")
    start = resumed.step
    loop = RunLoop("sft", cfg, engine, hf_config, position,
                   log_names=("metrics.jsonl", "samples.jsonl"))
    if not loop.prepare(start):
        return 0
    # a skipped step advances the data position but not the LR schedule
    engine.guard = NonFiniteGuard(cfg.train.max_consecutive_nonfinite_steps,
                                  skipped=start - engine.scheduler.num_steps)
    normalizer = GlobalLossNormalizer(cfg.loss.agg_mode,
                                      cfg.loss.norm_horizon or cfg.train.seq_length,
                                      cfg.loss.count_empty_sequences,
                                      group=ps.get_data_parallel_group())

    def step_fn(step: int) -> dict:
        idx = global_batch_indices(n, gbs, step, cfg.seed, cfg.data.shuffle)
        metrics = train_step(engine, samples_to_sequences([dataset[i] for i in idx]), normalizer)
        done = step + 1
        metrics["data/consumed_samples"] = done * gbs
        metrics["data/epoch"] = done * gbs / n
        if eval_seqs is not None and done % cfg.train.eval_interval == 0:
            metrics["eval/loss"] = evaluate(engine, eval_seqs, cfg)
        if dist.get_rank() == 0 and cfg.logging.sample_ids and cfg.logging.dir:
            _log_sample_ids(cfg.logging.dir, done, idx)
        return metrics

    loop.print_done(start, loop.run(start, step_fn))
    return 0
