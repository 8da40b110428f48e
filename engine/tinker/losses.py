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
- cispo: -(sg(clip(ratio, clip_low_threshold, clip_high_threshold)) * logprobs * advantages)
  .sum(): the clipped ratio is a constant coefficient (no gradient through it).
- dro: -(logprobs * advantages - 0.5 * beta * (logprobs - sampling_logprobs) ** 2).sum().
- gspo (GSPO-token, as the Tinker docs define it): the sequence log-ratio
  r = mean over the tokens `sequence_ratio_mask` marks (!= 0) of sg(logprobs) -
  sampling_logprobs; each token's ratio s_t = exp(r + logprobs - sg(logprobs)) (the sequence
  ratio's value, the token's own gradient); then ppo's clipped objective with s_t:
  -min(s_t * advantages, clip(s_t, clip_low_threshold, clip_high_threshold) * advantages).sum().

cispo's thresholds default to 0.0 and 4.0 (a one-sided clip, as tinker-cookbook's tutorial
202_loss_functions states Tinker's default). gspo's thresholds and dro's beta have no default
here (the Tinker docs' formulas name them but the defaults were not verified), so a request
must give them in loss_fn_config; one without is refused naming the key. Thresholds need clip_low_threshold <=
clip_high_threshold; beta >= 0. gspo needs `sequence_ratio_mask` (no default verified either)
marking at least one token of each datum (`check_values`).

Other names of the SDK's LossFnType (stable_reinforce, custom) are refused by name
(`LossError`, a 400 naming loss_fn and the served ones)."""
from __future__ import annotations

from typing import Callable

import torch


class LossError(ValueError):
    """A request's loss function or its inputs cannot be served; the message names the field."""


RL_INPUTS = ("target_tokens", "logprobs", "advantages")
REQUIRED = {"cross_entropy": ("target_tokens",), "importance_sampling": RL_INPUTS,
            "ppo": RL_INPUTS, "cispo": RL_INPUTS, "dro": RL_INPUTS,
            "gspo": RL_INPUTS + ("sequence_ratio_mask",)}
OPTIONAL = {"cross_entropy": ("weights",), "importance_sampling": ("weights",),
            "ppo": ("weights",), "cispo": (), "dro": (), "gspo": ()}
# a loss's settings: their defaults, None where the request must give the value
CONFIG = {"cross_entropy": {}, "importance_sampling": {},
          "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
          "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
          "dro": {"beta": None},
          "gspo": {"clip_low_threshold": None, "clip_high_threshold": None}}


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


def cispo(lp: torch.Tensor, inputs: dict, config: dict) -> torch.Tensor:
    ratio = torch.exp(lp - inputs["logprobs"])
    coefficient = torch.clamp(ratio, config["clip_low_threshold"],
                              config["clip_high_threshold"]).detach()
    return -(coefficient * lp * inputs["advantages"]).sum()


def dro(lp: torch.Tensor, inputs: dict, config: dict) -> torch.Tensor:
    penalty = (lp - inputs["logprobs"]) ** 2
    return -(lp * inputs["advantages"] - 0.5 * config["beta"] * penalty).sum()


def gspo(lp: torch.Tensor, inputs: dict, config: dict) -> torch.Tensor:
    in_ratio = inputs["sequence_ratio_mask"] != 0
    log_ratio = (lp.detach() - inputs["logprobs"])[in_ratio].mean()
    ratio = torch.exp(log_ratio + lp - lp.detach())
    adv = inputs["advantages"]
    clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
    return -torch.minimum(ratio * adv, clipped * adv).sum()


LOSSES: dict[str, Callable[[torch.Tensor, dict, dict], torch.Tensor]] = {
    "cross_entropy": cross_entropy, "importance_sampling": importance_sampling, "ppo": ppo,
    "cispo": cispo, "dro": dro, "gspo": gspo}


def check_values(name: str, inputs: dict) -> None:
    """The checks of one datum's input values a loss needs (LossError naming the field): gspo's
    sequence_ratio_mask must mark at least one token (its sequence ratio is a mean over them)."""
    if name == "gspo" and not bool((inputs["sequence_ratio_mask"] != 0).any()):
        raise LossError("loss_fn_inputs.sequence_ratio_mask marks no token (loss_fn 'gspo' "
                        "takes the mean log-ratio over the marked tokens)")


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
    missing = [k for k, v in filled.items() if v is None]
    if missing:
        raise LossError(f"loss_fn_config.{missing[0]} is required by loss_fn {name!r} (give "
                        f"{', '.join(k for k in CONFIG[name])}; no default is served)")
    if "clip_low_threshold" in filled and \
            not filled["clip_low_threshold"] <= filled["clip_high_threshold"]:
        raise LossError(f"loss_fn_config.clip_low_threshold {filled['clip_low_threshold']} must "
                        f"be <= clip_high_threshold {filled['clip_high_threshold']}")
    if filled.get("beta", 0.0) < 0:
        raise LossError(f"loss_fn_config.beta {filled['beta']} must be >= 0")
    return filled
