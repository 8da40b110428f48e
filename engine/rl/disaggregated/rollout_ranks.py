"""The rollout ranks of a disaggregated run (rollout.placement=disaggregated; docs/async-rl.md).

These ranks build rollout engines only (no megatron state, no training model). The rollout
world's rank 0 (the LEADER) drives the same RolloutCollector as a colocated run, over a
RolloutPool of the rollout world's engines; the fixed-lag schedule (engine.rl.disaggregated.schedule)
is:

    validate version 0 first (val.before_train, fresh run)
    for k in first .. train.max_steps - 1:
        load versions until the engines hold version max(0, k - rollout.max_staleness),
            validating each version v that train.val_interval divides, right after loading it
        generate batch k (DAPO dynamic sampling: as many generation batches as it needs),
        send it to training rank 0
    load the versions only validations need, validating them

so batch k always comes from the same weights, whatever the timing (with max_staleness >= 1 the
generation of batch k overlaps the trainer's step k - 1). Versions arrive in the background
(engine.rl.disaggregated.inbox) and switch only between batches. Each batch carries rollout/staleness
(k - version), rollout/policy_version, time/generate_s, rollout/idle_s (waiting for weights
since the previous batch) and the collector's next_gen_batch and, with rollout.partial, its
carried replies (PartialCollector.state; both checkpointed by the trainer). With
rollout.partial each batch's tokens are sampled at the version the engines hold
(PartialCollector.collect's `version`); a reply carried into a later batch continues under the
version that batch is generated with.
A failed engine is restarted as in a colocated run (RolloutPool: rollout.max_retries, then one
restart per generation batch), from model.hf_path plus the version the pool serves, which its
owner keeps in host memory as whole tensors (with rollout.sync_delta too: the inbox rebuilds
them, engine.rl.disaggregated.delta), so a restarted engine gets a full sync from its owner and
the trainer's deltas, against the owner's last received version, are unaffected. Rollout
errors reach the trainer as an error message.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from engine.errors import RunError
from engine.rl.judge.collector import make_collector
from engine.rl.collect.partial import PartialCollector
from engine.rl.collect.prompts import prompt_rows
from engine.rl.collect.transport import error_kind
from engine.rl.collect.validation import Validation, val_due, validates_before_training
from engine.rl.disaggregated.inbox import WeightInbox
from engine.rl.disaggregated.schedule import batch_version, versions_after
from engine.rl.disaggregated.weight_send import TAG_CONTROL, TAG_ROLLOUT
from engine.rl.disaggregated.world import SplitWorld, active_split, isend_object, recv_object
from engine.rl.env.episode_batch import check_env_start
from engine.generation.pool import RolloutPool
from engine.generation.vllm.lora import lora_engine_kwargs
from models.hf.custom_code import load_tokenizer


def _bcast(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class WeightState:
    """The version this rollout rank's engines serve; on an engine owner also its tensors
    (`current`, for restarts) and the inbox of the versions sent to it."""

    def __init__(self, pool: RolloutPool, inbox: WeightInbox | None, version: int) -> None:
        self.pool, self.inbox, self.version = pool, inbox, version
        self.current: list = []   # buckets of `version` (empty: model.hf_path's weights)

    def advance(self, expected: int) -> bool:
        """Collective over the rollout world: load the next version (`expected`); False if the
        trainer stopped instead."""
        got = None
        if self.inbox is not None:
            received = self.inbox.take(expected)
            got = received.version
            if got is not None:
                self.current = received.buckets
                self._load()
        got = _bcast(got)  # the leader owns engine 0: its answer is everyone's
        if got is None:
            return False
        if got != expected:
            raise RuntimeError(f"weight version {got} arrived, expected {expected}")
        self.version = got
        return True

    def reload(self, engines: list[int] | None) -> None:
        """RolloutPool's resync (every rollout rank): the restarted engines among `engines`
        get the served version again."""
        mine = self.pool.placement.engine_of(dist.get_rank())
        if mine is not None and (engines is None or mine in engines):
            self._load()

    def _load(self) -> None:
        """This owner's engine takes the served version, bucket by bucket."""
        for bucket in self.current:
            self.pool.engine.update_weights(bucket)


