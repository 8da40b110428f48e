"""One RL run (GRPO, DAPO, PPO, distillation): rollout, updates, weight sync, repeated
(docs/design/rl.md).

One RL step:
1. rollout (driven by global rank 0; engine.rl.collect.collector): prompts_per_step prompts x
   rollout.n responses split over the job's engines, ONE generate call per engine (more only
   with DAPO dynamic sampling or a failure), rewards (reward.fn, plus a learned reward model's
   score, engine.rl.policy.reward_model: every rank runs it through the pool's commands, or on
   a disaggregated run the training ranks when the batch arrives), overlong shaping, group
   advantages; the token lists are broadcast to every rank;
2. the log-prob stage (engine.rl.policy.logprob_stage): old log-probs (not where the update is
   exactly on-policy: the training forward's then, engine.rl.policy.old_logprobs, said in the
   run header), the KL reference's, the critic's values and GAE (PPO), the teacher's
   (distillation), forward-only in micro-batches;
3. epochs_per_rollout x mini_batches_per_step optimizer steps (engine.rl.policy.train_step:
   the critic's, then the policy's, each one TrainEngine.train_batch);
4. weight sync (engine.rl.policy.weight_sync): each engine's owner assembles the HF tensors
   from its own model replica (TP gathered, pipeline stages streamed point-to-point) and loads
   them in buckets; all engines in parallel.
Rollout engine placement (engine.generation.placement): rollout.num_engines engines (default one
per node), each owned by one rank, rollout.gpus_per_engine devices each; engine 0 on rank 0.

Checkpoints (engine.run.run_loop, as for SFT): the policy's model, optimizer and scheduler, the data
position (RL steps done, prompts_per_step, prompt rows, seed, shuffle) and, as the checkpoint's
`extra`, the collector's next_gen_batch (ahead of the step count with DAPO dynamic sampling),
with rollout.partial the carried replies (engine.rl.collect.partial), and the skipped-step
count. After a resume the rollout engine (started from model.hf_path) is synced with the
checkpoint's weights before the first rollout; the KL reference stays the
initial policy (model.hf_path). With PPO the critic (model, optimizer, scheduler) is saved
before each policy checkpoint under checkpoint.dir/critic/ and resumed from the same step.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from engine.checkpoint.checkpointing import DataPosition
from engine.config.compile_settings import compile_overrides
from engine.config.fusion_settings import fusion_overrides
from engine.config.lora_settings import lora_build_kwargs
from engine.config.model_settings import describe as describe_settings
from engine.config.model_settings import megatron_overrides
from engine.config.mtp_settings import mtp_training
from engine.config.moe_settings import moe_overrides
from engine.training.muon import megatron_distributed_optimizer
from engine.config.parallel_settings import overlap_settings
from engine.rl.collect.partial import PartialCollector
from engine.rl.collect.prompts import prompt_rows
from engine.rl.collect.transport import broadcast_rollout
from engine.rl.collect.validation import Validation
from engine.rl.config import RLConfig
from engine.rl.disaggregated.trainer import RemoteRollout, RemoteValidation
from engine.rl.disaggregated.world import active_split
from engine.rl.env.episode_batch import check_env_start
from engine.rl.judge.collector import make_collector
from engine.rl.policy.logprob_stage import AuxiliaryModels
from engine.rl.policy.old_logprobs import old_logprobs_plan
from engine.rl.policy.reward_model import rescore_batch
from engine.rl.policy.routing_replay import rollout_engine_kwargs
from engine.rl.policy.train_step import build_auxiliary, train_on_rollout
from engine.rl.policy.weight_sync import check_weight_sync, probe_tokens, sync_to_rollout
from engine.generation import backend_class
from engine.generation.pool import RolloutPool
from engine.generation.sync.quantization import sync_source
from engine.generation.vllm.lora import lora_engine_kwargs, lora_sync_mode
from engine.run.run_loop import RunLoop, build_or_resume, resume_side_engines
from engine.training.nonfinite import NonFiniteGuard
from engine.config.micro_batch_defaults import resolve_micro_batching
from engine.training.train_engine import BatchSettings, TrainEngine
from models.bridge.critic import critic_hf_config
from models.hf.custom_code import load_tokenizer


def _sync(policy: TrainEngine, pool: RolloutPool, cfg: RLConfig, probe: bool
          ) -> dict[str, float]:
    """Collective: wake the engines that slept, stream the policy's weights into every engine,
    and (with `probe`) compare their logits with the trainer's."""
    t0 = time.perf_counter()
    before = None
    engine = pool.engine
    if engine is not None:
        if probe and not engine.is_asleep:
            before = engine.probe_logits(probe_tokens(policy.vocab_size))
        if cfg.rollout.sleep_during_train:
            engine.wake()
    stats = pool.resync(None)   # every engine (build_pool)
    metrics = {"time/weight_sync_s": time.perf_counter() - t0}
    if stats is not None:  # rank 0's engine; every engine receives the same bytes
        metrics["weight_sync/gbps"] = stats.gbps
        metrics["weight_sync/buckets"] = float(stats.num_buckets)
        metrics["rollout/sync_bytes_per_engine"] = float(stats.total_bytes)
    if probe:
        metrics.update(check_weight_sync(policy.chunks, policy.vocab_size, engine, before))
    return metrics


