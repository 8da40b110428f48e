"""torch Adam's per-parameter step counters, in one place.

torch's Adam/AdamW keep each parameter's step in its state (`state[p]["step"]`, a tensor; a plain
number in older checkpoints). Three parts of the engine handle them, and each rule lives here:

- where a counter sits (`place_counters`): torch's fused kernel wants an fp32 tensor on the
  parameter's device, the foreach/for-loop paths a host tensor (torch's default without
  capturable/fused); the value is kept, so the bias corrections do not change
  (engine.training.fused_adamw applies it after build and after every checkpoint load);
- megatron-core 0.16's "fully_reshardable" optimizer load copies every per-parameter state key
  but stores no step (the step lives in the param groups): `steps_set_aside` takes the counters
  out while megatron copies the moments and puts them back (engine.checkpoint.checkpointing);
  megatron also hands every parameter the same step tensor, which torch would then increment
  once per parameter: `own_counters` gives each parameter its own copy;
- an optimizer without parameters on a rank answers megatron's `state_dict` with the step of
  the rank's other optimizers (`common_step`; engine.checkpoint.empty_optimizer).
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch


def place_counters(opt, fused: bool) -> None:
    """Every step counter of the torch optimizer `opt` where the implementation wants it (fused:
    an fp32 tensor on the parameter's device; else a host tensor), with the value it had; a
    plain number becomes a tensor."""
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p)
            step = state.get("step") if state else None
            if step is None:
                continue
            if not torch.is_tensor(step):
                step = torch.tensor(float(step), dtype=torch.float32)
            if fused and (step.device != p.device or step.dtype != torch.float32):
                step = step.to(device=p.device, dtype=torch.float32)
            elif not fused and step.device.type != "cpu":
                step = step.cpu()
            state["step"] = step


@contextlib.contextmanager
def steps_set_aside(opt) -> Iterator[None]:
    """While active, the torch optimizer `opt` holds no per-parameter step (megatron's
    fully_reshardable load copies every key it finds); the counters return on exit."""
    steps = {p: s.pop("step") for p, s in opt.state.items() if "step" in s}
    try:
        yield
    finally:
        for p, step in steps.items():
            opt.state[p]["step"] = step


def own_counters(opts: Iterable) -> None:
    """Each parameter of the torch optimizers `opts` gets its own step tensor (a loader that
    shares one tensor among parameters would have torch increment it once per parameter)."""
    for opt in opts:
        for s in opt.state.values():
            if isinstance(s.get("step"), torch.Tensor):
                s["step"] = s["step"].clone()


def common_step(opts: Iterable) -> float | None:
    """The one step of the torch optimizers `opts` on this rank (None: not stepped yet); raises
    when their counters disagree."""
    steps = {float(s["step"]) for opt in opts for s in opt.state.values() if "step" in s}
    if len(steps) > 1:
        raise RuntimeError(f"the rank's optimizers disagree about the step: {sorted(steps)}")
    return steps.pop() if steps else None
