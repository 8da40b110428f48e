"""torch's fused AdamW under megatron-core's optimizer (`optim.fused`).

Without Transformer Engine or Apex, megatron-core 0.16 falls back to `torch.optim.AdamW` and
builds it with torch's defaults: the multi-tensor (`foreach`) implementation, about a dozen
kernels per parameter group and step. torch's fused implementation (`fused=True`: one kernel per
device and dtype, reading each parameter, gradient and moment once) computes the same update
(torch's tests hold the two to fp32 rounding). megatron-core gives no way to ask for it, so
`use_fused(optimizer, setting)` switches the torch AdamW/Adam inside megatron's optimizer (every
optimizer of a ChainedOptimizer: dense, experts, Muon's AdamW part) after it is built:
- `optim.fused=null` (default): fused where every parameter of the optimizer is on CUDA;
  `true`: wherever torch's fused kernel exists for the parameters' device and dtype (the CPU
  too: that is how the suite tests it), refused by name where it does not; `false`: never.
- The switch is applied twice, never per step: once after the optimizer is built
  (`use_fused`) and once after every checkpoint load (`reapply`, called by
  engine.checkpoint.checkpointing after megatron's loader): it sets each param group's
  `fused`/`foreach` as this run says and puts every parameter's step counter where that
  implementation wants it (engine.training.adam_steps.place_counters: fused, an fp32 tensor on
  the parameter's device; unfused, a host tensor). A load replaces the param groups (they carry
  the saving run's `fused`) and megatron's loaders create host step counters; `reapply` puts
  both right, so a run resumed with another setting runs its own. The counters keep their
  values: the step numbers, hence the bias corrections, are unchanged.

Exactness: fused and foreach AdamW agree to fp32 rounding, not bitwise (the fused kernel
evaluates the same formula in another order); tests/test_fused_adamw.py measures it.
"""
from __future__ import annotations

import torch
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from engine.training.adam_steps import place_counters

_TORCH_ADAM = (torch.optim.AdamW, torch.optim.Adam)


def torch_adams(optimizer) -> list:
    """The torch Adam/AdamW instances inside megatron's (possibly chained) optimizer."""
    found = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", opt)
        if isinstance(inner, _TORCH_ADAM):
            found.append(inner)
    return found


def _params(opt) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def fused_supported(opt) -> str | None:
    """None when torch's fused AdamW kernel takes every parameter of `opt`, else why not."""
    devices = set(_get_fused_kernels_supported_devices())
    for p in _params(opt):
        if p.device.type not in devices or not p.is_floating_point():
            return f"a {p.dtype} parameter on {p.device.type} (fused AdamW runs on " \
                   f"{', '.join(sorted(devices))}, floating point)"
    return None


def apply_setting(opt, fused: bool) -> None:
    """Every group of the torch optimizer `opt` fused (foreach off) or not (foreach torch's
    choice), as this run says, and its step counters placed for that (adam_steps)."""
    for group in opt.param_groups:
        group["fused"], group["foreach"] = fused, (False if fused else None)
    place_counters(opt, fused)


def use_fused(optimizer, setting: bool | None) -> int:
    """Make every torch AdamW inside megatron's `optimizer` run fused or not per `setting`
    (module docstring), now and after any checkpoint load; returns how many run fused."""
    fused_count = 0
    for opt in torch_adams(optimizer):
        params = _params(opt)
        fused = bool(params) and (setting is True or
                                  (setting is None and all(p.is_cuda for p in params)))
        problem = fused_supported(opt) if fused else None
        if problem:
            raise ValueError(f"optim.fused=true: torch's fused AdamW cannot take {problem}; "
                             f"use optim.fused=null (fused on CUDA only) or false")
        opt.engine_fused = fused
        apply_setting(opt, fused)
        fused_count += fused
    return fused_count


def reapply(optimizer) -> None:
    """After a checkpoint load into megatron's `optimizer`: each torch AdamW that `use_fused`
    set up runs this run's setting again (the load brought the saving run's param groups and
    host step counters)."""
    for opt in torch_adams(optimizer):
        if getattr(opt, "engine_fused", None) is not None:
            apply_setting(opt, opt.engine_fused)