class RolloutSide:
    """One rollout rank's loop (module docstring); the leader also talks to the trainer."""

    def __init__(self, cfg, split: SplitWorld, pool: RolloutPool, collector, weights:
                 WeightState, validation: Validation) -> None:
        self.cfg, self.split, self.pool, self.collector = cfg, split, pool, collector
        self.weights, self.validation = weights, validation
        self.pending = None   # the leader's last message in flight

    def _send(self, message, what: str) -> None:
        """Leader: queue `message` for training rank 0 (in order; one in flight)."""
        if self.pending is not None:
            self.pending.wait()
        self.pending = isend_object(self.split, message, 0, TAG_ROLLOUT, what)

    def _fail(self, error: Exception, what: str) -> None:
        """Leader: tell the trainer, then let the error end this rank."""
        payload = ("error", error_kind(error), f"(rollout leader, job rank "
                   f"{self.split.job_rank}, {what}) {type(error).__name__}: {error}")
        self._send(payload, f"sending the error of {what}")
        self.pending.wait()

    def validate(self) -> None:
        """Collective over the rollout world: validate the served version, send the metrics."""
        v = self.weights.version
        when = "before training" if v == 0 else f"after step {v}"
        try:
            metrics = self.validation.metrics(when, v)
        except Exception as e:
            if self.collector is not None:
                self._fail(e, f"validation {when}")
            raise
        if self.collector is not None:
            self._send(("val", v, metrics), f"sending the validation of version {v}")

    def reach(self, target: int) -> bool:
        """Load versions until the engines hold `target`, validating on the way; False if the
        trainer stopped."""
        while self.weights.version < target:
            if not self.weights.advance(versions_after(self.cfg, self.weights.version)[0]):
                return False
            if val_due(self.cfg, self.weights.version):
                self.validate()
        return True

    def generate(self, k: int, idle: float) -> None:
        """Batch k: the leader collects it and sends it; the others serve their engines."""
        if self.collector is None:
            payload = self.pool.serve()
            if isinstance(payload, tuple) and payload and payload[0] == "error":
                raise RunError(f"the rollout leader failed on batch {k}: {payload[2]}")
            return
        t1 = time.perf_counter()
        partial = isinstance(self.collector, PartialCollector)
        try:
            batch = self.collector.collect(
                dump_step=k + 1, **({"version": self.weights.version} if partial else {}))
        except Exception as e:
            self.pool.finish(("error", error_kind(e), str(e)))
            self._fail(e, f"batch {k}")
            raise
        self.pool.finish(None)
        v = self.weights.version
        batch.metrics.update({"rollout/staleness": float(k - v),
                              "rollout/policy_version": float(v),
                              "time/generate_s": time.perf_counter() - t1,
                              "rollout/idle_s": idle})
        self._send(("batch", k, batch, self.collector.next_gen_batch,
                    self.collector.state() if partial else None), f"sending rollout batch {k}")

    def run(self, first: int, start: int) -> None:
        cfg = self.cfg
        if validates_before_training(cfg, start):
            self.validate()
        for k in range(first, cfg.train.max_steps):
            t0 = time.perf_counter()
            if not self.reach(batch_version(k, cfg.rollout.max_staleness)):
                return  # the trainer stopped early (it took every batch sent so far)
            self.generate(k, time.perf_counter() - t0)
        # (after a resume with nothing left to do the engines hold version 0, not `start`)
        after = max(self.weights.version, start)
        vals = [v for v in versions_after(cfg, after) if val_due(cfg, v)]
        if vals:
            self.reach(vals[-1])
        if self.pending is not None:
            self.pending.wait()


def run_rollout(cfg, hf_config: dict, flags: list[str]) -> int:
    """Every rollout rank (engine.run.launch.run_entry's rollout role): the module
    docstring's loop."""
    split = active_split()
    rank = dist.get_rank()
    tokenizer = load_tokenizer(cfg.model.hf_path, cfg.model.trust_remote_code)
    check_env_start(cfg, tokenizer)
    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    rows, prompt_ids = prompt_rows(cfg, tokenizer, cfg.data.train_files)
    validation = Validation(cfg, tokenizer)
    pool = RolloutPool.for_world(cfg, dtype, **lora_engine_kwargs(cfg, hf_config))
    # the trainer's start message: (first batch, next_gen_batch, steps done, version the
    # engines get first (None: the trainer stops at once), {engine owner job rank: its
    # senders' job ranks}, rollout.partial's collector state or None)
    first, next_gen, start, version0, sources, partial = _bcast(
        recv_object(split, 0, TAG_CONTROL, "waiting for the trainer's start")
        if rank == 0 else None)
    inbox = (WeightInbox(split, sources[split.job_rank]) if pool.engine is not None else None)
    weights = WeightState(pool, inbox, 0)
    pool.resync = weights.reload
    collector = None
    if rank == 0:
        collector = make_collector(pool, rows, tokenizer, cfg, prompt_ids, partial)
        collector.next_gen_batch = next_gen
    validation.attach(pool, collector)
    try:
        if version0 is not None and not weights.advance(version0):  # the policy's weights
            return 0
        RolloutSide(cfg, split, pool, collector, weights, validation).run(first, start)
    finally:
        if pool.engine is not None:
            pool.engine.shutdown()
        if collector is not None and collector.env is not None:
            collector.env.close()
        if collector is not None and getattr(collector, "agent", None) is not None:
            collector.agent.close()   # env.agent's endpoint (docs/agents.md)
    return 0
