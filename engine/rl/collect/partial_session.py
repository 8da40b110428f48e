"""Partial rollouts on a step driver (engine.rl.collect.partial, rollout.partial): where the pool
is ONE engine in this process with a step driver (engine.rl.agent.rollout.step_driver, the
agent endpoint's decision: vllm without speculative decoding, hf without a vision tower, routed
experts or layers other than full attention), an RL step's generation is ONE driver session
that admits replies as sequence slots free, instead of rounds whose rows all start together.

A session (`run_session`, rank 0, a driver built for it):
1. the carried replies are added first (by group number), each from its prompt + its tokens so
   far with SamplingParams(seeds=[its seed], first_steps=[its tokens so far],
   row_max_new_tokens=[rollout.max_new_tokens - its tokens so far]); then new groups, each
   whole (its rollout.n replies together), while the rows in flight stay within the slot
   budget (`slot_budget`: ceil(partial_oversample x prompts_per_step) x rollout.n rows, on
   vLLM also at most max(rollout.n, max_num_seqs)); admitted rows enter the driver in order
   (a vLLM driver on a CPU host hands vLLM only as many per step as fit its token budget
   beside the running rows, so no prompt is prefilled in chunks: VLLMStepDriver._feed);
2. the driver steps; every finished row goes to the reward pool at once (scored while the
   others generate: engine.rl.collect.partial_scoring) and may complete its group (queued as
   in the rounds path); after every step with a finished row, further new groups are admitted while
   the budget allows (a row added at driver step s > 0 joins rows running since earlier steps);
3. the cut: once train.prompts_per_step groups wait, or the session ran `session_steps` driver
   steps, and no row in flight would outlive rollout.partial_max_staleness if carried
   (PartialCollector.must_finish: while one would, the session keeps stepping until it
   finished, admitting new groups into freed slots only while fewer than
   ceil(partial_oversample x prompts_per_step) groups wait and the bound is >= 1), every row
   still running is aborted and carried with its tokens so far (their log-probs and this
   version; the driver's `so_far`).
Everything is decided by driver step counts and finish events, never by wall time: the same
seed gives the same session. A continued row draws as on the rounds path (hf: u(seed, t) of its
own decode step t, so at fixed weights a cut-and-continued reply is token for token the
uninterrupted one; vLLM: continuation_seed(seed, k), a fresh deterministic draw).

Fill (rollout/engine_fill): busy slot-steps / (slot budget x driver steps), busy = rows that got
a token in a step (from the driver's step outputs: every row is streamed). A failed engine
step aborts the session's rows (engine.generation.steps' aborted_on_error) and raises;
PartialCollector runs the session again from the state it started from (rollout.max_retries,
the engine restarted first when it died).
"""
from __future__ import annotations

import time

from engine.generation import SamplingParams
from engine.generation.steps import BusySlots, aborted_on_error
from engine.rl.collect.partial_checks import groups_in_flight, partial_budget, round_cap
from engine.rl.collect.partial_state import Group, Reply


def slot_budget(cfg, driver) -> int:
    """Rows a session keeps in flight (module docstring, step 1): ceil(partial_oversample x
    prompts_per_step) x rollout.n, on a vLLM engine capped at max(rollout.n, max_num_seqs)."""
    n = cfg.rollout.n
    rows = groups_in_flight(cfg.rollout, cfg.train.prompts_per_step) * n
    vllm_config = getattr(driver.engine, "vllm_config", None)
    if vllm_config is not None:
        rows = min(rows, max(n, int(vllm_config.scheduler_config.max_num_seqs)))
    return rows


def session_steps(cfg) -> int:
    """The session's bound on driver steps: the rounds path's bound on what a row decodes in a
    step, (ceil(rollout.max_new_tokens / partial_max_new_tokens) x (dapo.max_gen_batches under
    dapo.dynamic_sampling, else 1) + 1) x partial_max_new_tokens."""
    return round_cap(cfg) * partial_budget(cfg.rollout)


def _extend(reply: Reply, ids: list[int], logprobs: list[float], version: int) -> None:
    reply.tokens += list(ids)
    reply.logprobs += [float(x) for x in logprobs]
    reply.versions += [version] * len(ids)


def run_session(collector, driver, version: int, log: dict) -> None:
    """One session (module docstring) of `collector` (a PartialCollector: its groups in
    flight, its waiting groups, `start_group`, `prefix`, `complete_groups`) on `driver`, the
    tokens sampled at policy version `version`; adds to `log` (the collector's step counts:
    calls = rows added, tokens, gen_s = seconds inside driver steps, fill)."""
    cfg = collector.cfg
    rollout, p, n = cfg.rollout, cfg.train.prompts_per_step, cfg.rollout.n
    slots, limit = slot_budget(cfg, driver), session_steps(cfg)
    waiting_cap = groups_in_flight(rollout, p)
    live: dict[str, Reply] = {}      # rows in the driver
    fill = BusySlots()

    def add(group: Group) -> None:
        """The group's unfinished rows into the driver, in order (a vLLM driver on a CPU host
        hands them to vLLM as its step's token budget allows: VLLMStepDriver._feed)."""
        for j, reply in enumerate(group.replies):
            if reply.finish is None:
                key = f"{group.number}/{j}"
                driver.add(key, collector.prefix(group, reply), SamplingParams(
                    max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature,
                    top_p=rollout.top_p, seeds=[reply.seed], first_steps=[len(reply.tokens)],
                    row_max_new_tokens=[rollout.max_new_tokens - len(reply.tokens)]),
                    stream=True)
                live[key] = reply
                log["calls"] += 1

    def admit() -> None:
        while may_admit() and len(live) + n <= slots:
            add(collector.start_group())

    def filling() -> bool:   # the session's own phase: fewer than p groups wait
        return len(collector.ready) < p and steps < limit

    def going() -> bool:     # ... or the drain: a row would outlive the staleness bound
        return filling() or collector.must_finish(version)

    def may_admit() -> bool:
        """New groups while filling; while draining (slots would idle) only while fewer than
        ceil(partial_oversample x p) groups wait and the bound is >= 1 (with 0 a new row
        would have to finish too)."""
        return filling() or (rollout.partial_max_staleness >= 1 and len(collector.ready) <
                             waiting_cap and collector.must_finish(version))

    steps = 0
    with aborted_on_error(driver):   # a failed step: nothing of the session stays in the engine
        for group in sorted(collector.groups, key=lambda g: g.number):
            add(group)
        admit()
        while driver.busy and going():
            t0 = time.perf_counter()
            outputs = driver.step()
            log["gen_s"] += time.perf_counter() - t0
            steps += 1
            finished = False
            fill.count(outputs)
            for out in outputs:
                if out.done is not None:
                    reply = live.pop(out.key)
                    _extend(reply, out.done.response_ids, out.done.response_logprobs, version)
                    log["tokens"] += len(out.done.response_ids)
                    reply.finish = "stop" if out.done.finish_reason == "stop" else "length"
                    collector.reply_finished(reply)   # scored while the others generate
                    finished = True
            if finished:
                done = [g for g in collector.groups if g.complete]
                collector.groups = [g for g in collector.groups if not g.complete]
                if done:
                    collector.complete_groups(done, log)
                admit()
    for key, reply in live.items():   # the cut: each row keeps the tokens it has so far
        ids, logprobs = driver.so_far(key)
        driver.abort(key)
        _extend(reply, ids, logprobs, version)
        log["tokens"] += len(ids)
    log["fill"].append((fill.busy, slots * steps))
    log["rounds"] += 1
