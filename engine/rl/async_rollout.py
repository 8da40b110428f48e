"""The rollout ranks of a disaggregated run (rollout.placement=disaggregated; DESIGN 9b).

These ranks build rollout engines only (no megatron state, no training model). The rollout
world's rank 0 (the LEADER) drives the same RolloutCollector as a colocated run, over a
RolloutPool of the rollout world's engines; the fixed-lag schedule is:

    for k in first .. train.max_steps - 1:
        receive versions until the engines hold version max(0, k - rollout.max_staleness)
        generate batch k (DAPO dynamic sampling: as many generation batches as it needs),
        send it to training rank 0

so batch k always comes from the same weights, whatever the timing (with max_staleness >= 1 the
generation of batch k overlaps the trainer's step k - 1). Versions switch only between batches.
Each batch carries rollout/staleness (k - version), time/generate_s, rollout/idle_s (waiting for
weights since the previous batch) and the collector's next_gen_batch (checkpointed by the
trainer). Engine restarts are not available here (a failed engine ends the run after
rollout.max_retries, RolloutFailed); rollout errors reach the trainer as an error payload.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from engine.rl.async_transfer import TAG_BATCH, TAG_CONTROL, receive_weights
from engine.rl.env.template_check import check_env_start
from engine.rl.prompt_data import prompt_rows
from engine.rl.rewards import load_reward_fn
from engine.rl.rollout import backend_class
from engine.rl.rollout.placement import procs_per_node, resolve_placement
from engine.rl.rollout.pool import RolloutPool
from engine.rl.rollout_batch import RolloutCollector, _error_kind
from engine.rl.split_world import (SplitWorld, active_split, isend_object, recv_object,
                                   send_object)


def _build_pool(cfg, dtype) -> RolloutPool:
    placement = resolve_placement(cfg.rollout.num_engines, cfg.rollout.gpus_per_engine,
                                  dist.get_world_size(), procs_per_node(dist.get_world_size()))
    mine = placement.engine_of(dist.get_rank())
    engine = None
    if mine is not None:
        engine = backend_class(cfg.rollout.backend).from_config(
            cfg.model.hf_path, cfg.rollout, dtype, cfg.seed,
            gpus=(placement.local_slot(mine), placement.gpus_per_engine))
    return RolloutPool(placement, engine, cfg.rollout)  # no factory: no restarts


def _bcast(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class _Weights:
    """This rollout rank's view of the version its engines hold."""

    def __init__(self, split: SplitWorld, pool: RolloutPool, sources: dict[int, int]) -> None:
        self.split, self.pool, self.sources = split, pool, sources
        self.version = 0

    def advance(self) -> bool:
        """Collective over the rollout world: load the next version; False if the trainer
        stopped."""
        got = None
        if self.pool.engine is not None:
            got = receive_weights(self.split, self.pool.engine,
                                  self.sources[self.split.job_rank]).version
        got = _bcast(got)  # the leader owns engine 0: its answer is everyone's
        if got is None:
            return False
        if got != self.version + 1:
            raise RuntimeError(f"weight version {got} arrived, expected {self.version + 1}")
        self.version = got
        return True


def run_rollout(cfg, hf_config: dict, flags: list[str]) -> int:
    """Every rollout rank (engine.cli.run_entry's rollout role): the module docstring's loop."""
    split = active_split()
    rank = dist.get_rank()
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
    check_env_start(cfg, tokenizer)
    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    rows, prompt_ids = prompt_rows(cfg, tokenizer, cfg.data.train_files)
    pool = _build_pool(cfg, dtype)
    # the trainer's start message: (first batch, next_gen_batch, version the engines get first,
    # {engine owner job rank: sender job rank})
    start = _bcast(recv_object(split, 0, TAG_CONTROL, "waiting for the trainer's start")
                   if rank == 0 else None)
    first, next_gen, version0, sources = start
    weights = _Weights(split, pool, sources)
    collector = None
    if rank == 0:
        collector = RolloutCollector(pool, rows, tokenizer, load_reward_fn(cfg.reward.fn), cfg,
                                     prompt_ids)
        collector.next_gen_batch = next_gen
    try:
        if version0 > 0:  # resumed: the checkpoint's weights, tagged with their version
            weights.version = version0 - 1
            if not weights.advance():
                return 0
        _loop(cfg, split, pool, collector, weights, first)
    finally:
        if pool.engine is not None:
            pool.engine.shutdown()
        if collector is not None and collector.env is not None:
            collector.env.close()
    return 0


def _loop(cfg, split: SplitWorld, pool: RolloutPool, collector, weights: _Weights,
          first: int) -> None:
    s = cfg.rollout.max_staleness
    pending = None  # the previous batch's send: the trainer takes it when its step starts
    for k in range(first, cfg.train.max_steps):
        t0 = time.perf_counter()
        while weights.version < max(0, k - s):
            if not weights.advance():
                return  # the trainer stopped early (it took every batch sent so far)
        idle = time.perf_counter() - t0
        if collector is None:
            pool.serve()
            continue
        t1 = time.perf_counter()
        try:
            batch = collector.collect(dump_step=k + 1)
        except Exception as e:  # the trainer learns it, then this rank raises it
            payload = ("error", _error_kind(e), f"(rollout leader, job rank "
                       f"{split.job_rank}, batch {k}) {type(e).__name__}: {e}")
            pool.finish(payload)
            if pending is not None:
                pending.wait()
            send_object(split, payload, 0, TAG_BATCH, f"sending the error of batch {k}")
            raise
        pool.finish(None)
        batch.metrics.update({"rollout/staleness": float(k - weights.version),
                              "rollout/policy_version": float(weights.version),
                              "time/generate_s": time.perf_counter() - t1,
                              "rollout/idle_s": idle})
        if pending is not None:
            pending.wait()
        pending = isend_object(split, (k, batch, collector.next_gen_batch), 0, TAG_BATCH,
                               f"sending rollout batch {k}")
    if pending is not None:
        pending.wait()
