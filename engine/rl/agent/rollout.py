"""One generation batch of agent episodes for RolloutCollector (rank 0; docs/agents.md).

`AgentRollout(pool, tokenizer, cfg)` loads env.agent and starts ONE AgentServer for the run
(env.agent_host, env.agent_port, env.agent_api_key; the run's limits: rollout.max_new_tokens, train.seq_length,
rollout.temperature / top_p, env.max_turns). `generation_batch(rows, row_indices, seeds, b)`
runs one episode per (prompt row, sample) with AgentRunner (env.agent_concurrency,
env.agent_timeout_s; the response seeds of the environment path). Its calls are served one of
two ways (`step_driver`):
- the step path, where the pool is ONE engine in this process (rollout.num_engines=1: the
  single-node colocated case, and a disaggregated run's one rollout rank) and that engine has
  a step driver (`step_driver`: vllm without rollout.vllm.speculative,
  engine.generation.vllm.stepper; hf without a vision tower, routed experts or layers other
  than full attention, engine.generation.hf.stepper): continuous batching (StepBackend,
  engine.api.stepping): every call joins the running engine step at once and is answered at
  its own end, so an episode back from a slow tool never waits for a batch, nor a batch for
  it. A driver is built for each generation batch (the engine may be rebuilt or put to
  sleep between them);
- the gather path everywhere else (several engines, on one rank or many: the pool splits
  each batch over them; an sglang engine, or an hf engine the driver refuses (its
  step_problem); speculative decoding, whose acceptance counters and off switch are read per
  generate call):
  SamplingBackend over the pool's generate, batched by the gather rule of engine.api.batcher
  (max_len train.seq_length + 1 keeps every generate call within what vLLM's max_model_len
  admits), with the pool's retries and restarts (rollout.max_retries).
Both give every call the same tokens and log-probs: each request is seeded on its own
(call_seed of the episode's response seed), so a sample depends on its context and seed,
not on what runs beside it. The step path makes no retries: a failed engine step answers the
running calls 503 and the run stops with it. Its stats: calls = requests added to the engine,
engine seconds = time inside its steps. `validation_batch(rows, params, tag)`: the
validation episodes of engine.rl.collect.validation, the same function at val.temperature.
`close()` stops the server.

What it returns is what engine.rl.env.episode_batch.EnvRollout.generation_batch returns, with
rows = TRAJECTORIES (each a training sequence like a multi-turn environment episode: loss mask
1 exactly on sampled ids, rollout log-probs kept), plus:
- "episode_scores": one score per episode (group-major, groups of rollout.n): group
  statistics and advantages count episodes (the collector computes them over episodes and
  gives every trajectory its episode's advantage, AReaL's "individual" style);
- data["episode"]: per trajectory, its episode's index in the batch;
- "outcomes" (AgentOutcome per episode), "records" (the dump's record count) and
  "records_fn" (agent_records, which writes them); data["dump_rows_local"]: per trained trajectory, its record in the part.
  A failed episode's trajectories are dumped, not trained;
- "episode_rewards": episode scores plus the overlong penalty (dapo.overlong_buffer: an
  episode's, on its longest call; none for a failed episode), what the advantages use;
- "env": the counts of env_metrics (turns = calls; finish reasons with tool_calls), plus
  "agent_errors".
"""
from __future__ import annotations

import dataclasses
import time

import torch

from engine.api.requests import Limits
from engine.rl.agent.runner import AgentRunner
from engine.rl.agent.server import AgentServer
from engine.rl.algo.overlong import overlong_penalty
from engine.rl.env.contract import load_object
from engine.rl.env.dump import episode_record
from engine.generation.hf.backend import HFRolloutEngine
from engine.generation.hf.stepper import HFStepDriver, step_problem
from engine.generation.pool import GenerateStats
from engine.generation.sampling_backend import SamplingBackend, StepBackend
from engine.generation.vllm.backend import VLLMRolloutEngine
from engine.generation.vllm.speculative import merge_counters
from engine.generation.vllm.stepper import VLLMStepDriver

FINISH_REASONS = ("stop", "length", "max_turns", "error", "tool_calls")


def step_driver(pool):
    """A step driver over the pool's engine when the step path serves it (module docstring),
    else None (the gather path)."""
    engine = pool.engine
    if pool.num_engines != 1 or engine is None:
        return None
    if isinstance(engine, VLLMRolloutEngine) and engine.speculation is None:
        return VLLMStepDriver(engine)
    if isinstance(engine, HFRolloutEngine) and step_problem(engine) is None:
        return HFStepDriver(engine)
    return None