def rl_step(policy: TrainEngine, aux: AuxiliaryModels | None, collector, pool: RolloutPool,
            cfg: RLConfig, step: int, remote=None) -> dict[str, float]:
    """One RL step on every rank (collective over the world); metrics are complete on rank 0.
    Disaggregated (`remote`: engine.rl.disaggregated.trainer.RemoteRollout, also rank 0's `collector`;
    `pool` None): the batch comes from the rollout ranks and the new version goes to them."""
    t0 = time.perf_counter()
    batch = None
    if collector is not None:
        try:
            batch = collector.collect(dump_step=step + 1)
        except Exception as e:  # every rank must learn about it, or they would wait forever
            batch = e
    batch = broadcast_rollout(batch, pool)
    if cfg.rollout.sleep_during_train and pool is not None and pool.engine is not None:
        pool.engine.sleep()
    if remote is not None and aux is not None and aux.reward_model is not None:
        rescore_batch(batch, aux.reward_model, cfg, step + 1)  # the trainer scores (async)
    metrics = dict(batch.metrics)
    if remote is not None and remote.snapshots is not None and len(batch):
        metrics.update(remote.snapshots.metrics(policy, batch, step, cfg.rollout.temperature))
    t1 = time.perf_counter()
    if len(batch):
        metrics.update(train_on_rollout(policy, aux, batch, cfg, step))
    else:
        metrics["train/update_skipped"] = 1.0
    metrics["time/train_s"] = time.perf_counter() - t1
    # the weights changed, or the sleeping engines dropped them: stream them (same on all ranks)
    if remote is not None:
        metrics.update(remote.push(policy, step + 1))  # version step + 1, even if unchanged
    elif len(batch) > 0 or cfg.rollout.sleep_during_train:
        probe = (cfg.rollout.check_weight_sync and cfg.parallel.cp == 1
                 and backend_class(cfg.rollout.backend).supports_logit_probe)
        metrics.update(_sync(policy, pool, cfg, probe))
    metrics["train/skipped_steps"] = float(policy.guard.skipped)
    metrics["time/step_s"] = time.perf_counter() - t0
    return metrics


def build_pool(cfg: RLConfig, policy: TrainEngine, dtype: torch.dtype) -> RolloutPool:
    """Every rank: the job's rollout engines (RolloutPool.for_world); a restarted engine gets
    the policy's weights through the colocated sync (`resync`: the LoRA adapters alone with
    rollout.vllm.lora_sync=adapter, engine.generation.vllm.lora)."""
    pool = RolloutPool.for_world(cfg, dtype, **rollout_engine_kwargs(cfg),
                                 **lora_engine_kwargs(cfg, policy.hf_config))
    adapters = lora_sync_mode(cfg, policy.hf_config) == "adapter"   # else merged weights
    pool.resync = lambda targets: sync_to_rollout(
        policy.chunks, policy.hf_config, pool.engine, cfg.rollout.sync_bucket_mb,
        pool.placement.owners, targets, sync_source(cfg, policy.hf_config), adapters)
    return pool


