"""Speculative decoding in a vLLM rollout engine, seen from its owner
(engine.generation.vllm.backend; keys rollout.vllm.speculative.*, checked by
engine.generation.vllm.speculative_settings; docs/rollout-backends.md).

- Counters: vLLM's own spec-decode counters (`llm.get_metrics()`: vllm:spec_decode_num_drafts,
  ..._num_draft_tokens, ..._num_accepted_tokens; the engine is built with stats on), read after
  every generate as deltas. `Speculation.take` hands the sums since its last call to the rollout
  pool (engine.generation.pool), which adds them over engines and generation batches; the
  collector logs rollout/spec_acceptance = accepted / proposed draft tokens and
  rollout/spec_mean_accepted_tokens = accepted draft tokens per drafting step (one drafting
  step: one target forward of a request that had drafts; the tokens it yields are that + 1),
  and rollout/spec_enabled (`spec_metrics`).
- The automatic off switch (`OffSwitch`): after `patience_steps` generate calls in a row (one
  per RL step, more under dapo.dynamic_sampling) whose acceptance is below `min_acceptance`,
  the engine stops speculating. vLLM 0.32 cannot turn a built engine's drafter off, so the
  engine is rebuilt without speculative_config at the next weight sync (whose buckets then
  write every parameter of the new engine: nothing stale is served), with a WARNING; from then
  on rollout/spec_enabled is 0. A restarted engine (RolloutPool's restart after a failure)
  comes back with speculation on.
- The draft and the policy: a sync that carries no MTP layer tensor (model.mtp.enabled off, so
  the trainer exports none) leaves the MTP drafter as the checkpoint had it; the owner warns
  once that the draft is the checkpoint's untrained head and will lag the policy.
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

COUNTERS = {"vllm:spec_decode_num_drafts": "drafts",
            "vllm:spec_decode_num_draft_tokens": "proposed",
            "vllm:spec_decode_num_accepted_tokens": "accepted"}
FIELDS = ("drafts", "proposed", "accepted")


class OffSwitch:
    """Whether to stop speculating: `observe(proposed, accepted)` per generate call returns True
    once `patience` calls in a row had accepted / proposed < `min_acceptance` (a call that
    proposed nothing neither counts nor resets). min_acceptance None: never."""

    def __init__(self, min_acceptance: float | None, patience: int) -> None:
        self.min_acceptance, self.patience = min_acceptance, patience
        self.low = 0

    def observe(self, proposed: float, accepted: float) -> bool:
        if self.min_acceptance is None or proposed <= 0:
            return False
        self.low = self.low + 1 if accepted / proposed < self.min_acceptance else 0
        return self.low >= self.patience


def read_counters(llm) -> dict[str, float]:
    """vLLM's cumulative spec-decode counters (FIELDS), summed over their labels."""
    out = dict.fromkeys(FIELDS, 0.0)
    for metric in llm.get_metrics():
        field = COUNTERS.get(metric.name)
        if field is not None:
            out[field] += float(metric.value)
    return out


def merge_counters(batches: list[dict]) -> dict[str, float]:
    """The counters of consecutive generate batches (generation batches of a step, turns of
    multi-turn episodes; each GenerateStats.counters, summed over engines) as one: FIELDS
    summed, "enabled" the last batch's; {} when none has counters."""
    batches = [c for c in batches if c]
    if not batches:
        return {}
    out = {k: float(sum(c.get(k, 0.0) for c in batches)) for k in FIELDS}
    return {**out, "enabled": float(batches[-1].get("enabled", 0.0))}


def spec_metrics(batches: list[dict], engines: int) -> dict[str, float]:
    """rollout/spec_* of one RL step from the pool's counters of each generation batch
    (`merge_counters`) over `engines` engines; {} when no engine speculates nor did.
    Acceptance and the mean accepted tokens per drafting step are over the whole step;
    spec_enabled is the share of engines speculating in its last generation batch."""
    c = merge_counters(batches)
    if not c:
        return {}
    proposed, accepted, drafts = c["proposed"], c["accepted"], c["drafts"]
    return {"rollout/spec_acceptance": accepted / proposed if proposed > 0 else 0.0,
            "rollout/spec_mean_accepted_tokens": accepted / drafts if drafts > 0 else 0.0,
            "rollout/spec_proposed_tokens": proposed,
            "rollout/spec_enabled": c["enabled"] / max(engines, 1)}


class Speculation:
    """The owner's view of one engine's speculation: its counters since the last `take`, the
    off switch, the warnings. `method`: rollout.vllm.speculative.method (mtp | draft_model)."""

    def __init__(self, method: str, min_acceptance: float | None, patience: int) -> None:
        self.method, self.enabled, self.off_requested = method, True, False
        self.switch = OffSwitch(min_acceptance, patience)
        self.last: dict[str, float] | None = None
        self.pending = dict.fromkeys(FIELDS, 0.0)
        self.warned_untrained = False

    def after_generate(self, llm) -> dict[str, float]:
        """Read the counters after a generate call; the call's deltas. May request the off
        switch (WARNING)."""
        now = read_counters(llm)
        last = self.last or dict.fromkeys(FIELDS, 0.0)
        if any(now[k] < last[k] for k in FIELDS):   # a new engine's counters started at 0
            last = dict.fromkeys(FIELDS, 0.0)
        self.last = now
        delta = {k: now[k] - last[k] for k in FIELDS}
        for k in FIELDS:
            self.pending[k] += delta[k]
        if self.enabled and not self.off_requested and \
                self.switch.observe(delta["proposed"], delta["accepted"]):
            self.off_requested = True
            logger.warning(
                "rollout.vllm.speculative: acceptance stayed below min_acceptance=%s for %d "
                "generate calls in a row (last: %.3f of %d draft tokens); speculation is "
                "turned off: the engine is rebuilt without its draft at the next weight sync",
                self.switch.min_acceptance, self.switch.patience,
                delta["accepted"] / max(delta["proposed"], 1.0), int(delta["proposed"]))
        return delta

    def turned_off(self) -> None:
        """The engine was rebuilt without speculation."""
        self.enabled, self.off_requested, self.last = False, False, None
        logger.warning("rollout.vllm.speculative: the engine now runs without speculative "
                       "decoding (rollout/spec_enabled 0)")

    def after_sync(self, draft_written: bool) -> None:
        """After a closed sync: warn once when an MTP draft was not written by it."""
        if self.method == "mtp" and self.enabled and not draft_written \
                and not self.warned_untrained:
            self.warned_untrained = True
            logger.warning(
                "rollout.vllm.speculative.method=mtp: the weight sync carried no MTP layer "
                "tensors (model.mtp.enabled is off): the draft is the checkpoint's untrained "
                "MTP head and will lag the policy (watch rollout/spec_acceptance)")

    def take(self) -> dict[str, float]:
        """The counters since the last take, with "enabled" (1 or 0)."""
        out, self.pending = self.pending, dict.fromkeys(FIELDS, 0.0)
        return {**out, "enabled": 1.0 if self.enabled else 0.0}
