"""One generation batch of multi-turn episodes for RolloutCollector (rank 0), and the env/*
metrics of a rollout step.

`EnvRollout(pool, tokenizer, cfg, reward_fn, scorer)` builds the environment factory of env.fn
(a user class, or the built-in tool environment with its worker processes, its final answers
scored by `scorer`) and checks once that the
chat template can place observations. `generation_batch(prompts, rows, row_indices, seeds, b)`
returns what RolloutCollector._generation_batch returns for single-turn, plus
"response_masks" in "data", "env" (counts for `env_metrics`) and "episodes"; "reward_errors"
names each episode's failed reward.fn call (env.fn=tools' final answer, `reward_failure`), whose
score is NaN with reward.failure_score null (engine.rl.collect.failed_groups drops its group).
`env_template_problem` / `check_env_start`: whether env.fn can work with the model's chat
template, checked in validation (engine.rl.checks) and on every rank at start.
"""
from __future__ import annotations

import torch

from engine.data.observation import observation_text
from engine.errors import ConfigError
from engine.rl.algo.overlong import overlong_penalty
from engine.rl.env.contract import ENV_TOOLS, load_env_class
from engine.rl.env.episodes import Episode, EpisodeRunner, EpisodeSettings
from engine.rl.env.tools_env import tool_env_factory, tool_format, tool_schemas
from engine.generation.pool import GenerateStats
from engine.generation.vllm.speculative import merge_counters
from models.hf.custom_code import load_tokenizer

FINISH_REASONS = ("stop", "length", "max_turns", "error")
AGENT_REASONS = ("tool_calls",)   # env.agent episodes also end with a tool call


class EnvRollout:
    """Rank 0: the episodes of env.fn (module docstring)."""

    def __init__(self, pool, tokenizer, cfg, reward_fn, scorer=None) -> None:
        e, r = cfg.env, cfg.rollout
        self.cfg, self.tools_pool, schemas = cfg, None, None
        if e.fn == ENV_TOOLS:   # `scorer`: the collector's, for the final answers (tools_env)
            make_env, schemas, self.tools_pool = tool_env_factory(cfg, tokenizer, reward_fn,
                                                                  scorer)
        else:
            cls, kwargs = load_env_class(e.fn), dict(e.kwargs)

            def make_env(row):
                return cls(row, **kwargs)
        self.schemas = schemas
        self.runner = EpisodeRunner(pool, tokenizer, make_env, EpisodeSettings(
            e.max_turns, r.max_new_tokens, cfg.train.seq_length, r.temperature, r.top_p,
            e.num_workers, e.step_timeout_s, schemas))

    def close(self) -> None:
        if self.tools_pool is not None:
            self.tools_pool.close()

    def generation_batch(self, prompts: list[list[int]], rows: list[dict],
                         row_indices: list[int], seeds: list[int], gen_batch: int) -> dict:
        cfg, n = self.cfg, self.cfg.rollout.n
        episodes = [Episode(row_indices[i], i % n, rows[i], seeds[i], list(prompts[i]))
                    for i in range(len(prompts))]
        stats = self.runner.run(episodes, n, gen_batch)
        failed = [getattr(e.env, "reward_failure", None) for e in episodes]
        unscored = cfg.reward.failure_score is None
        scores = torch.tensor([float("nan") if f is not None and unscored else e.reward
                               for e, f in zip(episodes, failed)], dtype=torch.float32)
        sampled = torch.tensor([sum(e.mask) for e in episodes], dtype=torch.float32)
        penalty = torch.zeros_like(scores)
        if cfg.dapo.overlong_buffer > 0:  # the per-turn budget is what truncates a turn
            longest = torch.tensor([e.longest_turn for e in episodes], dtype=torch.float32)
            penalty = overlong_penalty(longest, cfg.rollout.max_new_tokens,
                                       cfg.dapo.overlong_buffer, cfg.dapo.overlong_penalty)
        return {
            "data": {"prompt_ids": prompts, "response_ids": [e.response_ids for e in episodes],
                     "rollout_logprobs": [e.logprobs for e in episodes],
                     "response_masks": [e.mask for e in episodes],
                     "rewards": scores + penalty, "scores": scores},
            "lengths": sampled, "penalty": penalty, "gen_s": stats.gen_s,
            "errors": sum(f is not None for f in failed), "reward_errors": failed,
            "stats": _merge(stats.generate),
            "clipped": [e.finish_reason == "length" for e in episodes],
            "env": _counts(episodes, stats.env_s), "episodes": episodes,
        }


