"""RL algorithm presets, looked up by name (`algorithm=...`).

A preset only chooses defaults: `preset(cfg)` returns {dotted key: value}, applied to every
key the user did not set explicitly (engine.rl.config.apply_algorithm_defaults). A new
algorithm is one `register_algorithm` call here (plus, when it needs new math, an advantage
estimator in engine.rl.advantages or a policy loss in engine.rl.policy_loss).
"""
from __future__ import annotations

from typing import Any, Callable

from engine.rl.registry import registrar

Preset = Callable[[Any], dict[str, Any]]
ALGORITHMS: dict[str, Preset] = {}

register_algorithm = registrar(ALGORITHMS)


@register_algorithm("grpo")
def grpo(cfg) -> dict[str, Any]:
    """The schema defaults: symmetric clip 0.2, token-mean, KL to the initial policy with beta
    0.001 (k3), group-normalised advantages, no dynamic sampling, no overlong shaping."""
    return {}


@register_algorithm("dapo")
def dapo(cfg) -> dict[str, Any]:
    """DAPO paper: clip higher (0.2 / 0.28), token-mean, dynamic sampling, soft overlong
    punishment over the last max_new_tokens // 5 tokens (the paper's 4096 of 20480), no KL,
    lr 1e-6."""
    return {"clip.eps_low": 0.2, "clip.eps_high": 0.28, "loss.agg_mode": "token-mean",
            "dapo.dynamic_sampling": True,
            "dapo.overlong_buffer": cfg.rollout.max_new_tokens // 5,
            "kl.beta": 0.0, "optim.lr": 1e-6}
