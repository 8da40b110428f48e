"""RL algorithm presets, looked up by name (`algorithm=...`).

A preset only chooses defaults: `preset(cfg)` returns {dotted key: value}, applied to every
key the user did not set explicitly (`apply_algorithm_defaults` below). A new
algorithm is one `register_algorithm` call here (plus, when it needs new math, an advantage
estimator in engine.rl.algo.advantages or a policy loss in engine.rl.algo.policy_loss).
"""
from __future__ import annotations

import os
from typing import Any, Callable

from omegaconf import OmegaConf

from engine.config.schema import split_argv
from engine.errors import ConfigError
from engine.rl.algo.registry import registrar

Preset = Callable[[Any], dict[str, Any]]
ALGORITHMS: dict[str, Preset] = {}

register_algorithm = registrar(ALGORITHMS)


@register_algorithm("grpo")
def grpo(cfg) -> dict[str, Any]:
    """The schema defaults: symmetric clip 0.2, token-mean, KL to the initial policy with beta
    0.001 (k3), group-normalised advantages, no dynamic sampling, no overlong shaping."""
    return {}


@register_algorithm("ppo")
def ppo(cfg) -> dict[str, Any]:
    """PPO with a learned critic: GAE advantages (gamma, lam 1.0 as verl), whitened over the
    rollout batch; the critic is configured under critic.*."""
    return {"advantage.estimator": "gae"}


@register_algorithm("dapo")
def dapo(cfg) -> dict[str, Any]:
    """DAPO paper: clip higher (0.2 / 0.28), token-mean, dynamic sampling, soft overlong
    punishment over the last max_new_tokens // 5 tokens (the paper's 4096 of 20480), no KL,
    lr 1e-6."""
    return {"clip.eps_low": 0.2, "clip.eps_high": 0.28, "loss.agg_mode": "token-mean",
            "dapo.dynamic_sampling": True,
            "dapo.overlong_buffer": cfg.rollout.max_new_tokens // 5,
            "kl.beta": 0.0, "optim.lr": 1e-6}


def _flatten(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        out = []
        for k, v in node.items():
            out += _flatten(v, f"{prefix}{k}.")
        return out or [prefix.rstrip(".")]
    return [prefix.rstrip(".")]


def explicit_keys(argv: list[str]) -> set[str]:
    """Dotted keys the user set: hydra overrides (`a.b=1`, `+a.b=1`, `~a.b`) and every leaf of
    the `--config` / `config=` YAML file."""
    config_file, overrides, _ = split_argv(argv)
    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    if config_file and os.path.isfile(config_file):
        keys |= set(_flatten(OmegaConf.to_container(OmegaConf.load(config_file))))
    return keys


def _is_explicit(key: str, explicit: set[str]) -> bool:
    parts = key.split(".")
    return any(".".join(parts[:i]) in explicit for i in range(1, len(parts) + 1))


def apply_algorithm_defaults(cfg, explicit: set[str]):
    """Set the defaults of `cfg.algorithm` (an RLConfig) on every key not in `explicit` (nor
    under an explicit group), and `reward.fn=none` when reward.model.path or
    reward.judge.base_url is set and reward.fn is not (the reward model and the judge are then
    the only reward sources). Mutates and returns `cfg`;
    ConfigError for an unknown algorithm."""
    if cfg.algorithm not in ALGORITHMS:
        raise ConfigError(f"algorithm={cfg.algorithm!r} is not valid; choose one of "
                          f"{', '.join(ALGORITHMS)}")
    for key, value in ALGORITHMS[cfg.algorithm](cfg).items():
        if not _is_explicit(key, explicit):
            group, name = key.split(".")
            setattr(getattr(cfg, group), name, value)
    if (cfg.reward.model.path or cfg.reward.judge.base_url) and \
            not _is_explicit("reward.fn", explicit):
        cfg.reward.fn = "none"
    return cfg
