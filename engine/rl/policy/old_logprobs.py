"""Where an RL step's old (proximal) log-probs come from: a pure function of the config
(`old_logprobs_plan`), decided once per run and printed in the run header. Plain Python (no
torch), so the config checks and `--validate` read it too.

pi_old is the trainer's policy before the step's first update (docs/algorithms.md). Three
sources:

- "forward" (train.old_logprobs=auto, the default, where the update is exactly on-policy): the
  step makes ONE optimizer step (train.mini_batches_per_step=1, train.epochs_per_rollout=1),
  so its only training forward runs at the very weights the separate pass would read, and
  nothing reads the old log-probs before that forward (no decoupled rollout correction, no
  distillation advantage shift, no MoE routing replay). The loss takes old_logp = logp.detach()
  from the training forward (engine.rl.policy.update: the ratio is exactly 1, the clip
  fractions 0) and no separate pass runs. This holds whatever sampled the replies (partial
  or asynchronous ones too): without rollout correction the behaviour log-probs enter only
  rollout/logprob_diff[_max], which the training forward measures the same way.
- "recompute": a forward-only pass over the whole rollout batch in the log-prob stage
  (engine.rl.policy.logprob_stage), wherever the policy may move before a training forward
  reads pi_old or the stage itself needs them; or asked for (train.old_logprobs=recompute).
- "rollout": rollout_correction.bypass_mode=true: the rollout engine's log-probs are pi_old.
"""
from __future__ import annotations

from dataclasses import dataclass

OLD_LOGPROBS_CHOICES = ("auto", "recompute")


@dataclass(frozen=True)
class OldLogprobsPlan:
    source: str      # forward | recompute | rollout
    reason: str      # why, for the run header

    @property
    def from_forward(self) -> bool:
        return self.source == "forward"

    def describe(self) -> str:
        """The run header's line."""
        if self.source == "forward":
            return f"old log-probs: from the training forward (on-policy: {self.reason})"
        if self.source == "rollout":
            return f"old log-probs: the rollout engine's ({self.reason})"
        return f"old log-probs: separate pass because {self.reason}"


def _recompute_reasons(cfg) -> list[str]:
    """Why the step needs the separate pass, in the config's own words (empty: it does not)."""
    train, corr = cfg.train, cfg.rollout_correction
    reasons = []
    if train.old_logprobs == "recompute":
        reasons.append("train.old_logprobs=recompute")
    if train.epochs_per_rollout > 1:
        reasons.append(f"train.epochs_per_rollout={train.epochs_per_rollout} (the policy moves "
                       "between epochs)")
    if train.mini_batches_per_step > 1:
        reasons.append(f"train.mini_batches_per_step={train.mini_batches_per_step} (the policy "
                       "moves after the first mini-batch)")
    if corr.enabled:
        reasons.append("rollout_correction.rollout_is/rollout_rs weigh or reject tokens by "
                       "old vs rollout log-probs before the update")
    if cfg.distill.teacher_path:
        reasons.append("distill.teacher_path shifts the advantages by old - teacher "
                       "log-probs before the update")
    if cfg.moe.routing_replay:
        reasons.append(f"moe.routing_replay={cfg.moe.routing_replay} (the old-log-prob forward "
                       + ("records the routing)" if cfg.moe.routing_replay == "R2" else
                          "measures moe/rollout_replay_mismatch)"))
    return reasons


def old_logprobs_plan(cfg) -> OldLogprobsPlan:
    """The source of the old log-probs for every step of the run `cfg` (an RLConfig with
    train.old_logprobs in OLD_LOGPROBS_CHOICES; engine.rl.checks refuses other values)."""
    if cfg.rollout_correction.bypass_mode:
        return OldLogprobsPlan("rollout", "rollout_correction.bypass_mode=true")
    reasons = _recompute_reasons(cfg)
    if reasons:
        return OldLogprobsPlan("recompute", "; ".join(reasons))
    return OldLogprobsPlan("forward", "one mini-batch, one epoch, no rollout correction, "
                                      "distillation or routing replay")


def old_logprobs_problems(cfg) -> list[str]:
    """train.old_logprobs against its choices and rollout_correction.bypass_mode."""
    value = cfg.train.old_logprobs
    if value not in OLD_LOGPROBS_CHOICES:
        return [f"train.old_logprobs={value!r} is not valid; choose one of "
                f"{', '.join(OLD_LOGPROBS_CHOICES)}"]
    if value == "recompute" and cfg.rollout_correction.bypass_mode:
        return ["train.old_logprobs=recompute asks for the old-log-prob pass, which "
                "rollout_correction.bypass_mode=true replaces with the rollout log-probs; "
                "use train.old_logprobs=auto with bypass_mode=true"]
    return []
