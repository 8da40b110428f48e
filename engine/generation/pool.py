"""All rollout engines of a job, driven from global rank 0 (docs/design/rl.md).

Every rank holds a `RolloutPool`; ranks named by the placement (engine.generation.placement)
also hold an engine. Rank 0 runs the rollout (engine.rl.collect.collector.RolloutCollector) and
calls `generate`; every other rank sits in `serve` for the whole rollout phase, executing the
commands rank 0 broadcasts, until `finish` sends the step's final payload (the rollout batch).

One `generate` (one generation batch):
1. the responses are split over the engines in whole groups (work_split.split_groups);
2. rank 0 broadcasts the split over the world (broadcast_object_list); each owner makes ONE
   generate call for its share, retried on the same engine after a failure (rollout.max_retries,
   rollout.retry_wait_s * 2**(k-1) between attempts; an engine whose `is_alive` turns False is
   not retried); results return to rank 0 with gather_object, and are put back in the global
   order;
3. an engine that still failed is restarted, once per generation batch: its owner builds a new
   one (`factory`), the trainer's current weights are streamed into it (`resync`, a collective
   over the world), and its share is generated again; a second failure raises RolloutFailed.
Sampling is seeded per response (SamplingParams.seeds), so the result does not depend on the
engine count, the split or a restart.

`score(ids)` (rank 0): every rank runs `scorer(ids)`, a collective over the world (the reward
model at the trainer's layout, engine.rl.policy.reward_model), while the engines stay as they
are; rank 0 gets the scores.

`on_every_rank(fn, payload)` (rank 0): every rank runs `fn(pool, payload)` (a module-level
function, sent by reference), the results gathered to rank 0 in rank order; `rank_state` keeps
what such functions hold on a rank between calls (each rank's share of the reward scoring,
engine.rl.collect.rank_scoring).

Without torch.distributed (or with one process) the pool is local: the same steps, no
collectives.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

import torch.distributed as dist

from engine.errors import RunError
from engine.generation.base import Generation, RolloutEngine, SamplingParams, backend_class
from engine.generation.placement import EnginePlacement, procs_per_node, resolve_placement
from engine.generation.work_split import split_groups


class RolloutFailed(RunError):
    """A rollout engine failed rollout.max_retries + 1 times in a row (after a restart too,
    when the pool can restart it)."""


@dataclass
class EngineResult:
    """One engine's answer to one generate command (sent to rank 0)."""

    engine: int
    generations: list[Generation] | None   # None when every attempt failed
    error: str | None                      # the last error, when generations is None
    calls: int                             # generate calls made (retries included)
    seconds: float                         # wall time of the attempts
    # the engine's speculative-decoding counters of the call (VLLMRolloutEngine
    # .speculation_counters; engine.generation.vllm.speculative), {} without speculation
    counters: dict = field(default_factory=dict)
    # the call's (busy, total) sequence slot-steps when the engine measured them
    # (VLLMRolloutEngine.last_fill: rollout/engine_fill), else None
    fill: tuple[int, int] | None = None


@dataclass
class GenerateStats:
    """What one generation batch cost, over all engines."""

    calls: int                  # generate calls (retries and re-generations included)
    retries: int                # failed calls that were retried on the same engine
    restarts: int               # engines rebuilt from the current weights
    engine_seconds: list[float]  # per engine that had work: its generate time
    # speculative decoding, summed over the engines (EngineResult.counters): drafts, proposed,
    # accepted, enabled (engines still speculating); {} without speculation
    counters: dict = field(default_factory=dict)
    # (busy, total) slot-steps summed over the engines when every one measured them, else None
    fill: tuple[int, int] | None = None

    @property
    def imbalance(self) -> float:
        """Slowest engine time / mean engine time (1.0: perfectly balanced)."""
        times = self.engine_seconds
        mean = sum(times) / len(times) if times else 0.0
        return max(times) / mean if mean > 0 else 1.0


def generate_with_retries(engine: RolloutEngine, prompts: list[list[int]],
                          params: SamplingParams, rollout_cfg, where: str) -> EngineResult:
    """`engine.generate` with up to rollout.max_retries retries (the module docstring);
    `where` names the call in warnings ("generation batch 3, engine 1 (rank 8)")."""
    attempts = rollout_cfg.max_retries + 1
    t0 = time.perf_counter()
    error = "not attempted"
    calls = 0
    for attempt in range(attempts):
        calls += 1
        try:
            gens = engine.generate(prompts, params)
            if len(gens) != len(prompts):
                raise RuntimeError(f"returned {len(gens)} generations for {len(prompts)} "
                                   "prompts")
            counters = getattr(engine, "speculation_counters", dict)()
            return EngineResult(-1, gens, None, calls, time.perf_counter() - t0, counters,
                                getattr(engine, "last_fill", None))
        except Exception as e:  # noqa: BLE001 - any backend failure is retried
            error = f"{type(e).__name__}: {e}"
        if attempt + 1 < attempts and engine.is_alive:
            wait = rollout_cfg.retry_wait_s * 2 ** attempt
            print(f"[rollout] warning: generate failed on {where} (attempt {attempt + 1} of "
                  f"{attempts}): {error}; retrying in {wait:g} s", flush=True)
            time.sleep(wait)
        elif not engine.is_alive:
            break
    return EngineResult(-1, None, error, calls, time.perf_counter() - t0)


