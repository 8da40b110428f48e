"""Supervised fine-tuning entry point.

    torchrun --nproc_per_node N -m engine.sft model.hf_path=DIR data.train_files=[a.jsonl] \
        parallel.tp=2 train.global_batch_size=16 train.max_steps=100 loss.agg_mode=token-mean

One optimizer step (DESIGN section 3): the global mini-batch of step k (layout-independent
order) -> per-sequence weights from global counts (GlobalLossNormalizer, DP group only) ->
balanced DP partition and micro-batches -> CP shards -> megatron forward/backward (weighted
sums) -> gradients summed over DP x CP -> optimizer step. Metrics go to metrics.jsonl and
TensorBoard on rank 0.
"""
from __future__ import annotations

import os
import sys
import time

import torch


def sft_loss_fn(vocab_size: int):
    """Loss function for engine.step: weighted token cross-entropy (engine.loss contract)."""
    from engine.loss import aggregate
    from engine.token_losses import token_logprobs

    def loss_fn(logits, mb):
        nll = -token_logprobs(logits, mb.labels, vocab_size)
        loss = aggregate(nll, mb.token_weights)
        return loss, {"loss": loss, "num_loss_tokens": mb.loss_mask.sum()}

    return loss_fn


def samples_to_sequences(samples) -> list:
    from engine.micro_batches import SequenceData
    return [SequenceData(s.tokens, s.labels, s.loss_mask) for s in samples]


def train_step(state, seqs, normalizer, train_cfg, pad_id: int = 0) -> dict[str, float]:
    """One optimizer step on the mini-batch `seqs`; returns globally reduced metrics."""
    from engine.sft_batches import build_rank_batch
    from engine.step import reduce_reports, run_micro_batches
    from engine.trainer import current_lr

    t0 = time.perf_counter()
    batch = build_rank_batch(seqs, normalizer, train_cfg, pad_id)
    for chunk in state.chunks:
        chunk.zero_grad_buffer()
    state.optimizer.zero_grad()
    reports = run_micro_batches(state.chunks, batch.micro_batches, sft_loss_fn(state.vocab_size))
    ok, grad_norm, _ = state.optimizer.step()
    lr = current_lr(state.optimizer)
    state.scheduler.step(increment=1)
    sums = reduce_reports(reports, ["loss", "num_loss_tokens"])
    dt = time.perf_counter() - t0
    return {
        "loss": sums["loss"], "grad_norm": float(grad_norm) if grad_norm is not None else 0.0,
        "lr": lr, "num_tokens": batch.num_tokens, "num_loss_tokens": sums["num_loss_tokens"],
        "num_sequences": len(seqs), "time/step_s": dt,
        "throughput/tokens_per_s": batch.num_tokens / dt if dt > 0 else 0.0,
        "batch/dp_imbalance": batch.plan.dp_imbalance,
        "batch/padding_fraction": batch.num_padding / max(batch.num_padding + batch.num_tokens, 1),
        "train/update_skipped": 0.0 if ok else 1.0,
    }


def evaluate(state, eval_seqs, cfg, pad_id: int = 0) -> float:
    """Exact global eval loss of the configured aggregation mode over the whole eval set:
    weights from the counts of all eval sequences, forward-only in chunks of the global batch."""
    from engine.loss import weights_from_counts
    from engine.sft_batches import build_rank_batch
    from engine.step import reduce_reports, run_micro_batches

    counts = torch.tensor([int(sum(s.loss_mask)) for s in eval_seqs])
    seqs_counted = counts.numel() if cfg.loss.count_empty_sequences else int((counts > 0).sum())
    horizon = cfg.loss.norm_horizon or cfg.train.seq_length
    weights = weights_from_counts(counts, float(counts.sum()), float(seqs_counted),
                                  cfg.loss.agg_mode, horizon)

    total = 0.0
    gbs = cfg.train.global_batch_size
    for start in range(0, len(eval_seqs), gbs):
        batch = build_rank_batch(eval_seqs[start:start + gbs], weights[start:start + gbs],
                                 cfg.train, pad_id)
        with torch.no_grad():
            reports = run_micro_batches(state.chunks, batch.micro_batches,
                                        sft_loss_fn(state.vocab_size), forward_only=True)
        total += reduce_reports(reports, ["loss"])["loss"]
    return total


def main(argv: list[str] | None = None) -> int:
    from engine.cli import run_entry
    return run_entry(_run, argv if argv is not None else sys.argv[1:])


def _run(cfg, hf_config, flags) -> int:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoTokenizer

    from engine.data import global_batch_indices, load_sft_dataset
    from engine.loss import GlobalLossNormalizer
    from engine.metrics import MetricsLogger, format_postfix, progress_bar
    from engine.trainer import build_train_state

    rank = dist.get_rank()
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    dataset = load_sft_dataset(cfg.data.train_files, tokenizer, cfg.train.seq_length,
                               cfg.data.truncation)
    eval_seqs = None
    if cfg.data.eval_files and cfg.train.eval_interval > 0:
        eval_ds = load_sft_dataset(cfg.data.eval_files, tokenizer, cfg.train.seq_length,
                                   cfg.data.truncation)
        eval_seqs = samples_to_sequences([eval_ds[i] for i in range(len(eval_ds))])
    if rank == 0:
        print(f"[sft] {len(dataset)} samples; data stats {dataset.stats}", flush=True)
    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    state = build_train_state(hf_config, cfg.optim, dtype, cfg.train.max_steps,
                              weights_dir=cfg.model.hf_path)
    normalizer = GlobalLossNormalizer(cfg.loss.agg_mode,
                                      cfg.loss.norm_horizon or cfg.train.seq_length,
                                      cfg.loss.count_empty_sequences,
                                      group=ps.get_data_parallel_group())
    logger = MetricsLogger(cfg.logging.dir, enabled=rank == 0)
    bar = progress_bar(cfg.train.max_steps, enabled=rank == 0 and cfg.logging.progress_bar,
                       desc="sft")
    first = last = None
    for step in range(cfg.train.max_steps):
        idx = global_batch_indices(len(dataset), cfg.train.global_batch_size, step, cfg.seed,
                                   cfg.data.shuffle)
        seqs = samples_to_sequences([dataset[i] for i in idx])
        metrics = train_step(state, seqs, normalizer, cfg.train, pad_id)
        if eval_seqs is not None and (step + 1) % cfg.train.eval_interval == 0:
            metrics["eval/loss"] = evaluate(state, eval_seqs, cfg, pad_id)
        logger.log(step + 1, metrics)
        bar.update(1)
        bar.set_postfix(format_postfix(metrics))
        first = metrics["loss"] if first is None else first
        last = metrics["loss"]
    bar.close()
    logger.close()
    if rank == 0:
        print(f"[sft] done: {cfg.train.max_steps} steps, first loss {first:.4f}, "
              f"last loss {last:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
