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

Checkpoints (engine.checkpointing, as for SFT): with checkpoint.dir set, the run saves every
checkpoint.save_interval RL steps and on exit (end, train.exit_interval,
train.exit_duration_mins, SIGTERM/SIGUSR1/SIGINT; checkpoint.save_on_exit) the policy's model,
optimizer and scheduler, the data position (RL steps done, prompts_per_step, prompt rows, seed,
shuffle) and, as the checkpoint's `extra`, the collector's next_gen_batch (ahead of the step
count with DAPO dynamic sampling). checkpoint.resume=auto continues from the newest complete
checkpoint: the policy is loaded from it, the rollout engine (started from model.hf_path) is
synced with it before the first rollout, the KL reference stays the initial policy
(model.hf_path), and metrics.jsonl is trimmed to the resumed step.
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

    if cfg.rollout.backend == "sglang":
        return make_rollout_engine("sglang", cfg.model.hf_path,
                                   tp_size=cfg.rollout.sglang_tp_size,
                                   mem_fraction_static=cfg.rollout.sglang_mem_fraction,
                                   random_seed=cfg.seed)
    # hf, or a user's package.module:Class backend (constructed like the HF one)
    return make_rollout_engine(cfg.rollout.backend, cfg.model.hf_path, dtype=dtype)


def _data_position(cfg, steps_done: int, num_rows: int):
    """The RL run's DataPosition: RL steps done, prompts per step, prompt rows, seed, shuffle
    (the prompt order of generation batch b depends on these only, engine.rl.rollout_batch)."""
    from engine.checkpointing import DataPosition

    return DataPosition(steps_done, cfg.train.prompts_per_step, num_rows, cfg.seed,
                        cfg.data.shuffle)


def _resume_or_build(cfg, hf_config, dtype: torch.dtype, num_rows: int):
    """Collective: the policy's TrainState, from model.hf_path or, when checkpoint.resume finds
    a checkpoint, from it (model, optimizer, scheduler). Returns (state, RL steps done, the
    rollout collector's next generation batch). Raises CheckpointError / ResumeMismatchError."""
    from engine.checkpointing import (load_training_checkpoint, read_checkpoint_info,
                                      select_resume_checkpoint)
    from engine.nonfinite import NonFiniteGuard
    from engine.trainer import build_train_state

    ck = cfg.checkpoint
    resume_from = select_resume_checkpoint(ck.resume, ck.dir)
    optimizer_steps = (cfg.train.max_steps * cfg.train.mini_batches_per_step
                       * cfg.train.epochs_per_rollout)
    state = build_train_state(hf_config, cfg.optim, dtype, optimizer_steps,
                              weights_dir=cfg.model.hf_path, load_weights=resume_from is None)
    state.guard = NonFiniteGuard(cfg.train.max_consecutive_nonfinite_steps)
    if resume_from is None:
        return state, 0, 0
    saved = load_training_checkpoint(state, resume_from, _data_position(cfg, 0, num_rows),
                                     batch_key="train.prompts_per_step")
    extra = read_checkpoint_info(resume_from)["extra"]
    state.guard.skipped = int(extra.get("skipped_steps", 0))
    return state, saved.step, int(extra.get("next_gen_batch", saved.step))


def _next_gen_batch(collector) -> int:
    """Collective: rank 0's collector.next_gen_batch on every rank (the checkpoint's common
    state must be the same on every rank)."""
    box = [collector.next_gen_batch if collector is not None else None]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


def _save(state, cfg, hf_config, steps_done: int, num_rows: int, collector,
          yaml: str) -> None:
    """Collective: checkpoint after `steps_done` RL steps, with the collector's next_gen_batch
    and the count of skipped (non-finite) optimizer steps as the checkpoint's `extra`; `yaml`
    is the resolved configuration. Raises CheckpointError on every rank when the save
    failed."""
    from engine.checkpointing import save_training_checkpoint

    ck = cfg.checkpoint
    extra = {"next_gen_batch": _next_gen_batch(collector),
             "skipped_steps": state.guard.skipped}
    path = save_training_checkpoint(state, ck.dir, _data_position(cfg, steps_done, num_rows),
                                    hf_config, cfg.model.hf_path, ck.keep_last, yaml,
                                    extra=extra)
    if dist.get_rank() == 0:
        print(f"[checkpoint] saved {path}", flush=True)