def _rollout_side(cfg: RLConfig, policy: TrainEngine, dtype, rows, tokenizer, prompt_ids,
                  extra: dict, start: int):
    """(pool, collector, remote): colocated engines and rank 0's collector, or with
    rollout.placement=disaggregated the RemoteRollout (rank 0's collector too; no pool)."""
    split = active_split()
    if split is not None:
        remote = RemoteRollout(split, cfg, start, extra)
        return None, (remote if dist.get_rank() == 0 else None), remote
    pool = build_pool(cfg, policy, dtype)
    collector = None
    if dist.get_rank() == 0:
        collector = make_collector(pool, rows, tokenizer, cfg, prompt_ids, extra.get("partial"))
        collector.next_gen_batch = int(extra.get("next_gen_batch", start))
    return pool, collector, None


def _attach_auxiliary(aux: AuxiliaryModels, loop: RunLoop, pool: RolloutPool | None, cfg,
                      hf_config: dict, resumed, start: int) -> None:
    """PPO: the critic is checkpointed beside the policy (and resumed with it). Colocated, the
    reward model scores each generation batch through the pool (RolloutPool.score); a
    disaggregated run's training ranks score the batches they receive (rl_step)."""
    if aux.critic is not None:
        loop.side_engines["critic"] = (aux.critic, critic_hf_config(hf_config))
        if start > 0:
            resume_side_engines(cfg, loop.side_engines, resumed, "train.prompts_per_step")
    if pool is not None and aux.reward_model is not None:
        pool.scorer = aux.reward_model.score


def _count(done: list, step: int) -> dict:
    done[0] = step + 1
    return {}


def _collector_state(collector) -> dict:
    """Collective: rank 0's collector.next_gen_batch (and with rollout.partial its carried
    replies, PartialCollector.state) on every rank (the checkpoint's common state must be the
    same on every rank)."""
    box = [None if collector is None else {"next_gen_batch": collector.next_gen_batch, **(
        {"partial": collector.state()} if isinstance(collector, PartialCollector) else {})}]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _print_header(cfg: RLConfig, num_prompts: int, pool, remote, policy: TrainEngine,
                  batching_line: str) -> None:
    """Rank 0's run header: the rollout side, the policy model, where the old log-probs come
    from (engine.rl.policy.old_logprobs) and the micro-batching chosen
    (engine.config.micro_batch_defaults)."""
    where = (pool.placement.describe(torch.cuda.is_available()) if pool
             else remote.describe())
    print(f"[rl] {cfg.algorithm}: {num_prompts} prompts, {cfg.train.prompts_per_step} x "
          f"{cfg.rollout.n} responses per step, rollout backend {cfg.rollout.backend}: "
          f"{where}; policy model: {describe_settings(policy.chunks[0].config)}", flush=True)
    print(f"[rl] {old_logprobs_plan(cfg).describe()}", flush=True)
    print(f"[rl] {batching_line}", flush=True)


def _close_rollout_side(pool, collector) -> None:
    """The run's end, however it ends: the colocated engine, the tool worker processes, the
    agent endpoint's server."""
    if pool is not None and pool.engine is not None:
        pool.engine.shutdown()
    if collector is not None and getattr(collector, "env", None) is not None:
        collector.env.close()
    if collector is not None and getattr(collector, "agent", None) is not None:
        collector.agent.close()


