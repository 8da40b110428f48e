"""The `rollout_correction.*` keys (verl 0.9 `algorithm.rollout_correction`): their dataclass,
value sets and the `rollout_rs` / `rollout_rs_threshold` parser. Plain Python, so the RL config
schema and its checks (`--validate`) read them without engine.rl.algo.rollout_correction's
import of the training batch (megatron-core); that module, which computes the weights,
re-exports them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

IS_LEVELS = ("token", "sequence")
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
LOSS_TYPES = ("ppo_clip", "reinforce")


@dataclass
class RolloutCorrectionConfig:
    """verl 0.9 `algorithm.rollout_correction`, same key names and meanings (docs/algorithms.md)."""
    rollout_is: Optional[str] = None             # null | token | sequence
    rollout_is_threshold: float = 2.0            # upper truncation of the IS weight
    rollout_is_batch_normalize: bool = False     # IS weights / their batch mean
    rollout_rs: Optional[str] = None             # comma list of RS_OPTIONS (all must pass)
    rollout_rs_threshold: Optional[str] = None   # per option; k1: "lower_upper" or upper
    bypass_mode: bool = False                    # old policy := rollout log-probs, no recompute
    loss_type: str = "ppo_clip"                  # bypass only: ppo_clip | reinforce

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None


def parse_rs(options: str, spec) -> list[tuple[str, Optional[float], float]]:
    """[(option, lower or None, upper)] from `rollout_rs` / `rollout_rs_threshold` (verl's
    rules: one threshold shared by all options or one per option). Raises ValueError."""
    names = list(dict.fromkeys(o.strip() for o in str(options).split(",") if o.strip()))
    if not names:
        raise ValueError("rollout_correction.rollout_rs names no option")
    bad = [o for o in names if o not in RS_OPTIONS]
    if bad:
        raise ValueError(f"rollout_correction.rollout_rs={options!r}: {', '.join(bad)} not "
                         f"valid; choose from {', '.join(RS_OPTIONS)}")
    if spec is None:
        raise ValueError("rollout_correction.rollout_rs_threshold must be set with rollout_rs")
    specs = [p.strip() for p in str(spec).split(",") if p.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(f"rollout_correction.rollout_rs_threshold={spec!r} needs one value or "
                         f"{len(names)} (one per rollout_rs option)")
    specs = specs * len(names) if len(specs) == 1 else specs
    out = []
    for name, s in zip(names, specs):
        try:
            if name.endswith("k1"):
                lo, hi = s.split("_", 1) if "_" in s else (None, s)
                upper = float(hi)
                lower = float(lo) if lo is not None else 1.0 / upper
            elif "_" in s:
                raise ValueError
            else:
                lower, upper = None, float(s)
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"rollout_correction.rollout_rs_threshold={spec!r}: {s!r} is not a "
                             f"valid threshold of {name} (k1: 'lower_upper' or a number; k2/k3: "
                             "one number)") from None
        if upper <= 0 or (lower is not None and lower <= 0):
            raise ValueError(f"rollout_correction.rollout_rs_threshold={spec!r}: thresholds of "
                             f"{name} must be > 0")
        out.append((name, lower, upper))
    return out
