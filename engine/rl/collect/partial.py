"""Partial rollouts (rollout.partial; docs/async-rl.md#partial-rollouts-rolloutpartial): a rollout
batch does not wait for its longest reply. A reply still unfinished when the step's batch is cut
is carried, and continues in the next step (under the new weights) from its prompt + its tokens
so far. Every cut is made by step or token counts, never by wall time, so a run gives the same
numbers twice.

Two ways to generate (`step_driver`). rollout.partial_driver=true (a pool of one engine in this
process with a step driver, engine.rl.agent.rollout.step_driver: vllm without speculative
decoding, hf without a vision tower, routed experts or layers other than full attention; else
refused naming the key): a step is ONE driver session that admits new groups' replies as slots
free and cuts once prompts_per_step groups wait (engine.rl.collect.partial_session): more fill,
more staleness (docs/async-rl.md; its DP2 run equals one process at optim.eps=1e-6,
tests/test_rl_partial_runs.py). false (the default): rounds, tested layout-invariant:

One step (PartialCollector.collect, rank 0):
1. unfinished replies whose continuation would span more than rollout.partial_max_staleness
   versions restart from their prompt (same seed; counted in rollout/partial_restarts). Step 2
   never carries such a reply, so this happens only after a resume with a smaller bound;
2. on the driver: one session (partial_session); in rounds: rounds of at most
   rollout.partial_max_new_tokens tokens per reply until train.prompts_per_step complete
   groups wait (or a round budget is spent), and in either case further on while a reply
   would outlive the staleness bound if cut now (`must_finish`: a reply that already spans
   partial_max_staleness versions finishes under this version; bounded, as its bound on
   tokens is):
   new groups are started so that groups in flight + waiting = ceil(partial_oversample x
   prompts_per_step); ONE generate call over the engines holds every unfinished reply (carried
   ones first, by group number) and the new groups' replies; each row draws the randomness of
   its own decode steps (SamplingParams.first_steps = its tokens so far: with unchanged weights
   a cut-and-continued reply is token for token the uninterrupted one) and stops at the round's
   budget or at rollout.max_new_tokens in all (row_max_new_tokens);
3. a group whose replies are all complete (an end of sequence, or rollout.max_new_tokens
   tokens) is scored (reward.fn, a reward model through the pool, the overlong penalty on its
   total length); with dapo.dynamic_sampling a group whose scores all agree is dropped
   (rollout/partial_dropped_groups), and with reward.failure_score null so is a group holding
   a failed reward.fn call (reward/dropped_groups; engine.rl.collect.partial_scoring); the
   others wait, FIFO by group number;
4. the first prompts_per_step waiting groups train (advantages over them, as usual); the rest
   wait for the next step.

Group number q takes prompt row global_batch_indices(rows, prompts_per_step, q // P, seed,
shuffle)[q % P] and the seeds response_seed(seed, q // P, q % P, j): the prompts and seeds of
generation batch q // P of a run without partial rollouts. Each token keeps the log-prob and
the policy version of the weights that sampled it (version = RL steps done; on a
disaggregated run the version the rollout engines hold, max(0, k - rollout.max_staleness) for
batch k), which the dump records (token_versions, -1 on prompt tokens) and the trainer uses as
its behaviour log-prob. On a disaggregated run (rollout.placement=disaggregated) the collector
lives on the rollout leader (engine.rl.disaggregated.rollout_ranks), and its `state()` travels
with every batch to the trainer, which checkpoints the state after the last batch it received.
"""
from __future__ import annotations

import json
import time

import torch

from engine.data.datasets import global_batch_indices
from engine.rl.collect.batch import RolloutBatch
from engine.rl.collect.collector import RolloutCollector
from engine.rl.collect.failed_groups import dropped_message
from engine.rl.collect.fill import engine_fill, fill_counts
from engine.rl.agent.rollout import step_driver
from engine.rl.collect.partial_checks import groups_in_flight, partial_budget, round_cap
from engine.rl.collect.partial_scoring import PartialScoring
from engine.rl.collect.partial_session import run_session
from engine.rl.collect.partial_state import (Group, Reply, from_plain, outlives_bound,
                                             span_metrics, to_plain)
from engine.rl.collect.reward_metrics import reward_length_metrics
from engine.rl.env.dump import episode_record, write_dump
from engine.generation import SamplingParams
from engine.generation.work_split import response_seed


