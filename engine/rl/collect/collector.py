"""One rollout batch: prompts -> ONE generate call per engine -> rewards -> overlong shaping and
dynamic sampling -> group advantages (docs/design/rl.md).

Rank 0 drives the rollout (RolloutCollector): each generation batch is split over the job's
engines by engine.generation.pool (one generate call per engine, results back in the global
order), scored (reward.fn: each rank its share, engine.rl.collect.rank_scoring) and shaped on
rank 0; the other ranks serve their engines meanwhile, and transport.broadcast_rollout ends
that phase by sending the token lists to every rank over the default (world) group. Seeds
are per response (work_split.response_seed): the batch does not depend on the engine count.

With a reward model (reward.model.path; the pool's `scorer`, colocated runs), every generation
batch's trajectories are scored by it through the pool (RolloutPool.score: a collective of
every rank) right after they are generated, on their token ids as generated (the prompt's ids
and the sampled ids; a multi-turn episode's whole trajectory), and reward.model.weight x that
score joins the score of reward.fn (or the environment) before the overlong shaping, dynamic
sampling, the advantages and the dump. A disaggregated run's rollout side has no scorer: the
training ranks add the reward model's score when the batch arrives
(engine.rl.policy.reward_model.rescore_batch).

Agent episodes (env.agent): group statistics, dynamic sampling and the advantages count
EPISODES (groups of rollout.n episodes, each with its trajectories; docs/multi-turn.md).

Failed reward calls (engine.rl.collect.failed_groups): with reward.failure_score null (the
default), a group holding a reply whose reward.fn call failed leaves the update right after its
generation batch is scored (before dynamic sampling, which then refills), counted in
reward/dropped_groups; the reward and length metrics cover the other groups; the dump keeps
every reply, a failed one with its `error` named and `reward` null. A step left with no group
trains nothing (train/update_skipped) and says so in the log.

Prompt order: generation batch b (counted over the whole run; dynamic sampling may use several
per step) takes prompts `global_batch_indices(len(rows), prompts_per_step, b, seed, shuffle)`,
so the rollout batch never depends on the parallel layout. Responses are group-major:
responses [g*n, (g+1)*n) answer prompt g.
"""
from __future__ import annotations

import time

import torch

from engine.data.datasets import global_batch_indices, render_prompt
from engine.data.files import DataError
from engine.rl.algo.advantages import ADVANTAGE_ESTIMATORS
from engine.rl.algo.dynamic_sampling import DynamicSampler
from engine.rl.algo.gae import TOKEN_ESTIMATORS
from engine.rl.algo.overlong import overlong_penalty
from engine.rl.collect.batch import RolloutBatch
from engine.rl.collect.episode_rows import episode_rows, trajectory_rows
from engine.rl.collect.failed_groups import (dropped_message, failed_groups, kept_rows,
                                             select_rows)
from engine.rl.collect.fill import engine_fill, fill_counts
from engine.rl.collect.rank_scoring import RankScorer, spreads
from engine.rl.collect.reward_metrics import reward_length_metrics
from engine.rl.collect.reward_items import reward_item
from engine.rl.env.episode_batch import EnvRollout, env_metrics
from engine.rl.env.dump import part_records, write_dump
from engine.rl.rewards.outcome import ScoreReport
from engine.rl.rewards.scorer import BatchScorer
from engine.generation import SamplingParams
from engine.generation.pool import RolloutPool
from engine.generation.vllm.speculative import spec_metrics
from engine.generation.work_split import batch_seeds


