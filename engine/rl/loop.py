"""GRPO / DAPO training loop.

    torchrun --nproc_per_node N -m engine.rl algorithm=grpo|dapo model.hf_path=DIR \
        data.train_files=[prompts.jsonl] rollout.n=8 train.prompts_per_step=32 \
        train.mini_batches_per_step=2 parallel.tp=2

One RL step (DESIGN section 9):
1. rollout (global rank 0; engine.rl.rollout_batch): prompts_per_step prompts x rollout.n
   responses in ONE generate call (more only with DAPO dynamic sampling), rewards, overlong
   shaping, group advantages; the token lists are broadcast to every rank;
2. old log-probs recomputed forward-only by the current policy, reference log-probs by a frozen
   copy of the initial policy (only when kl.beta > 0), in micro-batches;
3. epochs_per_rollout x mini_batches_per_step optimizer steps (engine.rl.update);
4. weight sync: every pipeline stage's HF export (TP-gathered by the TP group with DP = CP = 0)
   is streamed to global rank 0, which loads it into the rollout engine in buckets.
Rollout engine placement: one engine, on global rank 0 (simple and correct for the HF backend;
with SGLang rank 0's engine serves the whole job).
"""
from __future__ import annotations

import sys
import time
from typing import Iterator

import torch
import torch.distributed as dist

# Metrics averaged over the optimizer steps of one RL step.
_UPDATE_MEAN_KEYS = ("policy/loss", "policy/pg_loss", "policy/clipfrac_low",
                     "policy/clipfrac_high", "policy/kl", "policy/entropy", "grad_norm",
                     "train/update_skipped")


def main(argv: list[str] | None = None) -> int:
    from engine.cli import run_entry
    from engine.rl.config import RLConfig, rl_validator

    argv = list(argv if argv is not None else sys.argv[1:])
    return run_entry(_run, argv, schema=RLConfig, validate=rl_validator(argv))


# ----------------------------------------------------------------------------- weight sync

def _send_tensor(name: str | None, tensor: torch.Tensor | None, dst: int) -> None:
    dist.send_object_list([None if name is None else (name, tuple(tensor.shape), tensor.dtype)],
                          dst=dst)
    if name is not None:
        dist.send(tensor.contiguous(), dst=dst)


def _recv_stream(src: int) -> Iterator[tuple[str, torch.Tensor]]:
    from parallel import cpu_runtime

    while True:
        meta = [None]
        dist.recv_object_list(meta, src=src)
        if meta[0] is None:
            return
        name, shape, dtype = meta[0]
        buf = torch.empty(shape, dtype=dtype, device=cpu_runtime.device())
        dist.recv(buf, src=src)
        yield name, buf


def sync_to_rollout(chunks: list, hf_config: dict, engine, bucket_mb: float):
    """Stream the trainer's weights (HF names, full tensors) into `engine` on global rank 0.

    Collective over the world in effect: the TP group with DP = CP = 0 of every pipeline stage
    runs models.bridge.export_hf_weights (TP all-gathers); stage s > 0 sends its tensors to
    rank 0 point-to-point (its TP rank 0 sends). Returns SyncStats on rank 0, None elsewhere."""
    from megatron.core import parallel_state as ps

    from engine.rl.weight_sync import sync_weights
    from models.bridge import export_hf_weights

    exporter = ps.get_data_parallel_rank(with_context_parallel=True) == 0
    stage = ps.get_pipeline_model_parallel_rank()
    leader = exporter and ps.get_tensor_model_parallel_rank() == 0
    if dist.get_rank() == 0:
        stage_leaders = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())

        def stream():
            yield from export_hf_weights(chunks, hf_config)
            for src in stage_leaders[1:]:
                yield from _recv_stream(src)

        return sync_weights(stream(), engine, bucket_mb)
    if exporter:
        for name, tensor in export_hf_weights(chunks, hf_config):
            if leader and stage > 0:
                _send_tensor(name, tensor, dst=0)
        if leader and stage > 0:
            _send_tensor(None, None, dst=0)
    return None


def _probe_tokens(vocab_size: int, length: int = 24) -> torch.Tensor:
    return torch.tensor([[(7 * i + 3) % vocab_size for i in range(length)]])