def _train(state, ref_chunks, collector, engine, cfg, hf_config, pad_id: int, start: int,
           num_rows: int) -> tuple[int, list[float]]:
    """Collective: RL steps start+1 .. train.max_steps, with checkpoints every
    checkpoint.save_interval steps and on exit (checkpoint.save_on_exit), stopping early when
    engine.checkpoint_exit.StopMonitor says so. Returns (RL steps done, reward/mean of each
    step run here)."""
    from engine.checkpoint_exit import StopMonitor, checkpoint_due
    from engine.config import config_yaml
    from engine.metrics import MetricsLogger, format_postfix, progress_bar

    rank, ck, max_steps = dist.get_rank(), cfg.checkpoint, cfg.train.max_steps
    logger = MetricsLogger(cfg.logging.dir, enabled=rank == 0)
    bar = progress_bar(max_steps, enabled=rank == 0 and cfg.logging.progress_bar,
                       desc=cfg.algorithm, initial=start)
    monitor = StopMonitor(cfg.train.exit_interval, cfg.train.exit_duration_mins)
    yaml = config_yaml(cfg)
    rewards, done = [], start
    try:
        for step in range(start, max_steps):
            metrics = rl_step(state, ref_chunks, collector, engine, cfg, hf_config, step, pad_id)
            metrics["train/skipped_steps"] = float(state.guard.skipped)
            done = step + 1
            logger.log(done, metrics)
            state.guard.raise_if_diverged()  # after logging: the bad steps are in the log
            bar.update(1)
            bar.set_postfix({**format_postfix(metrics),
                             "reward": f"{metrics['reward/mean']:.3f}"})
            rewards.append(metrics["reward/mean"])
            stop = monitor.should_stop(done) if done < max_steps else None
            if checkpoint_due(ck, done, max_steps, stop):
                _save(state, cfg, hf_config, done, num_rows, collector, yaml)
            if stop is not None:
                if rank == 0:
                    print(f"[rl] stopping after step {done}: {stop}", flush=True)
                break
    finally:
        monitor.close()
        bar.close()
        logger.close()
    return done, rewards


def _run(cfg, hf_config, flags) -> int:
    from transformers import AutoTokenizer

    from engine.checkpoint_exit import prepare_resumed_run
    from engine.checkpointing import CheckpointError, ResumeMismatchError
    from engine.cli import fail
    from engine.data import load_prompt_rows
    from engine.rl.rewards import load_reward_fn
    from engine.rl.rollout_batch import RolloutCollector, fit_prompt_rows

    rank = dist.get_rank()
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    # every rank, before the model is built: data errors stop every rank at once
    locations: list[str] = []
    rows, prompt_ids = fit_prompt_rows(load_prompt_rows(cfg.data.train_files, locations),
                                       locations, tokenizer, cfg)
    try:
        state, start, next_gen_batch = _resume_or_build(cfg, hf_config, dtype, len(rows))
    except (CheckpointError, ResumeMismatchError) as e:
        return fail(f"checkpoint: {e}")
    if not prepare_resumed_run("rl", start, cfg.train.max_steps, cfg.logging.dir,
                               ("metrics.jsonl",)):
        return 0
    # the KL reference is the initial policy (model.hf_path), also after a resume
    ref_chunks = (_build_reference(hf_config, dtype, cfg.model.hf_path) if cfg.kl.beta > 0
                  else None)
    engine = collector = None
    if rank == 0:
        engine = _make_engine(cfg, dtype)
        collector = RolloutCollector(engine, rows, tokenizer, load_reward_fn(cfg.reward.fn), cfg,
                                     prompt_ids)
        collector.next_gen_batch = next_gen_batch
        print(f"[rl] {cfg.algorithm}: {len(rows)} prompts, {cfg.train.prompts_per_step} x "
              f"{cfg.rollout.n} responses per step, rollout backend {cfg.rollout.backend}",
              flush=True)
    try:
        if start > 0:  # the engine holds model.hf_path's weights: give it the trained ones
            sync_to_rollout(state.chunks, hf_config, engine, cfg.rollout.sync_bucket_mb)
            if rank == 0:
                print(f"[rl] resumed at step {start} of {cfg.train.max_steps} (next generation "
                      f"batch {next_gen_batch}); rollout engine synced with the checkpoint's "
                      "weights", flush=True)
        done, rewards = _train(state, ref_chunks, collector, engine, cfg, hf_config, pad_id,
                               start, len(rows))
    except CheckpointError as e:
        return fail(f"checkpoint: {e}")
    finally:
        if hasattr(engine, "shutdown"):
            engine.shutdown()
    if rank == 0:
        print(f"[rl] done: {done} of {cfg.train.max_steps} steps, first reward "
              f"{rewards[0]:.4f}, last reward {rewards[-1]:.4f}", flush=True)
    return 0
