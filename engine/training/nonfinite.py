"""Skip optimizer steps whose loss or gradient is not finite, and stop a run that keeps
producing them.

Megatron's optimizers only check for inf/NaN when an fp16 loss scaler is active; in bf16/fp32
a NaN gradient norm makes the clip coefficient NaN and Adam writes NaN into every weight.
`guarded_optimizer_step` runs the same stages as megatron's `optimizer.step()` (prepare grads,
global grad norm, clip by that norm, step) but returns before the update when the global loss
or the global grad norm is not finite: weights, Adam moments and the step counter stay as they
were. With megatron-core's layer-wise distributed optimizer (Muon, optim.distributed_optimizer)
`step()` would also all-gather the updated parameters; this step calls its `allgather_params`
after the update. Both numbers are already reduced over every rank that holds a piece of them (the loss
over DP x CP and the pipeline by engine.training.schedule.reduce_reports; the grad norm by megatron over
the model-parallel and, with the distributed optimizer, data-parallel groups), so every rank
takes the same decision without another collective.

`NonFiniteGuard` counts skipped steps (`train/skipped_steps`); after `limit` skipped steps in a
row (`train.max_consecutive_nonfinite_steps`) the loop raises `TrainingDiverged`, which the
entry point reports without a traceback (exit code 1). No checkpoint is written then: the
newest one holds the last good weights.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

from engine.errors import RunError
from engine.training.grad_norm import install as install_grad_norm


class TrainingDiverged(RunError):
    """Too many consecutive optimizer steps with a non-finite loss or gradient; the message
    says which steps, what was seen and what to try."""


@torch.no_grad()
def guarded_optimizer_step(optimizer, loss: float) -> tuple[bool, float]:
    """Megatron optimizer step unless `loss` (global) or the global grad norm is not finite.

    `optimizer` is a megatron MegatronOptimizer or ChainedOptimizer whose gradients are
    reduced (finalize_model_grads has run). Returns (stepped, grad_norm): grad_norm is the
    global L2 norm of the gradients before clipping (computed also when clip_grad is 0)."""
    install_grad_norm()   # megatron's grad norm and clip scale with one host sync
    found_inf = optimizer.prepare_grads()   # True only with an fp16 loss scaler
    grad_norm = float(optimizer.get_grad_norm())
    if found_inf or not math.isfinite(grad_norm) or not math.isfinite(loss):
        return False, grad_norm
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "is_stub_optimizer", False) or opt.config.clip_grad <= 0.0:
            continue
        params = opt.get_parameters()
        if params:
            clip_grad_by_total_norm_fp32(
                params, max_norm=opt.config.clip_grad, total_norm=grad_norm,
                use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    stepped = bool(optimizer.step_with_ready_grads())
    gather = getattr(optimizer, "allgather_params", None)
    if gather is not None:   # Muon's layer-wise distributed optimizer: each DP rank updated
        gather()             # its own parameters; every rank now takes the others'
    return stepped, grad_norm


@dataclass
class NonFiniteGuard:
    """Counts skipped optimizer steps and decides when a run has diverged.

    `record` is called after every optimizer step; once `limit` steps in a row were skipped,
    `raise_if_diverged` (called by the loop after it has logged the step's metrics) raises
    TrainingDiverged. `skipped` counts the whole run (a resumed run starts from the
    checkpoint's count), `streak` holds (step, loss, grad_norm) of the current run of skips."""
    limit: int = 3
    skipped: int = 0
    streak: list = field(default_factory=list)

    def record(self, step: int, stepped: bool, loss: float, grad_norm: float) -> None:
        """Account for optimizer step `step` (its 1-based number, used in the message)."""
        if stepped:
            self.streak = []
        else:
            self.skipped += 1
            self.streak.append((step, loss, grad_norm))

    @property
    def diverged(self) -> bool:
        return len(self.streak) >= self.limit

    def raise_if_diverged(self) -> None:
        if self.diverged:
            raise TrainingDiverged(self._message())

    def _message(self) -> str:
        shown = [f"step {s}: loss {loss:.4g}, grad_norm {g:.4g}" for s, loss, g in self.streak]
        if len(shown) > 4:
            shown = shown[:2] + ["..."] + shown[-1:]
        seen = "; ".join(shown)
        first = self.streak[0][0]
        return (f"{len(self.streak)} optimizer steps in a row had a non-finite loss or gradient "
                f"({seen}); they were skipped, so the weights are those before step {first}. "
                f"Stopping (train.max_consecutive_nonfinite_steps={self.limit}). Try a lower "
                "optim.lr or a longer optim.warmup_steps, a smaller optim.clip_grad, "
                "model.dtype=float32 to rule out bf16 overflow, and check the samples of those "
                "steps (logging.sample_ids=true); then resume from the last checkpoint")