class AgentRollout:
    """Rank 0: the episodes of env.agent (module docstring): the step path wherever
    `step_driver` gives a driver; `gather_only`: the gather path always (a baseline:
    tools.bench agent_steps). `driver`: the step path's driver of the last generation batch
    (None: it went the gather path)."""

    def __init__(self, pool, tokenizer, cfg, gather_only: bool = False) -> None:
        e, r = cfg.env, cfg.rollout
        self.pool, self.cfg, self.gather_only = pool, cfg, gather_only
        self.driver = None
        self.name = e.agent
        function = load_object(e.agent, "env.agent")
        self.server = AgentServer(tokenizer, Limits(
            max_new_tokens=r.max_new_tokens, seq_length=cfg.train.seq_length,
            temperature=r.temperature, top_p=r.top_p, max_turns=e.max_turns),
            host=e.agent_host, port=e.agent_port, api_key=e.agent_api_key).start()
        self.runner = AgentRunner(self.server, function, e.agent, e.agent_concurrency,
                                  e.agent_timeout_s)
        self.schemas = None

    def close(self) -> None:
        self.server.stop()

    def validation_batch(self, rows: list[dict], params, tag: str) -> dict:
        """Validation episodes (engine.rl.collect.validation.generate_for_validation): one per
        row (group-major), response seeds params.seeds, the calls sampled at params'
        temperature and top_p (the server's fixed sampling settings for these episodes; the
        training ones are put back after). Returns {"scores": episode rewards (a failed
        episode 0), "lengths": sampled ids per episode, "counts": {"agent_errors",
        "turns_mean"}}."""
        limits = self.server.limits
        self.server.limits = dataclasses.replace(limits, temperature=params.temperature,
                                                 top_p=params.top_p)
        try:
            part = self._episodes(rows, list(params.seeds), tag)
        finally:
            self.server.limits = limits
        outcomes = part["outcomes"]
        return {"scores": [float(o.reward) for o in outcomes],
                "lengths": part["sampled"],
                "counts": {"agent_errors": sum(o.error is not None for o in outcomes),
                           "turns_mean": sum(o.calls for o in outcomes) / len(outcomes)}}

    def _episodes(self, rows: list[dict], seeds: list[int], gen_batch) -> dict:
        """Run one episode per (row, seed) through the pool: their outcomes, the sampled ids
        of each episode's trained trajectories, generate stats and seconds."""
        self.driver = None if self.gather_only else step_driver(self.pool)
        if self.driver is not None:
            return self._counted(self._stepped(rows, seeds, StepBackend(self.driver)))
        stats: list[GenerateStats] = []
        gen_s = [0.0]

        def generate(prompts, params):
            t0 = time.perf_counter()
            gens, s = self.pool.generate(prompts, params, 1, gen_batch)
            gen_s[0] += time.perf_counter() - t0
            stats.append(s)
            return gens

        t0 = time.perf_counter()
        outcomes = self.runner.run(
            SamplingBackend(generate, max_len=self.cfg.train.seq_length + 1), rows, seeds)
        return self._counted({"outcomes": outcomes, "stats": stats, "gen_s": gen_s[0],
                              "wall": time.perf_counter() - t0})

    def _stepped(self, rows: list[dict], seeds: list[int], backend: StepBackend) -> dict:
        """`_episodes` on the step path (module docstring)."""
        t0 = time.perf_counter()
        outcomes = self.runner.run(backend, rows, seeds)
        wall = time.perf_counter() - t0
        gen_s = self.server.stepping.step_s
        return {"outcomes": outcomes, "gen_s": gen_s, "wall": wall,
                "stats": [GenerateStats(backend.calls, 0, 0, [gen_s])]}

    @staticmethod
    def _counted(run: dict) -> dict:
        """`run` with "sampled": the sampled ids of each episode's trained trajectories."""
        run["sampled"] = [float(sum(sum(t.response_mask) for t in o.trajectories))
                          if o.error is None else 0.0 for o in run["outcomes"]]
        return run

    def generation_batch(self, rows: list[dict], row_indices: list[int], seeds: list[int],
                         gen_batch: int) -> dict:
        run = self._episodes(rows, seeds, gen_batch)
        outcomes, stats, wall = run["outcomes"], run["stats"], run["wall"]
        gen_s = [run["gen_s"]]
        scores = torch.tensor([o.reward for o in outcomes], dtype=torch.float32)
        data = {k: [] for k in ("prompt_ids", "response_ids", "rollout_logprobs",
                                "response_masks", "episode", "dump_rows_local")}
        records = 0   # the dump's records: one per trajectory, one per episode without any
        sampled, clipped = [0.0] * len(outcomes), [False] * len(outcomes)
        for i, o in enumerate(outcomes):
            for t in o.trajectories:
                records += 1
                if o.error is not None:   # dumped, not trained
                    continue
                data["prompt_ids"].append(list(t.prompt_ids))
                data["response_ids"].append(list(t.response_ids))
                data["rollout_logprobs"].append(list(t.response_logprobs))
                data["response_masks"].append(list(t.response_mask))
                data["episode"].append(i)
                data["dump_rows_local"].append(records - 1)
                sampled[i] += sum(t.response_mask)
                clipped[i] = clipped[i] or t.finish_reason == "length"
            records += not o.trajectories
        penalty = torch.zeros(len(outcomes))
        if self.cfg.dapo.overlong_buffer > 0:   # per episode, on its longest call
            longest = torch.tensor([float(longest_call(o)) for o in outcomes])
            ok = torch.tensor([o.error is None for o in outcomes])
            penalty = torch.where(ok, overlong_penalty(
                longest, self.cfg.rollout.max_new_tokens, self.cfg.dapo.overlong_buffer,
                self.cfg.dapo.overlong_penalty), 0.0)
        episode = torch.tensor(data["episode"], dtype=torch.long)
        data.update(rewards=(scores + penalty)[episode], scores=scores[episode])
        return {
            "data": data, "episode_scores": scores, "episode_rewards": scores + penalty,
            "outcomes": outcomes, "records": records, "records_fn": agent_records,
            "lengths": torch.tensor(sampled), "penalty": penalty,
            "errors": 0, "gen_s": gen_s[0], "stats": _merge(stats), "clipped": clipped,
            "env": _counts(outcomes, wall - gen_s[0]),
        }


