"""Start-time checks of `rollout_correction.*`, `sapo.*` and the keys they combine with (run by
engine.rl.config.rl_problems before any process group exists; each problem names its key)."""
from __future__ import annotations

from engine.rl.rollout_correction import IS_LEVELS, LOSS_TYPES, parse_rs


def correction_problems(cfg) -> list[str]:
    """Every violated constraint, as sentences naming the key and the valid values."""
    c = cfg.rollout_correction
    p: list[str] = []
    if c.rollout_is is not None and c.rollout_is not in IS_LEVELS:
        p.append(f"rollout_correction.rollout_is={c.rollout_is!r} is not valid; choose one of "
                 f"null, {', '.join(IS_LEVELS)}")
    if not (isinstance(c.rollout_is_threshold, (int, float)) and c.rollout_is_threshold > 0):
        p.append(f"rollout_correction.rollout_is_threshold={c.rollout_is_threshold!r} must be "
                 "a number > 0 (the upper truncation of the IS weight)")
    if c.rollout_rs is not None:
        try:
            parse_rs(c.rollout_rs, c.rollout_rs_threshold)
        except ValueError as e:
            p.append(str(e))
    elif c.rollout_rs_threshold is not None:
        p.append(f"rollout_correction.rollout_rs_threshold={c.rollout_rs_threshold!r} is set but "
                 "rollout_correction.rollout_rs is null (set both, or neither)")
    if c.loss_type not in LOSS_TYPES:
        p.append(f"rollout_correction.loss_type={c.loss_type!r} is not valid; choose one of "
                 f"{', '.join(LOSS_TYPES)}")
    if c.bypass_mode:
        if cfg.policy_loss != "ppo_clip":
            p.append(f"rollout_correction.bypass_mode=true replaces policy_loss with "
                     f"rollout_correction.loss_type (verl's bypass loss); policy_loss="
                     f"{cfg.policy_loss!r} cannot be combined with it (leave policy_loss=ppo_clip)")
        if c.rollout_is_batch_normalize:
            p.append("rollout_correction.rollout_is_batch_normalize=true needs the IS weights of "
                     "the whole batch before the first micro-batch, but bypass_mode=true computes "
                     "them from the current policy inside each micro-batch; use it in decoupled "
                     "mode (bypass_mode=false)")
    elif c.loss_type != "ppo_clip":
        p.append(f"rollout_correction.loss_type={c.loss_type!r} applies only with "
                 "rollout_correction.bypass_mode=true (decoupled mode uses policy_loss)")
    if c.rollout_is_batch_normalize and c.rollout_is is None:
        p.append("rollout_correction.rollout_is_batch_normalize=true needs "
                 "rollout_correction.rollout_is (token or sequence)")
    for key in ("tau_pos", "tau_neg"):
        value = getattr(cfg.sapo, key)
        if not value > 0:
            p.append(f"sapo.{key}={value} must be > 0")
    return p
