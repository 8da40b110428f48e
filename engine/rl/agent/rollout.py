"""One generation batch of agent episodes for RolloutCollector (rank 0; docs/agents.md).

`AgentRollout(pool, tokenizer, cfg)` loads env.agent and starts ONE AgentServer for the run
(env.agent_host, env.agent_port; the run's limits: rollout.max_new_tokens, train.seq_length,
rollout.temperature / top_p, env.max_turns). `generation_batch(rows, row_indices, seeds, b)`
runs one episode per (prompt row, sample) with AgentRunner (env.agent_concurrency,
env.agent_timeout_s; the response seeds of the environment path), its generate calls served by
SamplingBackend over the pool's generate (n=1: every request is seeded on its own, so the
samples do not depend on the engine split). `close()` stops the server.

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
- "env": the counts of env_metrics (turns = calls), plus "agent_errors".
"""
from __future__ import annotations

import time

import torch

from engine.rl.agent.protocol import SamplingBackend
from engine.rl.agent.requests import Limits
from engine.rl.agent.runner import AgentRunner
from engine.rl.agent.server import AgentServer
from engine.rl.env.contract import load_object
from engine.rl.env.dump import episode_record
from engine.rl.rollout.pool import GenerateStats

FINISH_REASONS = ("stop", "length", "max_turns", "error")


class AgentRollout:
    """Rank 0: the episodes of env.agent (module docstring)."""

    def __init__(self, pool, tokenizer, cfg) -> None:
        e, r = cfg.env, cfg.rollout
        self.pool, self.cfg = pool, cfg
        self.name = e.agent
        function = load_object(e.agent, "env.agent")
        self.server = AgentServer(tokenizer, Limits(
            max_new_tokens=r.max_new_tokens, seq_length=cfg.train.seq_length,
            temperature=r.temperature, top_p=r.top_p, max_turns=e.max_turns),
            host=e.agent_host, port=e.agent_port).start()
        self.runner = AgentRunner(self.server, function, e.agent, e.agent_concurrency,
                                  e.agent_timeout_s)
        self.schemas = None

    def close(self) -> None:
        self.server.stop()

    def generation_batch(self, rows: list[dict], row_indices: list[int], seeds: list[int],
                         gen_batch: int) -> dict:
        stats: list[GenerateStats] = []
        gen_s = [0.0]

        def generate(prompts, params):
            t0 = time.perf_counter()
            gens, s = self.pool.generate(prompts, params, 1, gen_batch)
            gen_s[0] += time.perf_counter() - t0
            stats.append(s)
            return gens

        t0 = time.perf_counter()
        outcomes = self.runner.run(SamplingBackend(generate), rows, seeds)
        wall = time.perf_counter() - t0
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
        traj_scores = scores[torch.tensor(data["episode"], dtype=torch.long)]
        data.update(rewards=traj_scores.clone(), scores=traj_scores)
        return {
            "data": data, "episode_scores": scores, "outcomes": outcomes, "records": records,
            "records_fn": agent_records,
            "lengths": torch.tensor(sampled), "penalty": torch.zeros(len(outcomes)),
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
    for i, o in enumerate(part["outcomes"]):
        reason = "error" if o.error is not None else None
        for t in o.trajectories:
            rec = episode_record(row_indices[i], i % n, gen_batch, t.prompt_ids,
                                 t.response_ids, t.response_mask, t.response_logprobs,
                                 t.turns, o.reward, 0.0, reason or t.finish_reason, o.error,
                                 tokenizer)
            out.append({**rec, "trajectory": t.index})
        if not o.trajectories:
            rec = episode_record(row_indices[i], i % n, gen_batch, [], [], [], [], 0,
                                 o.reward, 0.0, "error", o.error, tokenizer)
            out.append({**rec, "trajectory": None})
    return out


def _merge(calls: list[GenerateStats]) -> GenerateStats:
    worst = max(calls, key=lambda s: s.imbalance) if calls else GenerateStats(0, 0, 0, [])
    return GenerateStats(sum(s.calls for s in calls), sum(s.retries for s in calls),
                         sum(s.restarts for s in calls), list(worst.engine_seconds))


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
    for o in outcomes:
        for k, v in o.metrics.items():
            out["metrics"][k] = out["metrics"].get(k, 0.0) + v
    return out
