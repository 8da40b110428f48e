"""Validation during RL: held-out prompts (data.val_files) sampled val.n times each, scored by
reward.fn, reported as val/reward_mean and unbiased val/pass@k (docs/validation.md).

When: after every train.val_interval-th RL step (after that step's weight sync, so the engines
hold the updated policy; logged with that step's metrics) and, with val.before_train, once
before the first step of a fresh run (logged as step 0). A resumed run validates at the same
steps (it never repeats the step-0 validation).

How: ONE generation batch of every validation prompt x val.n through the rollout engines,
group-major, by `RolloutCollector.generate_scored`, the same entry point the training batches
use (engine split, retries, restarts); with env.fn, by the same multi-turn episodes as training
(engine.rl.env.episodes.EpisodeRunner with the collector's environment factory); with env.agent,
by the same agent function through the run's endpoint (AgentRollout.validation_batch: one
episode per prompt x sample, the calls' sampling settings val.temperature and rollout.top_p,
an episode's score its reward, a failed episode 0); a failed reward.fn call scores 0 here
(reward.failure_score when set) and counts in val/reward_errors: validation trains nothing, so
nothing is dropped; rank 0 drives it, the other ranks serve their engines
(`broadcast_rollout` ends the phase, as for a training rollout). Sampling: val.temperature
(0: greedy), rollout.top_p, rollout.max_new_tokens. The seeds come from their own stream
(`val_seeds`: hashed with a "val" tag, a function of (seed, prompt, sample) only, the same at
every validation so successive validations differ only by the policy), and validation touches
no training state: not the generation-batch counter, the data order, nor any RNG (the HF
backend samples from per-row counter-based noise). A run with validation therefore trains
exactly like one without.

pass@k (Chen et al. 2021, unbiased): a response passes when its score >= val.pass_threshold;
per prompt with c of n passing, pass@k = 1 - C(n - c, k) / C(n, k), averaged over prompts, for
k = 1, 2, 4, ... <= n. Rows with a `data_source` field also give val/<data_source>/reward_mean
and val/<data_source>/pass@k over their prompts.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import time

import torch.distributed as dist

from engine.rl.collect.prompts import prompt_rows
from engine.rl.collect.transport import broadcast_rollout
from engine.rl.env.episodes import Episode, EpisodeRunner
from engine.generation import SamplingParams
from engine.run.metrics import MetricsLogger


def val_due(cfg, v: int) -> bool:
    """Validation runs on version v >= 1 (after step v): data.val_files and train.val_interval
    set and dividing v."""
    interval = cfg.train.val_interval
    return bool(cfg.data.val_files) and bool(interval) and v >= 1 and v % interval == 0


def validates_before_training(cfg, start: int) -> bool:
    """val.before_train on a fresh run: the rollout side validates version 0 first."""
    return bool(cfg.data.val_files) and cfg.val.before_train and start == 0



def pass_ks(n: int) -> list[int]:
    """k = 1, 2, 4, ... <= n."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return ks


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with c of n samples passing: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def val_seeds(seed: int, num_prompts: int, n: int) -> list[int]:
    """Per-response sampling seeds of a validation batch (group-major): blake2b of
    ("val", seed, prompt, sample), a stream disjoint from the training seeds
    (engine.generation.work_split.response_seed hashes "seed/gen_batch/prompt/sample")."""
    return [int.from_bytes(hashlib.blake2b(f"val/{seed}/{g}/{j}".encode(), digest_size=8)
                           .digest(), "little") >> 1 for g in range(num_prompts)
            for j in range(n)]


def _group_metrics(prefix: str, scores: list[float], n: int, threshold: float
                   ) -> dict[str, float]:
    """reward_mean and pass@k of group-major scores (groups of n)."""
    groups = [scores[i:i + n] for i in range(0, len(scores), n)]
    out = {f"{prefix}reward_mean": sum(scores) / len(scores)}
    for k in pass_ks(n):
        out[f"{prefix}pass@{k}"] = sum(pass_at_k(n, sum(s >= threshold for s in g), k)
                                       for g in groups) / len(groups)
    return out


def validation_metrics(scores: list[float], n: int, threshold: float,
                       sources: list[str | None]) -> dict[str, float]:
    """val/reward_mean, val/pass@k and, for every data_source in `sources` (one per prompt;
    None: the row has none), val/<data_source>/reward_mean and val/<data_source>/pass@k."""
    out = _group_metrics("val/", scores, n, threshold)
    for name in sorted({s for s in sources if s is not None}):
        part = [x for g, src in enumerate(sources) if src == name
                for x in scores[g * n:(g + 1) * n]]
        out.update(_group_metrics(f"val/{name}/", part, n, threshold))
    return out