def agent_records(part: dict, row_indices: list[int], n: int, gen_batch: int,
                  tokenizer) -> list[dict]:
    """The dump records of one agent generation batch (engine.rl.env.dump's fields): one per
    trajectory, with `trajectory` (its index in the episode) and `turns` (its calls); the
    trajectories of one episode share prompt_index and sample_index; an episode without a
    call is one record with `error`, no tokens and trajectory null."""
    out = []
    penalty = part["penalty"].tolist()
    for i, o in enumerate(part["outcomes"]):
        reason = "error" if o.error is not None else None
        for t in o.trajectories:
            rec = episode_record(row_indices[i], i % n, gen_batch, t.prompt_ids,
                                 t.response_ids, t.response_mask, t.response_logprobs,
                                 t.turns, o.reward, penalty[i], reason or t.finish_reason,
                                 o.error, tokenizer)
            out.append({**rec, "trajectory": t.index})
        if not o.trajectories:
            rec = episode_record(row_indices[i], i % n, gen_batch, [], [], [], [], 0,
                                 o.reward, 0.0, "error", o.error, tokenizer)
            out.append({**rec, "trajectory": None})
    return out


def longest_call(outcome) -> int:
    """The most ids one call of the episode sampled: the longest run of loss-mask 1 in its
    trajectories (a call's sampled ids are contiguous; the next call's closing and
    observation ids, loss mask 0, separate them)."""
    longest = 0
    for t in outcome.trajectories:
        run = 0
        for m in t.response_mask:
            run = run + 1 if m else 0
            longest = max(longest, run)
    return longest


def _merge(calls: list[GenerateStats]) -> GenerateStats:
    worst = max(calls, key=lambda s: s.imbalance) if calls else GenerateStats(0, 0, 0, [])
    return GenerateStats(sum(s.calls for s in calls), sum(s.retries for s in calls),
                         sum(s.restarts for s in calls), list(worst.engine_seconds),
                         merge_counters([s.counters for s in calls]))


def _counts(outcomes, env_s: float) -> dict:
    """env_metrics' counts (engine.rl.env.episode_batch) of agent episodes: turns = calls,
    errors = failed episodes (also "agent_errors"), finish reasons of the last trajectory."""
    reasons = [("error" if o.error is not None else
                (o.trajectories[-1].finish_reason if o.trajectories else "error"))
               for o in outcomes]
    out = {"episodes": len(outcomes), "turns_sum": sum(o.calls for o in outcomes),
           "turns_max": max((o.calls for o in outcomes), default=0),
           "errors": sum(o.error is not None for o in outcomes),
           "observation_tokens": sum(len(t.response_mask) - sum(t.response_mask)
                                     for o in outcomes if o.error is None
                                     for t in o.trajectories),
           "env_s": env_s, "first_error": next((o.error for o in outcomes if o.error), None),
           "metrics": {}}
    for reason in FINISH_REASONS:
        out[reason] = sum(r == reason for r in reasons)
    out["metrics"]["agent_errors"] = float(out["errors"])
    out["metrics"]["trajectories"] = float(sum(len(o.trajectories) for o in outcomes))
    out["metrics"]["tool_call_replies"] = float(sum(o.tool_call_replies for o in outcomes))
    for o in outcomes:
        for k, v in o.metrics.items():
            out["metrics"][k] = out["metrics"].get(k, 0.0) + v
    return out
