"""The Tinker loss functions served, on one datum's per-token log-probs.

Each takes `logprobs` [T] (log p(target_tokens[t] | tokens <= t) under the model with the
user's adapter, differentiable) and the datum's `loss_fn_inputs` as float tensors [T], and
returns the datum's loss, a sum over its tokens, as the Tinker docs define them:

- cross_entropy: -(logprobs * weights).sum(); `weights` defaults to all ones.
- importance_sampling: -(exp(logprobs - sampling_logprobs) * advantages).sum(), where
  `sampling_logprobs` is the input `logprobs`.
- ppo: ratio = exp(logprobs - sampling_logprobs);
  -min(ratio * advantages, clip(ratio, clip_low_threshold, clip_high_threshold) * advantages)
  .sum(); the thresholds come from loss_fn_config (defaults 0.8 and 1.2).

Other names of the SDK's LossFnType (cispo, dro, gspo, stable_reinforce, custom) are refused by
name (`LossError`, a 400 naming loss_fn and the served ones)."""
from __future__ import annotations

from typing import Callable

import torch


class LossError(ValueError):
    """A request's loss function or its inputs cannot be served; the message names the field."""


REQUIRED = {"cross_entropy": ("target_tokens",),
            "importance_sampling": ("target_tokens", "logprobs", "advantages"),
            "ppo": ("target_tokens", "logprobs", "advantages")}
OPTIONAL = {"cross_entropy": ("weights",), "importance_sampling": ("weights",),
            "ppo": ("weights",)}
CONFIG = {"cross_entropy": {}, "importance_sampling": {},
          "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}}


def cross_entropy(lp: torch.Tensor, inputs: dict, config: dict) -> torch.Tensor:
    weights = inputs.get("weights")
    return -(lp * weights).sum() if weights is not None else -lp.sum()


def importance_sampling(lp: torch.Tensor, inputs: dict, config: dict) -> torch.Tensor:
    ratio = torch.exp(lp - inputs["logprobs"])
    return -(ratio * inputs["advantages"]).sum()


def ppo(lp: torch.Tensor, inputs: dict, config: dict) -> torch.Tensor:
    ratio = torch.exp(lp - inputs["logprobs"])
    adv = inputs["advantages"]
    clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
    return -torch.minimum(ratio * adv, clipped * adv).sum()


LOSSES: dict[str, Callable[[torch.Tensor, dict, dict], torch.Tensor]] = {
    "cross_entropy": cross_entropy, "importance_sampling": importance_sampling, "ppo": ppo}


def check_loss(name: str, input_keys: set[str], config: dict | None) -> dict:
    """The loss's config with defaults filled; LossError naming the field otherwise."""
    if name not in LOSSES:
        raise LossError(f"loss_fn {name!r} is not served; served: {', '.join(LOSSES)}")
    missing = [k for k in REQUIRED[name] if k not in input_keys]
    if missing:
        raise LossError(f"loss_fn_inputs lacks {', '.join(missing)} (loss_fn {name!r} needs "
                        f"{', '.join(REQUIRED[name])})")
    extra = sorted(input_keys - set(REQUIRED[name]) - set(OPTIONAL[name]))
    if extra:
        raise LossError(f"loss_fn_inputs.{extra[0]} is not an input of loss_fn {name!r} "
                        f"(valid: {', '.join(REQUIRED[name] + OPTIONAL[name])})")
    filled = dict(CONFIG[name])
    for key, value in (config or {}).items():
        if key not in filled:
            raise LossError(f"loss_fn_config.{key} is not a setting of loss_fn {name!r} "
                            f"(valid: {', '.join(filled) or 'none'})")
        if not isinstance(value, (int, float)):
            raise LossError(f"loss_fn_config.{key} must be a number, got {value!r}")
        filled[key] = float(value)
    return filled