class PartialCollector(PartialScoring, RolloutCollector):
    """RolloutCollector (same arguments) whose `collect` runs partial rollouts (module
    docstring). State between steps: `groups` (in flight, by number), `ready` (complete,
    waiting), `next_group`; `state()` / `restore()` put it in the checkpoint's extra.
    `use_driver` (class attribute, default True): False keeps the rounds path everywhere (a
    baseline for benchmarks, the rounds' own tests); `driver`: the last session's driver
    (None: that step went in rounds)."""

    use_driver = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.groups: list[Group] = []
        self.ready: list[Group] = []
        self.next_group = 0
        self.steps = 0                   # collects so far (the version without a dump step)
        self.driver = None

    # ------------------------------------------------------------------- checkpoint state
    def state(self) -> dict:
        """Plain JSON: what a resumed run needs to continue these replies."""
        return {"next_group": self.next_group, "steps": self.steps,
                "groups": to_plain(self.groups), "ready": to_plain(self.ready)}

    def restore(self, state: dict | None) -> None:
        """Continue from `state()` of a checkpoint (None: a fresh run)."""
        if state:
            self.next_group, self.steps = int(state["next_group"]), int(state["steps"])
            self.groups, self.ready = from_plain(state["groups"]), from_plain(state["ready"])

    # ----------------------------------------------------------------------------- a step
    def collect(self, dump_step: int | None = None, version: int | None = None) -> RolloutBatch:
        """The next step's rollout batch (module docstring); `dump_step` as
        RolloutCollector.collect. `version`: the policy version the engines hold, which samples
        this step's tokens (None: dump_step - 1, the RL steps done, as colocated; a
        disaggregated run passes its engines' version, batch_version(k, max_staleness))."""
        cfg, rollout = self.cfg, self.cfg.rollout
        t0 = time.perf_counter()
        self.scorer.reset_counts()
        if version is None:
            version = dump_step - 1 if dump_step is not None else self.steps
        self.steps += 1
        restarts = 0
        for g in self.groups:   # carried past the bound (a resume with a smaller one)
            for r in g.replies:
                if outlives_bound(r, version - 1, rollout.partial_max_staleness):
                    r.restart()
                    restarts += 1
        budget = partial_budget(rollout)
        cap = round_cap(cfg)
        log = {"calls": 0.0, "retries": 0.0, "restarts": 0.0, "imbalance": 1.0,
               "fill": [], "tokens": 0, "gen_s": 0.0, "errors": 0, "dropped": 0, "rounds": 0,
               "failed": []}
        p = cfg.train.prompts_per_step
        self.driver = self.step_driver() if len(self.ready) < p or self.must_finish(version) \
            else None
        if self.driver is not None:
            self._session(version, log)
        while self.driver is None and ((len(self.ready) < p and log["rounds"] < cap)
                                       or self.must_finish(version)):
            self._round(version, budget, log)
        self.settle_scores(log)   # the queued groups' scores (partial_scoring)
        take = cfg.train.prompts_per_step
        trained, self.ready = self.ready[:take], self.ready[take:]
        batch = self._batch(trained, dump_step, log["failed"])
        m = batch.metrics
        m.update(span_metrics(trained, version))
        engines = self.pool.num_engines
        m.update({
            "reward/errors": float(log["errors"]), **self.scorer.take_metrics(),
            "reward/dropped_groups": float(len(log["failed"])),
            "rollout/engine_fill": engine_fill(log["fill"]),
            "rollout/engines": float(engines),
            "rollout/generate_calls": log["calls"] / engines,
            "rollout/num_gen_batches": float(log["rounds"]),
            "rollout/retries": log["retries"], "rollout/restarts": log["restarts"],
            "rollout/engine_imbalance": log["imbalance"],
            "rollout/tokens_per_s": log["tokens"] / log["gen_s"] if log["gen_s"] > 0 else 0.0,
            "rollout/partial_restarts": float(restarts),
            "rollout/partial_carried": float(sum(r.finish is None for g in self.groups
                                                 for r in g.replies)),
            "rollout/partial_waiting_groups": float(len(self.ready)),
            "rollout/partial_dropped_groups": float(log["dropped"]),
            "train/groups": float(len(trained)),
            "time/rollout_s": time.perf_counter() - t0})
        if log["failed"]:
            first = next(e for g in log["failed"] for e in g.errors if e is not None)
            print(dropped_message(len(log["failed"]), len(log["failed"]) + len(trained), first,
                                  not trained), flush=True)
        return batch

    def _session(self, version: int, log: dict) -> None:
        """The step's driver session (partial_session.run_session). A failed one is run again
        from the state it started from (rollout.max_retries times; the engine restarted first
        where it died, RolloutPool.restart), so a recovered step equals the one without the
        failure: a session is a function of that state and the weights."""
        start = (json.dumps(self.state()), {k: list(v) if isinstance(v, list) else v
                                             for k, v in log.items()})
        for attempt in range(self.cfg.rollout.max_retries + 1):
            try:
                run_session(self, self.driver, version, log)
                break
            except Exception as e:  # noqa: BLE001 - any engine failure is retried
                if attempt == self.cfg.rollout.max_retries:
                    raise
                self.restore(json.loads(start[0]))
                log.clear()
                log.update({k: list(v) if isinstance(v, list) else v
                            for k, v in start[1].items()})
                dead = not self.pool.engine.is_alive
                print(f"[rollout] warning: the step driver failed on generation batch "
                      f"{self.next_gen_batch} (attempt {attempt + 1}): {type(e).__name__}: "
                      f"{e}; {'restarting the engine and ' if dead else ''}running the "
                      "session again", flush=True)
                if dead:
                    self.pool.restart([0])
                else:
                    time.sleep(self.cfg.rollout.retry_wait_s * 2 ** attempt)
                log["restarts" if dead else "retries"] += 1
                self.driver = self.step_driver()
        self.next_gen_batch += 1

    def step_driver(self):
        """With rollout.partial_driver=true, a step driver over the pool's one engine
        (engine.rl.agent.rollout.step_driver; a pool it does not serve is refused naming the
        key); else None: the rounds path (module docstring; always None when `use_driver` is
        False)."""
        if not (self.use_driver and self.cfg.rollout.partial_driver):
            return None
        driver = step_driver(self.pool)
        if driver is None:
            raise ValueError("rollout.partial_driver=true needs a pool of one engine in the "
                             "rank-0 process with a step driver (rollout.backend hf or vllm "
                             "without speculative decoding, rollout.num_engines 1); set "
                             "rollout.partial_driver=false for rounds")
        return driver

    def must_finish(self, version: int) -> bool:
        """Whether an unfinished reply would outlive rollout.partial_max_staleness if this
        step (sampling at `version`) cut it (partial_state.outlives_bound): the step goes on
        (more rounds, or the session keeps stepping) until none would."""
        bound = self.cfg.rollout.partial_max_staleness
        return any(outlives_bound(r, version, bound) for g in self.groups for r in g.replies)

    def prefix(self, group: Group, reply: Reply) -> list[int]:
        """What a continued reply is generated from: its prompt's ids + its tokens so far."""
        return self._prompt_ids(group.row) + reply.tokens

    def start_group(self) -> Group:
        """The next group number's group (its prompt row and seeds), appended to `groups`."""
        cfg = self.cfg
        p, q = cfg.train.prompts_per_step, self.next_group
        self.next_group += 1
        group = Group(q, self._prompt_row(q), [Reply(response_seed(cfg.seed, q // p, q % p, j))
                                               for j in range(cfg.rollout.n)])
        self.groups.append(group)
        return group

    def _prompt_row(self, number: int) -> int:
        p = self.cfg.train.prompts_per_step
        return global_batch_indices(len(self.rows), p, number // p, self.cfg.seed,
                                    self.cfg.data.shuffle)[number % p]

    def _start_groups(self) -> None:
        """New groups up to ceil(partial_oversample x prompts_per_step) in flight + waiting."""
        p = self.cfg.train.prompts_per_step
        for _ in range(groups_in_flight(self.cfg.rollout, p) - len(self.groups)
                       - len(self.ready)):
            self.start_group()

    def _round(self, version: int, budget: int, log: dict) -> None:
        """One generate call over every unfinished reply (module docstring, step 2), then the
        complete groups scored and queued."""
        rollout = self.cfg.rollout
        self._start_groups()
        rows = [(g, r) for g in self.groups for r in g.replies if r.finish is None]
        log["rounds"] += 1
        if rows:
            prompts = [self.prefix(g, r) for g, r in rows]
            params = SamplingParams(
                max_new_tokens=budget, temperature=rollout.temperature, top_p=rollout.top_p,
                seeds=[r.seed for _, r in rows], first_steps=[len(r.tokens) for _, r in rows],
                row_max_new_tokens=[min(budget, rollout.max_new_tokens - len(r.tokens))
                                    for _, r in rows])
            t0 = time.perf_counter()
            gens, stats = self.pool.generate(prompts, params, 1, self.next_gen_batch)
            log["gen_s"] += time.perf_counter() - t0
            self.next_gen_batch += 1
            log["calls"] += stats.calls
            log["retries"] += stats.retries
            log["restarts"] += stats.restarts
            log["imbalance"] = max(log["imbalance"], stats.imbalance)
            lengths = [len(gen.response_ids) for gen in gens]
            log["fill"].append(stats.fill if stats.fill is not None else fill_counts(
                [len(x) for x in prompts], lengths, 1, budget, self.pool.num_engines))
            log["tokens"] += sum(lengths)
            for (_, r), gen in zip(rows, gens):
                r.tokens += gen.response_ids
                r.logprobs += [float(x) for x in gen.response_logprobs]
                r.versions += [version] * len(gen.response_ids)
                if gen.finish_reason == "stop":
                    r.finish = "stop"
                elif len(r.tokens) >= rollout.max_new_tokens:
                    r.finish = "length"
        done = [g for g in self.groups if g.complete]
        self.groups = [g for g in self.groups if not g.complete]
        if done:
            self.complete_groups(done, log)

    def _batch(self, trained: list[Group], dump_step: int | None,
               failed: list[Group]) -> RolloutBatch:
        """The RolloutBatch of the trained groups (group-major), with the reward and length
        metrics of their replies, and the step's dump of them (token_versions included), then
        of the `failed` groups (dropped for a failed reward call)."""
        cfg, n = self.cfg, self.cfg.rollout.n
        replies = [r for g in trained for r in g.replies]
        values = {k: [x for g in trained for x in g.values[k]]
                  for k in (trained[0].values if trained else ())}
        prompts = [self._prompt_ids(g.row) for g in trained for _ in range(n)]
        scores = torch.tensor(values.get("scores", []), dtype=torch.float32)
        lengths = torch.tensor([len(r.tokens) for r in replies], dtype=torch.float32)
        metrics = reward_length_metrics(scores, lengths, [r.finish == "length" for r in replies],
                                        n)
        if "rm_scores" in values:
            metrics["reward/model_mean"] = sum(values["rm_scores"]) / len(replies)
        if cfg.dapo.overlong_buffer > 0:
            metrics["reward/overlong_penalty_mean"] = (sum(values["penalty"]) / len(replies)
                                                       if replies else 0.0)
        self._dump_groups(trained + failed, dump_step)
        if not trained:
            return RolloutBatch(metrics=metrics)
        rewards = torch.tensor(values["rewards"], dtype=torch.float32)
        data = {"rewards": rewards, "response_ids": [r.tokens for r in replies]}
        return RolloutBatch(prompts, [list(r.tokens) for r in replies],
                            [list(r.logprobs) for r in replies],
                            self._advantages(data).tolist(), metrics,
                            rewards=rewards.tolist(), scores=values["scores"],
                            dump_rows=list(range(len(replies))))

    def _dump_groups(self, groups: list[Group], dump_step: int | None) -> None:
        """<rollout_dir>/step_<dump_step>.jsonl: one record per reply of `groups` (the trained
        ones first; engine.rl.env.dump; gen_batch = the group's number // prompts_per_step;
        error: the reply's failed reward call)."""
        rollout_dir = getattr(self.cfg.logging, "rollout_dir", None)
        if dump_step is None or not rollout_dir:
            return
        p, n, records = self.cfg.train.prompts_per_step, self.cfg.rollout.n, []
        for g in groups:
            rm = g.values.get("rm_scores", [None] * n)
            errors = g.errors or [None] * n
            for j, r in enumerate(g.replies):
                records.append(episode_record(
                    g.row, j, g.number // p, self._prompt_ids(g.row), r.tokens,
                    [1] * len(r.tokens), r.logprobs, 1, g.values["scores"][j],
                    g.values["penalty"][j], r.finish, errors[j], self.tokenizer, rm[j],
                    token_versions=r.versions))
        write_dump(rollout_dir, dump_step, records)