def run(cfg: RLConfig, hf_config: dict, flags: list[str]) -> int:
    """The RL run on every rank (process groups and megatron state exist)."""
    rank = dist.get_rank()
    tokenizer = load_tokenizer(cfg.model.hf_path, cfg.model.trust_remote_code)
    check_env_start(cfg, tokenizer)  # env.fn's template needs, on every rank (exit 2)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    # every rank, before the model is built: data errors stop every rank at once
    rows, prompt_ids = prompt_rows(cfg, tokenizer, cfg.data.train_files)
    validation = Validation(cfg, tokenizer)  # data.val_files (engine.rl.collect.validation)
    train = cfg.train

    def position(done: int) -> DataPosition:
        return DataPosition(done, train.prompts_per_step, len(rows), cfg.seed, cfg.data.shuffle)

    micro = resolve_micro_batching(cfg, hf_config)   # the defaults sized from the model
    batching = BatchSettings(micro.micro_batch_size, micro.max_tokens_per_micro_batch,
                             train.balance_dp, train.packing, micro.prefix_sharing,
                             train.skip_unread_positions)
    optimizer_steps = train.max_steps * train.mini_batches_per_step * train.epochs_per_rollout
    policy, resumed, extra = build_or_resume(cfg, lambda load: TrainEngine.build(
        hf_config, cfg.optim, dtype, optimizer_steps, batching, pad_id,
        weights_dir=cfg.model.hf_path, load_weights=load,
        overlap=overlap_settings(cfg.parallel, megatron_distributed_optimizer(cfg.optim)),
        loss_chunk_tokens=train.loss_chunk_tokens or None,
        **megatron_overrides(cfg.parallel, cfg.train), **moe_overrides(cfg, hf_config),
        **fusion_overrides(cfg, hf_config), **lora_build_kwargs(cfg, hf_config),
        **compile_overrides(cfg), mtp=mtp_training(cfg)),
        position(0),
        batch_key="train.prompts_per_step")
    policy.guard = NonFiniteGuard(train.max_consecutive_nonfinite_steps,
                                  skipped=int(extra.get("skipped_steps", 0)))
    if cfg.moe.routing_replay:  # R2 / R3 (engine.rl.policy.routing_replay)
        policy.enable_routing_replay()
    start = resumed.step
    pool, collector, remote = _rollout_side(cfg, policy, dtype, rows, tokenizer, prompt_ids,
                                            extra, start)
    done = [start]  # RL steps done (the checkpoint extra of a disaggregated run needs it)
    loop = RunLoop("rl", cfg, policy, hf_config, position, desc=cfg.algorithm,
                   extra=lambda: {**(_collector_state(collector)
                                     if remote is None else remote.ahead_state(done[0])),
                                  "skipped_steps": policy.guard.skipped},
                   postfix=lambda m: {"reward": f"{m['reward/mean']:.3f}"})
    if not loop.prepare(start):
        return remote.begin(policy, run=False) if remote is not None else 0
    aux = build_auxiliary(cfg, hf_config, dtype, batching, pad_id, optimizer_steps)
    _attach_auxiliary(aux, loop, pool, cfg, hf_config, resumed, start)
    if rank == 0:
        _print_header(cfg, len(rows), pool, remote, policy, micro.header)
    validation = RemoteValidation(validation, remote) if remote is not None else validation
    validation.attach(pool, collector)
    try:
        # The engines loaded model.hf_path; the policy may differ from it (a LoRA adapter of
        # model.lora.init_from, a resumed or relayouted checkpoint, a quantized sync): the first
        # rollout is sampled from the policy's own weights, so they are streamed first, always.
        if remote is not None:
            remote.begin(policy)  # version `start` (0 on a fresh run)
        else:
            pool.resync(None)
        if start > 0 and rank == 0:  # colocated: DAPO's next generation batch too
            nxt = f" (next generation batch {collector.next_gen_batch})" if remote is None else ""
            print(f"[rl] resumed at step {start} of {train.max_steps}{nxt}", flush=True)
        validation.before_training(start)
        history = loop.run(start, lambda step: {
            **rl_step(policy, aux, collector, pool, cfg, step, remote),
            **validation.after_step(step + 1), **_count(done, step)})
        if remote is not None:
            remote.close(done[0])
    finally:
        _close_rollout_side(pool, collector)
    if rank == 0 and history:
        print(f"[rl] done: {start + len(history)} of {train.max_steps} steps, first reward "
              f"{history[0]['reward/mean']:.4f}, last reward {history[-1]['reward/mean']:.4f}",
              flush=True)
    return 0