def generate_for_validation(collector, rows: list[dict], prompts: list[list[int]],
                            params: SamplingParams, n: int, tag: str) -> dict:
    """Rank 0: scores [len(prompts)], lengths (sampled tokens per response) and counts of one
    validation batch. Single-turn: RolloutCollector.generate_scored (the training batches'
    entry point). With env.fn (collector.env, engine.rl.env): the same episodes as training
    (EpisodeRunner with the collector's environment factory, pool and settings), sampled at
    params' temperature / top_p; an episode's score is its reward. With env.agent
    (collector.agent): the agent function's episodes (AgentRollout.validation_batch), counts
    agent_errors (failed episodes, score 0) and turns_mean (calls per episode)."""
    agent = getattr(collector, "agent", None)
    if agent is not None:
        return agent.validation_batch(rows, params, tag)
    env = getattr(collector, "env", None)
    if env is None:
        out = collector.generate_scored(rows, prompts, params, n, tag)
        return {"scores": [0.0 if math.isnan(s) else s for s in out["scores"]],   # a failed call
                "lengths": [len(g.response_ids)
                                                     for g in out["generations"]],
                "counts": {"reward_errors": out["errors"]}}
    base = env.runner
    runner = EpisodeRunner(base.pool, base.tokenizer, base.make_env, dataclasses.replace(
        base.s, temperature=params.temperature, top_p=params.top_p))
    episodes = [Episode(i // n, i % n, rows[i], params.seeds[i], list(prompts[i]))
                for i in range(len(prompts))]
    runner.run(episodes, n, tag)
    return {"scores": [e.reward for e in episodes], "lengths": [sum(e.mask) for e in episodes],
            "counts": {"env_errors": sum(e.finish_reason == "error" for e in episodes),
                       "turns_mean": sum(e.turns for e in episodes) / len(episodes)}}


class Validation:
    """Validation of one RL run, on every rank (module docstring).

    Construct on every rank after the training rows (the validation rows are loaded and
    rendered through the data cache, and checked against the length limit, on every rank, so
    a data error stops every rank before the model is built); `attach` once the pool and rank
    0's collector exist. `after_step` and `before_training` are collective over the world."""

    def __init__(self, cfg, tokenizer) -> None:
        self.cfg, self.rows, self.prompt_ids = cfg, [], []
        self.pool = self.collector = None
        if not cfg.data.val_files:
            return
        self.rows, self.prompt_ids = prompt_rows(cfg, tokenizer, cfg.data.val_files,
                                                 key="data.val_files")

    def attach(self, pool, collector) -> None:
        """The job's RolloutPool (every rank) and rank 0's RolloutCollector (None elsewhere)."""
        self.pool, self.collector = pool, collector

    def before_training(self, start: int) -> None:
        """With val.before_train, validate the initial policy of a fresh run (start == 0) and
        log it as step 0 of metrics.jsonl (rank 0)."""
        if not (validates_before_training(self.cfg, start) and self.rows):
            return
        metrics = self.metrics("before training", 0)
        logger = MetricsLogger(self.cfg.logging.dir, enabled=dist.get_rank() == 0)
        logger.log(0, metrics)
        logger.close()

    def after_step(self, done: int) -> dict[str, float]:
        """The validation metrics after `done` RL steps when train.val_interval divides it
        (complete on rank 0), else {}."""
        return self.metrics(f"after step {done}", done) if val_due(self.cfg, done) else {}

    def metrics(self, when: str, version: int) -> dict[str, float]:
        """Collective over the pool's world: validate the policy after `version` RL steps
        (the engines hold it now); the metrics on every rank."""
        metrics = None
        if self.collector is not None:
            try:
                metrics = self.run(when)
            except Exception as e:  # every rank must learn about it, or they would wait
                metrics = e
        return broadcast_rollout(metrics, self.pool)

    def run(self, when: str) -> dict[str, float]:
        """Rank 0: generate and score the validation batch; returns its metrics."""
        cfg, v = self.cfg, self.cfg.val
        t0 = time.perf_counter()
        prompts = [ids for ids in self.prompt_ids for _ in range(v.n)]
        rows = [row for row in self.rows for _ in range(v.n)]
        params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens,
                                temperature=v.temperature, top_p=cfg.rollout.top_p,
                                seeds=val_seeds(cfg.seed, len(self.rows), v.n))
        out = generate_for_validation(self.collector, rows, prompts, params, v.n,
                                      f"validation ({when})")
        sources = [row.get("data_source") for row in self.rows]
        metrics = validation_metrics(out["scores"], v.n, v.pass_threshold,
                                     [None if s is None else str(s) for s in sources])
        metrics["val/response_length_mean"] = sum(out["lengths"]) / len(out["lengths"])
        metrics.update({f"val/{k}": float(x) for k, x in out["counts"].items()})
        metrics["time/val_s"] = time.perf_counter() - t0
        print(f"[rl] validation {when}: {len(self.rows)} prompts x {v.n}, reward_mean "
              f"{metrics['val/reward_mean']:.4f}, pass@1 {metrics['val/pass@1']:.4f}",
              flush=True)
        return metrics
