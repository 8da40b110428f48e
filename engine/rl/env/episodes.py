"""Multi-turn episodes, token-in/token-out (rank 0; docs/multi-turn.md).

One generation batch of episodes (group-major, like single-turn responses):
1. every episode's environment is built, `make_env(row)`, concurrently (env.num_workers);
2. turn t = 0, 1, ... < env.max_turns: the active episodes' trajectories go to the engines in ONE
   generate call per engine (engine.generation.pool; turn 0 in whole groups, later turns as
   single responses), each response seeded with turn_seed(its response seed, t), so nothing
   depends on the engine count; each episode appends its sampled ids exactly as generated
   (loss mask 1, rollout log-probs), cut to its own budget min(rollout.max_new_tokens,
   train.seq_length + 1 - trajectory length);
3. the environments step on the decoded turns concurrently, each within env.step_timeout_s; the
   step rewards are summed; an episode ends when its env says done ("stop"), its turn hit the
   token budget ("length"; the env is stepped on the cut turn first, as single-turn scores a
   clipped response), its observation would not fit in train.seq_length ("length"), it used
   env.max_turns turns ("max_turns"), or its env raised / timed out / broke the contract
   ("error": reward 0, counted in env/errors, the run goes on);
4. otherwise the observations are appended as the chat template's suffix (engine.rl.env.
   observation; loss mask 0, log-prob 0) and the episode continues;
5. environments with a close() are closed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

from engine.api.backend import turn_seed
from engine.data.observation import conversation_start, observation_ids
from engine.rl.env.contract import check_step
from engine.rl.env.stepper import run_calls
from engine.generation.base import SamplingParams
from engine.generation.pool import GenerateStats


@dataclass
class Episode:
    """One episode: prompt ids, then the response segment (sampled turns and observations)."""

    row_index: int                 # the prompt row (index into the dataset rows)
    sample: int                    # sample index within its group
    row: dict
    seed: int                      # its response seed (work_split.response_seed)
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)       # 1 on sampled tokens
    logprobs: list[float] = field(default_factory=list)  # 0.0 on observation tokens
    messages: list[dict] = field(default_factory=list)   # the conversation so far
    reward: float = 0.0
    turns: int = 0
    finish_reason: str | None = None
    error: str | None = None
    env: Any = None
    metrics: dict[str, float] = field(default_factory=dict)
    longest_turn: int = 0          # most tokens sampled in one turn
    last_action: str = ""

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def end(self, reason: str, error: str | None = None) -> None:
        self.finish_reason = reason
        if error is not None:
            self.error, self.reward = error, 0.0


@dataclass
class EpisodeSettings:
    max_turns: int
    max_new_tokens: int
    seq_length: int
    temperature: float
    top_p: float
    num_workers: int
    step_timeout_s: float | None
    tools: list[dict] | None = None   # tool schemas the template renders (env.fn=tools)


@dataclass
class EpisodeStats:
    generate: list[GenerateStats] = field(default_factory=list)   # one per turn
    gen_s: float = 0.0
    env_s: float = 0.0


def budget_calls(lengths: list[int], budgets: list[int], limit: int) -> dict[int, list[int]]:
    """{max_new_tokens: indices} of one turn's generate calls: every episode in a call with
    the largest budget, except those whose ids (`lengths`) plus it would pass `limit`: one
    call per budget of theirs (EpisodeRunner._generate)."""
    shared = max(budgets)
    calls: dict[int, list[int]] = {}
    for i, (length, budget) in enumerate(zip(lengths, budgets)):
        calls.setdefault(shared if length + shared <= limit else budget, []).append(i)
    return calls


class EpisodeRunner:
    """Runs generation batches of episodes (module docstring) on rank 0."""

    def __init__(self, pool, tokenizer, make_env: Callable[[dict], Any],
                 settings: EpisodeSettings) -> None:
        self.pool, self.tokenizer, self.make_env, self.s = pool, tokenizer, make_env, settings

    def _calls(self, calls: list) -> list:
        return run_calls(calls, self.s.num_workers, self.s.step_timeout_s)

    def run(self, episodes: list[Episode], n: int, gen_batch: int) -> EpisodeStats:
        stats = EpisodeStats()
        t0 = time.perf_counter()
        for e in episodes:
            e.messages = conversation_start(e.row["prompt"])
        for e, (env, err) in zip(episodes, self._calls([partial(self.make_env, e.row)
                                                        for e in episodes])):
            e.env = env
            if err is not None:
                e.end("error", f"environment constructor: {err}")
        stats.env_s += time.perf_counter() - t0
        for turn in range(self.s.max_turns):
            active = [e for e in episodes if e.finish_reason is None]
            if not active:
                break
            cut = self._generate(active, turn, n if len(active) == len(episodes) else 1,
                                 gen_batch, stats)
            t1 = time.perf_counter()
            results = self._calls([partial(e.env.step, e.last_action) for e in active])
            for e, was_cut, (result, err) in zip(active, cut, results):
                self._after_step(e, was_cut, result, err, turn)
            stats.env_s += time.perf_counter() - t1
        t2 = time.perf_counter()
        closing = [e.env.close for e in episodes if callable(getattr(e.env, "close", None))]
        failed = [err for _, err in self._calls(closing) if err is not None]
        if failed:
            print(f"[env] warning: close() failed for {len(failed)} episodes; first: "
                  f"{failed[0]}", flush=True)
        stats.env_s += time.perf_counter() - t2
        return stats

    def _generate(self, active: list[Episode], turn: int, n: int, gen_batch: int,
                  stats: EpisodeStats) -> list[bool]:
        """The active episodes' turn `turn`: appends the sampled ids. Returns per episode
        whether its turn ended without an end of turn (token budget).

        Each episode's budget is min(rollout.max_new_tokens, what is left of
        train.seq_length + 1). The episodes share one generate call (per engine) with the
        largest budget, each cut to its own afterwards, except those whose ids plus that
        budget would pass train.seq_length + 1: they go in one call per budget with their own
        (vLLM refuses a prompt whose length plus max_new_tokens passes its max_model_len).
        The samples are the same either way: a seeded sample's first t ids do not depend on
        the budget (engine.generation.base)."""
        s = self.s
        limit = s.seq_length + 1
        budgets = [min(s.max_new_tokens, limit - len(e)) for e in active]
        calls = budget_calls([len(e) for e in active], budgets, limit)
        if len(calls) > 1:
            n = 1   # the engines' split keeps groups of n together only in a single call
        gens: list = [None] * len(active)
        t0 = time.perf_counter()
        for budget, idx in calls.items():
            params = SamplingParams(max_new_tokens=budget, temperature=s.temperature,
                                    top_p=s.top_p,
                                    seeds=[turn_seed(active[i].seed, turn) for i in idx])
            part, gstats = self.pool.generate(
                [active[i].prompt_ids + active[i].response_ids for i in idx], params, n,
                gen_batch)
            stats.generate.append(gstats)
            for i, gen in zip(idx, part):
                gens[i] = gen
        stats.gen_s += time.perf_counter() - t0
        cut = []
        for e, gen, budget in zip(active, gens, budgets):
            ids = list(gen.response_ids[:budget])
            e.response_ids += ids
            e.mask += [1] * len(ids)
            e.logprobs += [float(x) for x in gen.response_logprobs[:budget]]
            e.turns += 1
            e.longest_turn = max(e.longest_turn, len(ids))
            e.last_action = self.tokenizer.decode(ids, skip_special_tokens=True)
            cut.append(gen.finish_reason == "length" or len(gen.response_ids) > budget)
        return cut

    def _after_step(self, e: Episode, was_cut: bool, result, err: str | None,
                    turn: int) -> None:
        if err is None:
            try:
                step = check_step(result)
            except Exception as bad:  # noqa: BLE001 - EnvError: contract broken
                err = str(bad)
        if err is not None:
            e.end("error", err)
            return
        e.reward += step.reward
        for k, v in step.metrics.items():
            e.metrics[k] = e.metrics.get(k, 0.0) + v
        e.messages.append({"role": "assistant", "content": e.last_action})
        if was_cut:
            e.end("length")
        elif step.done:
            e.end("stop")
        elif turn + 1 >= self.s.max_turns:
            e.end("max_turns")
        else:
            try:
                tools = self.s.tools if self.s.tools is not None else e.row.get("tools")
                obs = observation_ids(self.tokenizer, e.messages, step.observations, tools)
            except Exception as bad:  # noqa: BLE001 - the template refused these messages
                e.end("error", f"rendering the observations: {type(bad).__name__}: {bad}")
                return
            e.messages += step.observations
            if len(e) + len(obs) > self.s.seq_length:  # no room left for one sampled token
                e.end("length")
                return
            e.response_ids += obs
            e.mask += [0] * len(obs)
            e.logprobs += [0.0] * len(obs)
