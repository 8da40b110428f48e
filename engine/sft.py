"""Supervised fine-tuning entry point.

    torchrun --nproc_per_node N -m engine.sft model.hf_path=DIR data.train_files=[a.jsonl] \
        parallel.tp=2 train.global_batch_size=16 train.max_steps=100 loss.agg_mode=token-mean \
        checkpoint.dir=runs/x/checkpoints checkpoint.save_interval=50
    python -m engine.sft --config recipes/sft/qwen3_8b_h100.yaml --validate --world-size 16 \
        --nodes 2                      (layout/memory check of a recipe; no training)

One optimizer step (DESIGN section 3): the global mini-batch of step k (layout-independent
order) -> per-sequence weights from global counts (GlobalLossNormalizer, DP group only) ->
balanced DP partition and micro-batches -> CP shards -> megatron forward/backward (weighted
sums) -> gradients summed over DP x CP -> optimizer step. Metrics go to metrics.jsonl and
TensorBoard on rank 0.

Checkpoints (engine.checkpointing): with checkpoint.dir set, the run saves every
checkpoint.save_interval steps and on exit, and (checkpoint.resume=auto) continues from the
newest complete checkpoint in that directory, at any layout: steps already done are not re-run,
the data stream continues at the saved step.
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


def train_step(state, seqs, normalizer, train_cfg, pad_id: int = 0, step: int = 0
               ) -> dict[str, float]:
    """Optimizer step number `step` (1-based) on the mini-batch `seqs`; returns globally reduced
    metrics. A non-finite loss or gradient skips the update (engine.nonfinite) and is counted in
    `state.guard`; the caller logs the step, then calls `state.guard.raise_if_diverged()`."""
    from engine.nonfinite import guarded_optimizer_step
    from engine.sft_batches import build_rank_batch
    from engine.step import reduce_reports, run_micro_batches
    from engine.trainer import current_lr

    t0 = time.perf_counter()
    batch = build_rank_batch(seqs, normalizer, train_cfg, pad_id)
    for chunk in state.chunks:
        chunk.zero_grad_buffer()
    state.optimizer.zero_grad()
    reports = run_micro_batches(state.chunks, batch.micro_batches, sft_loss_fn(state.vocab_size))
    sums = reduce_reports(reports, ["loss", "num_loss_tokens"])
    stepped, grad_norm = guarded_optimizer_step(state.optimizer, sums["loss"])
    lr = current_lr(state.optimizer)
    if stepped:
        state.scheduler.step(increment=1)
    state.guard.record(step, stepped, sums["loss"], grad_norm)
    dt = time.perf_counter() - t0
    return {
        "loss": sums["loss"], "grad_norm": grad_norm, "lr": lr, "num_tokens": batch.num_tokens, "num_loss_tokens": sums["num_loss_tokens"],
        "num_sequences": len(seqs), "time/step_s": dt,
        "throughput/tokens_per_s": batch.num_tokens / dt if dt > 0 else 0.0,
        "batch/dp_imbalance": batch.plan.dp_imbalance,
        "batch/padding_fraction": batch.num_padding / max(batch.num_padding + batch.num_tokens, 1),
        "train/update_skipped": 0.0 if stepped else 1.0,
        "train/skipped_steps": float(state.guard.skipped),
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
    """`python -m engine.sft [--config FILE] [key=value ...] [--validate ...]`."""
    argv = list(argv if argv is not None else sys.argv[1:])
    if "--validate" in argv:  # recipe check: no process groups, no weights, no training
        from engine.recipe_validation import validate_main
        return validate_main(argv)
    from engine.cli import run_entry
    from engine.config import validate_sft
    return run_entry(_run, argv, validate=validate_sft)


def _log_sample_ids(log_dir: str, step: int, indices: list[int]) -> None:
    """Rank 0: append the dataset indices of optimizer step `step` to samples.jsonl."""
    import json
    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(log_dir, "samples.jsonl"), "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, "indices": indices}) + "\n")


def _run(cfg, hf_config, flags) -> int:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoTokenizer

    from engine.checkpoint_exit import StopMonitor, checkpoint_due, prepare_resumed_run
    from engine.checkpointing import (CheckpointError, DataPosition, ResumeMismatchError,
                                      load_training_checkpoint, save_training_checkpoint,
                                      select_resume_checkpoint)
    from engine.cli import fail
    from engine.config import config_yaml
    from engine.data import global_batch_indices, load_sft_dataset
    from engine.loss import GlobalLossNormalizer
    from engine.metrics import MetricsLogger, format_postfix, progress_bar
    from engine.nonfinite import NonFiniteGuard
    from engine.trainer import build_train_state

    rank = dist.get_rank()
    ck = cfg.checkpoint
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
            print(f"[sft] eval data: {eval_ds.describe()}", flush=True)
    if rank == 0:
        print(f"[sft] train data: {dataset.describe()}", flush=True)
    gbs = cfg.train.global_batch_size
    position = DataPosition(0, gbs, len(dataset), cfg.seed, cfg.data.shuffle)
    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    try:
        resume_from = select_resume_checkpoint(ck.resume, ck.dir)
        state = build_train_state(hf_config, cfg.optim, dtype, cfg.train.max_steps,
                                  weights_dir=cfg.model.hf_path,
                                  load_weights=resume_from is None)
        if resume_from is not None:
            position = load_training_checkpoint(state, resume_from, position)
    except (CheckpointError, ResumeMismatchError) as e:
        return fail(f"checkpoint: {e}")
    start = position.step
    # a skipped step advances the data position but not the LR schedule
    state.guard = NonFiniteGuard(cfg.train.max_consecutive_nonfinite_steps,
                                 skipped=start - state.scheduler.num_steps)
    if not prepare_resumed_run("sft", start, cfg.train.max_steps, cfg.logging.dir,
                               ("metrics.jsonl", "samples.jsonl")):
        return 0
    normalizer = GlobalLossNormalizer(cfg.loss.agg_mode,
                                      cfg.loss.norm_horizon or cfg.train.seq_length,
                                      cfg.loss.count_empty_sequences,
                                      group=ps.get_data_parallel_group())
    logger = MetricsLogger(cfg.logging.dir, enabled=rank == 0)
    bar = progress_bar(cfg.train.max_steps, enabled=rank == 0 and cfg.logging.progress_bar,
                       desc="sft", initial=start)
    monitor = StopMonitor(cfg.train.exit_interval, cfg.train.exit_duration_mins)
    yaml = config_yaml(cfg)
    first = last = None
    done = start
    try:
        for step in range(start, cfg.train.max_steps):
            idx = global_batch_indices(len(dataset), gbs, step, cfg.seed, cfg.data.shuffle)
            seqs = samples_to_sequences([dataset[i] for i in idx])
            metrics = train_step(state, seqs, normalizer, cfg.train, pad_id, step=step + 1)
            done = step + 1
            metrics["data/consumed_samples"] = done * gbs
            metrics["data/epoch"] = done * gbs / len(dataset)
            if eval_seqs is not None and done % cfg.train.eval_interval == 0:
                metrics["eval/loss"] = evaluate(state, eval_seqs, cfg, pad_id)
            logger.log(done, metrics)
            if rank == 0 and cfg.logging.sample_ids and cfg.logging.dir:
                _log_sample_ids(cfg.logging.dir, done, idx)
            bar.update(1)
            bar.set_postfix(format_postfix(metrics))
            state.guard.raise_if_diverged()
            first = metrics["loss"] if first is None else first
            last = metrics["loss"]
            stop = monitor.should_stop(done) if done < cfg.train.max_steps else None
            if checkpoint_due(ck, done, cfg.train.max_steps, stop):
                path = save_training_checkpoint(
                    state, ck.dir, DataPosition(done, gbs, len(dataset), cfg.seed,
                                                cfg.data.shuffle),
                    hf_config, cfg.model.hf_path, ck.keep_last, yaml)
                if rank == 0:
                    print(f"[checkpoint] saved {path}", flush=True)
            if stop is not None:
                if rank == 0:
                    print(f"[sft] stopping after step {done}: {stop}", flush=True)
                break
    except CheckpointError as e:
        return fail(f"checkpoint: {e}")
    finally:
        monitor.close()
        bar.close()
        logger.close()
    if rank == 0:
        print(f"[sft] done: {done} of {cfg.train.max_steps} steps, first loss {first:.4f}, "
              f"last loss {last:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