def _engine_logits(engine, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return engine.model(input_ids=tokens.to(engine.device)).logits.float().cpu()


def check_weight_sync(chunks: list, vocab_size: int, engine, before: torch.Tensor | None
                      ) -> dict[str, float]:
    """Debug metrics after a sync: max |engine logits - trainer logits| on a fixed probe (fp32,
    models.forward.forward_logits; collective over the world, needs cp == 1 and an engine with
    a transformers `model`, i.e. the HF backend) and how far the engine's logits moved."""
    from models.forward import forward_logits

    probe = _probe_tokens(vocab_size)
    trainer = forward_logits(chunks, probe, vocab_size).cpu()
    if dist.get_rank() != 0:
        return {}
    after = _engine_logits(engine, probe)
    out = {"debug/sync_logit_max_diff": float((after - trainer).abs().max())}
    if before is not None:
        out["debug/sync_logit_change"] = float((after - before).abs().max())
    return out


# ----------------------------------------------------------------------------- one RL step

def _build_reference(hf_config: dict, dtype: torch.dtype, weights_dir: str) -> list:
    """A frozen copy of the initial policy (model chunks, no DDP, no optimizer)."""
    from models.bridge import load_hf_weights
    from models.factory import build_model_chunks
    from models.hf_io import SafetensorsReader

    chunks = build_model_chunks(hf_config, params_dtype=dtype)
    load_hf_weights(chunks, SafetensorsReader(weights_dir), hf_config)
    for c in chunks:
        c.eval().requires_grad_(False)
    return chunks


def train_on_rollout(state, ref_chunks, batch, cfg, step: int, pad_id: int) -> dict[str, float]:
    """Recompute old (and reference) log-probs, then run every mini-batch update of the step.
    Every rank passes the same rollout batch; returns the metrics of the policy side."""
    from engine.rl.rollout_batch import build_sequences
    from engine.rl.update import (PolicyLossSettings, attach_extra, compute_token_logprobs,
                                  logprob_gap, policy_update, split_mini_batches)

    t0 = time.perf_counter()
    seqs = build_sequences(batch)
    T = cfg.rollout.temperature
    old = compute_token_logprobs(state.chunks, seqs, cfg.train, state.vocab_size, T, pad_id)
    attach_extra(seqs, "old_logprobs", old)
    gap_mean, gap_max = logprob_gap(seqs, old)
    if ref_chunks is not None:
        ref = compute_token_logprobs(ref_chunks, seqs, cfg.train, state.vocab_size, T, pad_id)
        attach_extra(seqs, "ref_logprobs", ref)
    metrics = {"rollout/logprob_diff": gap_mean, "rollout/logprob_diff_max": gap_max,
               "time/logprob_s": time.perf_counter() - t0}
    settings = PolicyLossSettings.from_config(cfg, state.vocab_size)
    horizon = cfg.loss.norm_horizon or cfg.rollout.max_new_tokens
    updates = []
    for epoch in range(cfg.train.epochs_per_rollout):
        for part in split_mini_batches(len(seqs), cfg.train.mini_batches_per_step, cfg.seed,
                                       step, epoch, cfg.data.shuffle):
            updates.append(policy_update(state, [seqs[i] for i in part], cfg.loss, cfg.train,
                                         settings, horizon, pad_id))
    for key in _UPDATE_MEAN_KEYS:
        metrics[key] = sum(u[key] for u in updates) / len(updates)
    metrics["lr"] = updates[-1]["lr"]
    metrics["train/optimizer_steps"] = float(len(updates))
    metrics["train/micro_batches"] = sum(u["train/micro_batches"] for u in updates)
    metrics["train/response_tokens"] = sum(u["policy/response_tokens"] for u in updates)
    return metrics


def rl_step(state, ref_chunks, collector, engine, cfg, hf_config, step: int, pad_id: int
            ) -> dict[str, float]:
    """One RL step on every rank (collective over the world); metrics are complete on rank 0."""
    from engine.rl.rollout_batch import broadcast_rollout

    t0 = time.perf_counter()
    batch = None
    if collector is not None:
        try:
            batch = collector.collect()
        except Exception as e:  # every rank must learn about it, or they would wait forever
            batch = e
        if cfg.rollout.sleep_during_train and not isinstance(batch, Exception):
            engine.sleep()
    batch = broadcast_rollout(batch)
    metrics = dict(batch.metrics)
    t1 = time.perf_counter()
    if len(batch):
        metrics.update(train_on_rollout(state, ref_chunks, batch, cfg, step, pad_id))
    else:
        metrics["train/update_skipped"] = 1.0
    metrics["time/train_s"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    # the weights changed, or the sleeping engine dropped them: stream them (same on all ranks)
    sync = len(batch) > 0 or cfg.rollout.sleep_during_train
    check = (sync and cfg.rollout.check_weight_sync and cfg.parallel.cp == 1
             and cfg.rollout.backend == "hf")
    before = None
    if engine is not None:
        if check and not engine.is_asleep:
            before = _engine_logits(engine, _probe_tokens(state.vocab_size))
        if cfg.rollout.sleep_during_train:
            engine.wake()
    stats = (sync_to_rollout(state.chunks, hf_config, engine, cfg.rollout.sync_bucket_mb)
             if sync else None)
    metrics["time/weight_sync_s"] = time.perf_counter() - t2
    if stats is not None:
        metrics["weight_sync/gbps"] = stats.gbps
        metrics["weight_sync/buckets"] = float(stats.num_buckets)
    if check:
        metrics.update(check_weight_sync(state.chunks, state.vocab_size, engine, before))
    metrics["time/step_s"] = time.perf_counter() - t0
    return metrics


# ----------------------------------------------------------------------------- entry

def _make_engine(cfg, dtype: torch.dtype):
    from engine.rl.rollout import make_rollout_engine

    if cfg.rollout.backend == "hf":
        return make_rollout_engine("hf", cfg.model.hf_path, dtype=dtype)
    return make_rollout_engine("sglang", cfg.model.hf_path, tp_size=cfg.rollout.sglang_tp_size,
                               mem_fraction_static=cfg.rollout.sglang_mem_fraction,
                               random_seed=cfg.seed)


def _run(cfg, hf_config, flags) -> int:
    from transformers import AutoTokenizer

    from engine.data import load_prompt_rows
    from engine.metrics import MetricsLogger, format_postfix, progress_bar
    from engine.rl.rewards import load_reward_fn
    from engine.rl.rollout_batch import RolloutCollector
    from engine.trainer import build_train_state

    rank = dist.get_rank()
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    optimizer_steps = (cfg.train.max_steps * cfg.train.mini_batches_per_step
                       * cfg.train.epochs_per_rollout)
    state = build_train_state(hf_config, cfg.optim, dtype, optimizer_steps,
                              weights_dir=cfg.model.hf_path)
    ref_chunks = (_build_reference(hf_config, dtype, cfg.model.hf_path) if cfg.kl.beta > 0
                  else None)
    rows = load_prompt_rows(cfg.data.train_files)  # every rank: data errors stop every rank
    engine = collector = None
    if rank == 0:
        engine = _make_engine(cfg, dtype)
        collector = RolloutCollector(engine, rows, tokenizer, load_reward_fn(cfg.reward.fn), cfg)
        print(f"[rl] {cfg.algorithm}: {len(rows)} prompts, {cfg.train.prompts_per_step} x "
              f"{cfg.rollout.n} responses per step, rollout backend {cfg.rollout.backend}",
              flush=True)
    logger = MetricsLogger(cfg.logging.dir, enabled=rank == 0)
    bar = progress_bar(cfg.train.max_steps, enabled=rank == 0 and cfg.logging.progress_bar,
                       desc=cfg.algorithm)
    rewards = []
    for step in range(cfg.train.max_steps):
        metrics = rl_step(state, ref_chunks, collector, engine, cfg, hf_config, step, pad_id)
        logger.log(step + 1, metrics)
        bar.update(1)
        bar.set_postfix({**format_postfix(metrics),
                         "reward": f"{metrics['reward/mean']:.3f}"})
        rewards.append(metrics["reward/mean"])
    bar.close()
    logger.close()
    if hasattr(engine, "shutdown"):
        engine.shutdown()
    if rank == 0:
        print(f"[rl] done: {cfg.train.max_steps} steps, first reward {rewards[0]:.4f}, "
              f"last reward {rewards[-1]:.4f}", flush=True)
    return 0