def _merge(turns: list[GenerateStats]) -> GenerateStats:
    """The generate stats of every turn: calls/retries/restarts summed, the engine times of
    the least balanced turn (so `imbalance` is the worst turn's)."""
    worst = max(turns, key=lambda s: s.imbalance) if turns else GenerateStats(0, 0, 0, [])
    return GenerateStats(sum(s.calls for s in turns), sum(s.retries for s in turns),
                         sum(s.restarts for s in turns), list(worst.engine_seconds),
                         merge_counters([s.counters for s in turns]))


def _counts(episodes: list[Episode], env_s: float) -> dict:
    out = {"episodes": len(episodes), "turns_sum": sum(e.turns for e in episodes),
           "turns_max": max((e.turns for e in episodes), default=0),
           "errors": sum(e.finish_reason == "error" for e in episodes),
           "observation_tokens": sum(len(e.mask) - sum(e.mask) for e in episodes),
           "env_s": env_s, "first_error": next((e.error for e in episodes if e.error), None),
           "metrics": {}}
    for reason in FINISH_REASONS:
        out[reason] = sum(e.finish_reason == reason for e in episodes)
    for e in episodes:
        for k, v in e.metrics.items():
            out["metrics"][k] = out["metrics"].get(k, 0.0) + v
    return out


def env_metrics(parts: list[dict], tools: bool) -> dict[str, float]:
    """env/* metrics of one rollout step from its generation batches' "env" counts: turns
    per episode (mean, max), env/errors (episodes ended by an environment error), finish
    reasons (env/finish_<reason>: episodes; env.agent's also tool_calls), every env-reported
    metric summed over episodes (env/tool_calls, env/tool_errors for env.fn=tools: totals
    over the step's episodes), time/env_s, rollout/observation_tokens (total, over the
    step's episodes)."""
    counts = [p["env"] for p in parts]
    episodes = sum(c["episodes"] for c in counts)
    m = {"env/turns_mean": sum(c["turns_sum"] for c in counts) / max(episodes, 1),
         "env/turns_max": float(max(c["turns_max"] for c in counts)),
         "env/errors": float(sum(c["errors"] for c in counts)),
         "time/env_s": sum(c["env_s"] for c in counts),
         "rollout/observation_tokens": float(sum(c["observation_tokens"] for c in counts))}
    for reason in FINISH_REASONS + tuple(r for r in AGENT_REASONS if r in counts[0]):
        m[f"env/finish_{reason}"] = float(sum(c[reason] for c in counts))
    names = {k for c in counts for k in c["metrics"]} | (
        {"tool_calls", "tool_errors"} if tools else set())
    for k in sorted(names):
        m[f"env/{k}"] = sum(c["metrics"].get(k, 0.0) for c in counts)
    first = next((c["first_error"] for c in counts if c["first_error"]), None)
    if first is not None:
        print(f"[env] warning: {int(m['env/errors'])} of {episodes} episodes ended by an "
              f"environment error (reward 0); first: {first}", flush=True)
    return m


def env_template_problem(cfg, tokenizer=None) -> str | None:
    """Why env.fn cannot work with model.hf_path's chat template (it cannot place observations,
    or with env.fn=tools has no known tool-call format), or None. `tokenizer`: loaded from
    model.hf_path (model.trust_remote_code honoured) when not given."""
    if getattr(cfg, "env", None) is None or (cfg.env.fn is None
                                              and getattr(cfg.env, "agent", None) is None):
        return None
    try:
        if tokenizer is None:
            tokenizer = load_tokenizer(cfg.model.hf_path, cfg.model.trust_remote_code)
        schemas = None
        if cfg.env.fn == ENV_TOOLS:
            tool_format(tokenizer)
            schemas = tool_schemas(cfg)
        observation_text(tokenizer, [{"role": "user", "content": "probe"}],
                         [{"role": "user", "content": "probe"}], schemas)
    except Exception as e:  # noqa: BLE001 - RunError / ValueError / a template error
        key = "env.fn" if cfg.env.fn is not None else "env.agent"
        value = cfg.env.fn if cfg.env.fn is not None else cfg.env.agent
        return str(e) if str(e).startswith("env.") else f"{key}={value!r}: {e}"
    return None


def check_env_start(cfg, tokenizer) -> None:
    """Every rank at start: ConfigError with env_template_problem's reason, if any (validation
    already refused it before the process groups started when model.hf_path has a
    tokenizer)."""
    problem = env_template_problem(cfg, tokenizer)
    if problem is not None:
        raise ConfigError(problem)