class RolloutCollector:
    """Rank 0's side of a rollout: renders prompts, generates, scores, shapes and filters.

    Args:
        engine: the RolloutPool of the job's engines (engine.generation.pool), or one
            RolloutEngine used in this process (wrapped in `RolloutPool.local`).
        rows: prompt rows (engine.data.datasets.load_prompt_rows).
        tokenizer: renders prompts (chat template) and decodes responses for the reward.
        reward_fn: fn(prompt=, response=, answer=, **fields) -> float.
        cfg: the RLConfig (train, rollout, reward, dapo, advantage, data.shuffle, seed).
        prompt_ids: the rows' rendered prompts, already checked against the length limit
            (fit_prompt_rows); without them each prompt is rendered and checked on first use.
    """

    def __init__(self, engine, rows: list[dict], tokenizer, reward_fn, cfg,
                 prompt_ids: list[list[int]] | None = None) -> None:
        self.pool = (engine if isinstance(engine, RolloutPool)
                     else RolloutPool.local(engine, cfg.rollout))
        self.rows, self.tokenizer, self.reward_fn, self.cfg = rows, tokenizer, reward_fn, cfg
        # reward.fn's calls: the worker pool of reward.num_workers (engine.rl.rewards.scorer);
        # multi-rank, one on every rank (rank_scoring), but not for env.fn=tools' answers
        # (scored from step threads while the engines generate: no collective)
        env_fn = getattr(getattr(cfg, "env", None), "fn", None)
        self.scorer = BatchScorer(reward_fn, cfg.reward)
        if not env_fn and spreads(self.pool, self.scorer):
            self.scorer = RankScorer(reward_fn, cfg.reward, self.pool)
        self.next_gen_batch = 0          # generation batches used so far in the run
        self._rendered: dict[int, list[int]] = dict(enumerate(prompt_ids or []))
        # multi-turn episodes (engine.rl.env) when env.fn is set
        self.env = EnvRollout(self.pool, tokenizer, cfg, reward_fn,
                              self.scorer) if env_fn else None
        # an agent function's episodes through the OpenAI-compatible endpoint (env.agent)
        self.agent = None
        if getattr(getattr(cfg, "env", None), "agent", None):
            from engine.rl.agent.rollout import AgentRollout  # fastapi/uvicorn: ~0.8 s to import
            self.agent = AgentRollout(self.pool, tokenizer, cfg)

    def _prompt_ids(self, index: int) -> list[int]:
        if index not in self._rendered:
            row = self.rows[index]
            tools = self.env.schemas if self.env is not None and self.env.schemas else None
            ids = render_prompt(row["prompt"], self.tokenizer, f"prompt row {index}",
                                tools or row.get("tools"))
            limit = self.cfg.train.seq_length + 1 - self.cfg.rollout.max_new_tokens
            if len(ids) > limit:
                raise DataError(
                    f"prompt row {index} of data.train_files renders to {len(ids)} tokens; "
                    f"with rollout.max_new_tokens={self.cfg.rollout.max_new_tokens} a sequence "
                    f"could exceed train.seq_length={self.cfg.train.seq_length} (prompts may "
                    f"have at most {limit} tokens)")
            self._rendered[index] = ids
        return self._rendered[index]

    def generate_scored(self, rows: list[dict], prompts: list[list[int]],
                        params: SamplingParams, n: int, gen_batch) -> dict:
        """THE generation entry point of the RL loop (training batches and validation,
        engine.rl.collect.validation): one response per prompt over every engine (`prompts`
        group-major in groups of `n`, `rows[i]` the dataset row of prompts[i], params.seeds one
        seed per response), decoded and scored by reward.fn. `gen_batch` names the batch in messages.
        Returns {"generations", "scores" (list of float; a failed call's reward.failure_score,
        NaN when that is null), "errors" (reward errors), "failed" (per response its failure,
        engine.rl.rewards.outcome, None when scored), "stats" (GenerateStats), "gen_s"
        (generate wall seconds)}."""
        t0 = time.perf_counter()
        gens, stats = self.pool.generate(prompts, params, n, gen_batch)
        gen_s = time.perf_counter() - t0
        report = self.score(rows, prompts, [g.response_ids for g in gens])
        return {"generations": gens, "scores": report.scores, "errors": report.errors,
                "failed": report.per_item_failures(), "stats": stats, "gen_s": gen_s}

    def score(self, rows: list[dict], prompts: list[list[int]],
              responses: list[list[int]]) -> ScoreReport:
        """reward.fn of each response (decoded) to its prompt (the row's text, else decoded)
        and row: the ScoreReport (scores, failures) of self.scorer (engine.rl.rewards.scorer)."""
        return self.scorer.score([reward_item(row, prompt, response, self.tokenizer)
                                  for row, prompt, response in zip(rows, prompts, responses)])

    def _generation_batch(self) -> dict:
        """One generation batch: prompts_per_step prompts x n responses in one generate call,
        scored and shaped. Returns per-response lists/tensors (group-major) and timings."""
        cfg, rollout = self.cfg, self.cfg.rollout
        gen_batch = self.next_gen_batch
        self.next_gen_batch += 1
        idx = global_batch_indices(len(self.rows), cfg.train.prompts_per_step, gen_batch, cfg.seed,
                                   cfg.data.shuffle)
        rows = [self.rows[i] for i in idx for _ in range(rollout.n)]
        row_indices = [i for i in idx for _ in range(rollout.n)]
        seeds = batch_seeds(cfg.seed, gen_batch, len(idx), rollout.n)
        if self.agent is not None:  # the agent renders its own prompts
            episodes = self.agent.generation_batch(rows, row_indices, seeds, gen_batch)
            return {**episodes, "row_indices": row_indices, "gen_batch": gen_batch}
        prompts = [self._prompt_ids(i) for i in idx for _ in range(rollout.n)]
        params = SamplingParams(max_new_tokens=rollout.max_new_tokens,
                                temperature=rollout.temperature, top_p=rollout.top_p,
                                seeds=seeds)
        if self.env is not None:
            episodes = self.env.generation_batch(prompts, rows, row_indices, params.seeds,
                                                 gen_batch)
            return self._model_scores({**episodes, "row_indices": row_indices,
                                       "gen_batch": gen_batch})
        out = self.generate_scored(rows, prompts, params, rollout.n, gen_batch)
        gens, scores, errors, stats, gen_s = (out["generations"], out["scores"], out["errors"],
                                              out["stats"], out["gen_s"])
        lengths = torch.tensor([len(g.response_ids) for g in gens], dtype=torch.float32)
        scores_t = torch.tensor(scores, dtype=torch.float32)
        penalty = torch.zeros_like(scores_t)
        if cfg.dapo.overlong_buffer > 0:
            penalty = overlong_penalty(lengths, rollout.max_new_tokens, cfg.dapo.overlong_buffer,
                                       cfg.dapo.overlong_penalty)
        return self._model_scores({
            "data": {"prompt_ids": prompts, "response_ids": [g.response_ids for g in gens],
                     "rollout_logprobs": [g.response_logprobs for g in gens],
                     **({"routed_experts": [g.routed_experts for g in gens]}
                        if gens and gens[0].routed_experts is not None else {}),
                     "rewards": scores_t + penalty, "scores": scores_t},
            "lengths": lengths, "penalty": penalty, "errors": errors, "gen_s": gen_s,
            "reward_errors": out["failed"],
            "stats": stats, "row_indices": row_indices, "gen_batch": gen_batch,
            "clipped": [g.finish_reason == "length" for g in gens],
        })

    def _model_scores(self, part: dict) -> dict:
        """With the pool's scorer (a reward model): "rm_scores" of every trajectory (prompt and
        response ids as generated), reward.model.weight x rm_scores added to "scores" and
        "rewards" (module docstring). Returns `part`."""
        if self.pool.scorer is None:
            return part
        data = part["data"]
        ids = [list(p) + list(r) for p, r in zip(data["prompt_ids"], data["response_ids"])]
        rm = torch.tensor(self.pool.score(ids), dtype=torch.float32)
        weight = self.cfg.reward.model.weight
        data.update(rm_scores=rm, scores=data["scores"] + weight * rm,
                    rewards=data["rewards"] + weight * rm)
        return part

    def collect(self, dump_step: int | None = None) -> RolloutBatch:
        """The next step's rollout batch (one generation batch, or with dapo.dynamic_sampling
        as many as needed, up to dapo.max_gen_batches, to fill prompts_per_step groups with
        score variance; a partial batch is used when the budget runs out). With
        logging.rollout_dir and `dump_step` (the step number of metrics.jsonl), every episode
        of every generation batch goes to <rollout_dir>/step_<dump_step>.jsonl
        (engine.rl.env.dump)."""
        cfg, group_size = self.cfg, self.cfg.rollout.n
        t0 = time.perf_counter()
        self.scorer.reset_counts()
        dynamic = cfg.dapo.dynamic_sampling
        sampler = DynamicSampler(group_size, cfg.train.prompts_per_step, cfg.dapo.max_gen_batches,
                                 allow_partial=True) if dynamic else None
        parts, data = self._gather(sampler)
        # group statistics count episodes (an agent episode may train several trajectories);
        # the groups a failed reward call dropped have no scores to count
        kept = [(p, kept_rows(p["dropped_groups"], group_size)) for p in parts]
        scores = torch.cat([p.get("episode_scores", p["data"]["scores"])[rows] for p, rows in kept])
        lengths = torch.cat([p["lengths"][rows] for p, rows in kept])
        gen_s = sum(p["gen_s"] for p in parts)
        clipped = [p["clipped"][i] for p, rows in kept for i in rows]
        dropped = sum(int(p["dropped_groups"].sum()) for p in parts)
        metrics = {
            **reward_length_metrics(scores, lengths, clipped, group_size),
            "reward/errors": float(sum(p["errors"] for p in parts)),
            "reward/dropped_groups": float(dropped),
            **self.scorer.take_metrics(),   # reward/timeouts, reward/failures, time/reward_s
            "rollout/engines": float(self.pool.num_engines),
            "rollout/generate_calls": sum(p["stats"].calls for p in parts) / self.pool.num_engines,
            "rollout/num_gen_batches": float(len(parts)),
            "rollout/retries": float(sum(p["stats"].retries for p in parts)),
            "rollout/restarts": float(sum(p["stats"].restarts for p in parts)),
            "rollout/engine_imbalance": max(p["stats"].imbalance for p in parts),
            "rollout/tokens_per_s": float(lengths.sum()) / gen_s if gen_s > 0 else 0.0,
        }
        if "rm_scores" in parts[0]["data"]:
            metrics["reward/model_mean"] = float(torch.cat([p["data"]["rm_scores"]
                                                            for p in parts]).mean())
        if cfg.dapo.overlong_buffer > 0:
            metrics["reward/overlong_penalty_mean"] = float(
                torch.cat([p["penalty"] for p in parts]).mean())
        if sampler is not None:
            metrics.update(sampler.stats())
        # rollout.vllm.speculative: vLLM's acceptance counters (rollout/spec_*)
        metrics.update(spec_metrics([p["stats"].counters for p in parts], self.pool.num_engines))
        if self.env is not None or self.agent is not None:
            metrics.update(env_metrics(parts, cfg.env.fn == "tools"))
        else:   # single-turn: busy rows over batch rows per decode step, every engine's call
            metrics["rollout/engine_fill"] = engine_fill([fill_counts(
                [len(x) for x in p["data"]["prompt_ids"]], p["lengths"].tolist(), group_size,
                cfg.rollout.max_new_tokens, self.pool.num_engines) for p in parts])
        self._dump(parts, dump_step)
        batch = RolloutBatch(metrics=metrics)
        if data is not None:
            adv = (self._advantages(data) if "episode" not in data else
                   self._episode_advantages(data, data["episode_rewards"]))
            batch = RolloutBatch(list(data["prompt_ids"]), list(data["response_ids"]),
                                 list(data["rollout_logprobs"]), adv.tolist(), metrics,
                                 rewards=data["rewards"].tolist(),
                                 scores=data["scores"].tolist(),
                                 response_masks=list(data.get("response_masks") or []),
                                 routed_experts=list(data.get("routed_experts") or []),
                                 dump_rows=list(data["dump_row"]))
        trained = (len(batch) if self.agent is None else
                   len(data["episode_rewards"]) * (len(batch) > 0) if data is not None else 0)
        metrics["train/groups"] = float(trained // group_size)   # agent: episodes count
        metrics["time/rollout_s"] = time.perf_counter() - t0
        if dropped:
            first = next(f for p in parts for f in p.get("reward_errors", ()) if f is not None)
            print(dropped_message(dropped, sum(len(p["dropped_groups"]) for p in parts), first,
                                  not len(batch)), flush=True)
        return batch

    def _gather(self, sampler: DynamicSampler | None) -> tuple[list[dict], dict | None]:
        """The step's generation batches (one without `sampler`; with it, until it needs no
        more) and the data that trains (None: nothing is left to train: dynamic sampling kept
        nothing, or every group held a failed reward call). Rows carry "dump_row", their
        record's position in the step's dump; each part gets "dropped_groups" (Bool [G]: the
        groups a failed reward call drops, engine.rl.collect.failed_groups); agent episodes
        are filtered as groups of episodes and their data carries "episode_rewards"."""
        parts, dumped = [], 0
        n = self.cfg.rollout.n
        drops = self.cfg.reward.failure_score is None
        while True:
            part = self._generation_batch()
            rows = len(part["data"]["response_ids"])
            local = part["data"].pop("dump_rows_local", range(rows))
            part["data"]["dump_row"] = [dumped + k for k in local]  # the dump's order
            dumped += part.get("records", rows)
            parts.append(part)
            # agent episodes are scored by the agent function, never by a reward.fn call here
            episodes = len(part["episode_scores"]) if "episode_scores" in part else rows
            dropped = part["dropped_groups"] = failed_groups(
                part.get("reward_errors", [None] * episodes), n, drops)
            if sampler is None:
                data = part["data"]
                if "episode_rewards" in part:
                    data["episode_rewards"] = part["episode_rewards"]
                if dropped.any():
                    keep = kept_rows(dropped, n)
                    data = select_rows(data, keep) if keep else None
                return parts, data
            if "episode_scores" in part:   # agent: groups of EPISODES, by their scores
                sampler.add(episode_rows(part), part["episode_scores"])
            else:
                sampler.add(part["data"], part["data"]["scores"], failed=dropped)
            if not sampler.needs_more():
                data = sampler.result() if sampler.num_groups_kept else None
                if data is not None and "episode_scores" in part:
                    data = trajectory_rows(data)
                return parts, data

    def _advantages(self, data: dict) -> torch.Tensor:
        """Per-response advantages of a sequence-level estimator; zeros for a token-level one
        (gae: computed from the critic's values in the log-prob stage)."""
        cfg = self.cfg.advantage
        if cfg.estimator in TOKEN_ESTIMATORS:
            return torch.zeros_like(data["rewards"])
        lengths = torch.tensor([sum(m) for m in data["response_masks"]]
                               if "response_masks" in data else
                               [len(r) for r in data["response_ids"]])
        return ADVANTAGE_ESTIMATORS[cfg.estimator](data["rewards"], self.cfg.rollout.n, cfg,
                                                   lengths)

    def _episode_advantages(self, data: dict, episode_scores: torch.Tensor) -> torch.Tensor:
        """Agent trajectories: the estimator over EPISODES (`episode_scores`: their rewards,
        score plus overlong penalty; group-major, rollout.n a group;
        an episode's length = the sampled tokens of its trained trajectories), then every
        trajectory gets its episode's advantage (AReaL's "individual" style,
        docs/multi-turn.md). Zeros for a token-level estimator."""
        cfg = self.cfg.advantage
        episode = torch.tensor(data["episode"], dtype=torch.long)
        if cfg.estimator in TOKEN_ESTIMATORS:
            return torch.zeros(len(episode))
        lengths = torch.zeros(len(episode_scores))
        lengths.index_add_(0, episode, torch.tensor([float(sum(m))
                                                     for m in data["response_masks"]]))
        adv = ADVANTAGE_ESTIMATORS[cfg.estimator](episode_scores, self.cfg.rollout.n, cfg,
                                                  lengths.clamp(min=1.0))
        return adv[episode]

    def _dump(self, parts: list[dict], step: int | None) -> None:
        """Write the step's episodes to logging.rollout_dir (rank 0; engine.rl.env.dump)."""
        rollout_dir = getattr(self.cfg.logging, "rollout_dir", None)
        if step is None or not rollout_dir:
            return
        records = [r for p in parts for r in (p["records_fn"] if "records_fn" in p else
                                              part_records)(
            p, p["row_indices"], self.cfg.rollout.n, p["gen_batch"], self.tokenizer)]
        write_dump(rollout_dir, step, records)