class RolloutPool:
    """The job's rollout engines, seen from one rank.

    Args:
        placement: which rank owns which engine.
        engine: this rank's engine (None when it owns none).
        rollout_cfg: the `rollout` config group (backend, max_retries, retry_wait_s).
        factory: builds a fresh engine for this rank (restarts); None: no restarts.
        resync: resync(engines) streams the trainer's weights into those engines (None: all);
            collective over the world (engine.rl.policy.weight_sync.sync_to_rollout). Settable after
            construction (it needs the trainer, which may be built later).
    `scorer` (set after construction, on every rank; None: no reward model): scorer(token id
    lists) -> one float each, collective over the world.
    """

    def __init__(self, placement: EnginePlacement, engine: RolloutEngine | None, rollout_cfg,
                 factory: Callable[[], RolloutEngine] | None = None,
                 resync: Callable[[list[int] | None], object] | None = None) -> None:
        self.placement, self.engine, self.cfg = placement, engine, rollout_cfg
        self._factory, self.resync = factory, resync
        self.scorer: Callable[[list[list[int]]], list[float]] | None = None
        self.rank_state: dict = {}   # on_every_rank's functions' state on this rank
        self._distributed = dist.is_initialized() and dist.get_world_size() > 1
        self._rank = dist.get_rank() if dist.is_initialized() else 0

    @classmethod
    def for_world(cls, cfg, dtype, **engine_kwargs) -> "RolloutPool":
        """Every rank of the current default group: its rollout engines (placement from
        rollout.num_engines / rollout.gpus_per_engine and torchrun's LOCAL_WORLD_SIZE); the
        owners build theirs with rollout.backend's from_config (`engine_kwargs` added, and
        trust_remote_code=True under model.trust_remote_code), which is also the restart
        factory. `resync` is left to the caller."""
        world = dist.get_world_size()
        placement = resolve_placement(cfg.rollout.num_engines, cfg.rollout.gpus_per_engine,
                                      world, procs_per_node(world))
        mine = placement.engine_of(dist.get_rank())
        trust = {"trust_remote_code": True} if cfg.model.trust_remote_code else {}

        def factory() -> RolloutEngine:
            return backend_class(cfg.rollout.backend).from_config(
                cfg.model.hf_path, cfg.rollout, dtype, cfg.seed,
                gpus=(placement.local_slot(mine), placement.gpus_per_engine), **trust,
                **engine_kwargs)

        return cls(placement, factory() if mine is not None else None, cfg.rollout,
                   factory=factory)

    @classmethod
    def local(cls, engine: RolloutEngine, rollout_cfg) -> "RolloutPool":
        """One engine in this process, no restarts (tests, single-process use)."""
        return cls(EnginePlacement(1, 1, 1, 1, (0,)), engine, rollout_cfg)

    @property
    def num_engines(self) -> int:
        return self.placement.num_engines

    # ------------------------------------------------------------------------------ rank 0
    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int,
                 gen_batch: int) -> tuple[list[Generation], GenerateStats]:
        """Rank 0: one response per prompt (group-major, groups of `n`), in the order of
        `prompts`, over every engine; raises RolloutFailed (module docstring)."""
        parts = split_groups([len(p) for p in prompts], n, params.max_new_tokens,
                             self.num_engines)
        shares = {e: idx for e, idx in enumerate(parts) if idx}
        results = self._round(shares, prompts, params, gen_batch)
        calls = sum(r.calls for r in results.values())
        seconds = {e: r.seconds for e, r in results.items()}
        failed = sorted(e for e, r in results.items() if r.generations is None)
        restarts = 0
        if failed and self._factory is not None:
            self._command(("restart", failed))
            self._restart(failed)
            restarts = len(failed)
            again = self._round({e: shares[e] for e in failed}, prompts, params, gen_batch)
            for e, r in again.items():
                print(f"[rollout] engine {e} (rank {self.placement.owners[e]}) was restarted "
                      f"from the current weights on generation batch {gen_batch}: "
                      f"{'recovered' if r.generations is not None else 'failed again'}",
                      flush=True)
                calls += r.calls
                seconds[e] += r.seconds
                results[e] = r
        still = sorted(e for e, r in results.items() if r.generations is None)
        if still:
            self._raise_failed(results[still[0]], still[0], gen_batch, restarted=restarts > 0)
        out: list[Generation | None] = [None] * len(prompts)
        for e, idx in shares.items():
            for i, gen in zip(idx, results[e].generations):
                out[i] = gen
        retries = calls - len(shares) - restarts
        counters: dict[str, float] = {}
        for r in results.values():
            for k, v in r.counters.items():
                counters[k] = counters.get(k, 0.0) + v
        fills = [results[e].fill for e in shares]
        fill = None if None in fills else (sum(f[0] for f in fills), sum(f[1] for f in fills))
        return out, GenerateStats(calls, retries, restarts, list(seconds.values()), counters,
                                  fill)

    def restart(self, engines: list[int]) -> None:
        """Rank 0: rebuild `engines` with the factory and stream the trainer's weights into
        them (collective: ranks > 0 follow in `serve`), as `generate` does after a failed call;
        for callers that drive the engine themselves (engine.rl.collect.partial_session).
        Raises RuntimeError for a pool without a factory (RolloutPool.local)."""
        if self._factory is None:
            raise RuntimeError("this rollout pool cannot restart its engines (no factory: "
                               "RolloutPool.local)")
        self._command(("restart", list(engines)))
        self._restart(list(engines))

    def score(self, ids: list[list[int]]) -> list[float]:
        """Rank 0: `scorer(ids)` run on every rank (one float per token id list)."""
        self._command(("score", ids))
        return self.scorer(ids)

    def on_every_rank(self, fn: Callable, payload, gather: bool = True) -> list:
        """Rank 0: `fn(self, payload)` on every rank (ranks > 0 follow in `serve`); with
        `gather` the ranks' results in rank order, else [rank 0's]. `fn` must not raise on
        ranks > 0 (rank 0 would wait for their results): it returns its errors."""
        self._command(("call", fn, payload, gather))
        return self._serve_call(fn, payload, gather)

    def finish(self, payload):
        """Rank 0: end the other ranks' `serve` with `payload` (the step's rollout batch, or
        an error description); returns it."""
        self._command(("end", payload))
        return payload

    def _raise_failed(self, result: EngineResult, engine: int, gen_batch: int,
                      restarted: bool) -> None:
        r = self.cfg
        attempts = r.max_retries + 1
        where = (f" (engine {engine} of {self.num_engines}, rank {self.placement.owners[engine]})"
                 if self.num_engines > 1 else "")
        again = ", and again after a restart from the current weights" if restarted else ""
        raise RolloutFailed(
            f"rollout backend {r.backend!r} failed {attempts} times in a row on generation "
            f"batch {gen_batch} (rollout.max_retries={r.max_retries}){where}{again}; last "
            f"error: {result.error}. Check the backend's own log above; for sglang also GPU "
            "memory (rollout.sglang.mem_fraction, rollout.sleep_during_train) and that the "
            "engine process is alive. Raise rollout.max_retries / rollout.retry_wait_s for "
            "transient failures; with checkpoint.dir set the run resumes from its newest "
            "checkpoint")

    def _round(self, shares: dict[int, list[int]], prompts, params: SamplingParams,
               gen_batch: int) -> dict[int, EngineResult]:
        """One generate call per engine in `shares` (engine -> response indices)."""
        work = {e: ([prompts[i] for i in idx], params.rows(idx))   # per-prompt fields sliced
                for e, idx in shares.items()}
        self._command(("generate", gen_batch, work))
        mine = self._serve_generate(gen_batch, work)
        if not self._distributed:
            return {r.engine: r for r in mine}
        gathered: list = [None] * dist.get_world_size()
        dist.gather_object(mine, gathered, dst=0)
        return {r.engine: r for part in gathered for r in part}

    # ------------------------------------------------------------------------- every rank
    def serve(self):
        """Ranks > 0: execute rank 0's commands until `finish`; return its payload."""
        while True:
            command = self._command(None)
            if command[0] == "generate":
                dist.gather_object(self._serve_generate(command[1], command[2]), dst=0)
            elif command[0] == "restart":
                self._restart(command[1])
            elif command[0] == "score":
                self.scorer(command[1])
            elif command[0] == "call":
                self._serve_call(*command[1:])
            else:
                return command[1]

    def _command(self, command):
        """Broadcast rank 0's command to every rank (a no-op when local)."""
        if not self._distributed:
            return command
        box = [command]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _serve_call(self, fn: Callable, payload, gather: bool) -> list:
        result = fn(self, payload)
        if not (self._distributed and gather):
            return [result]
        gathered: list | None = [None] * dist.get_world_size() if self._rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        return gathered if gathered is not None else [result]

    def _serve_generate(self, gen_batch: int, work: dict) -> list[EngineResult]:
        mine = self.placement.engine_of(self._rank)
        if mine is None or mine not in work:
            return []
        prompts, params = work[mine]
        where = f"generation batch {gen_batch}"
        if self.num_engines > 1:
            where += f", engine {mine} (rank {self._rank})"
        result = generate_with_retries(self.engine, prompts, params, self.cfg, where)
        return [dataclasses.replace(result, engine=mine)]

    def _restart(self, engines: list[int]) -> None:
        """Collective: the owners of `engines` rebuild them, then every rank streams the
        trainer's weights into them."""
        mine = self.placement.engine_of(self._rank)
        if mine in engines:
            try:
                self.engine.shutdown()
            except Exception as e:  # noqa: BLE001 - a dead engine may fail to stop
                print(f"[rollout] warning: engine {mine} (rank {self._rank}) did not shut "
                      f"down cleanly: {type(e).__name__}: {e}", flush=True)
            self.engine = self._factory()
        self.resync(engines)
