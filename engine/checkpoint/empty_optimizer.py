"""The state dict of a distributed optimizer that holds no parameter on this rank.

megatron-core builds one DistributedOptimizer per parameter kind (dense, experts) on every
rank, also where the rank's model chunk has none of that kind: a pipeline stage of GLM-4.5 or
DeepSeek-V3 whose layers are all dense (`first_k_dense_replace`), with the expert optimizer
empty there. Without Apex or Transformer Engine (every CPU host, and GPU hosts without them)
its `state_dict` reads Adam's step from the per-parameter state, finds none and fails
(`assert len(steps) == 1`, megatron-core 0.16 distrib_optimizer.py), so such a run could not
save or load a checkpoint.

`empty_optimizers_answered(optimizer)`: while active, each DistributedOptimizer of
`optimizer` (a ChainedOptimizer or one optimizer) with no parameter on this rank answers
`state_dict` as megatron does for a non-empty one, its param groups' `step` set to the step of
the rank's other optimizers (None when no optimizer has stepped yet). Nothing else changes.
"""
from __future__ import annotations

import contextlib

from megatron.core.optimizer import distrib_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from engine.training.adam_steps import common_step


def _owns_no_parameter(opt: DistributedOptimizer) -> bool:
    return not any(group["params"] for group in opt.optimizer.param_groups)


def _state_dict_without_parameters(opt: DistributedOptimizer, step) -> dict:
    """megatron's DistributedOptimizer.state_dict (no Apex / TE branch) for an optimizer
    without parameters: the torch optimizer's param groups with `step`, no parameter state."""
    inner = opt.optimizer.state_dict()
    state = {"optimizer": {k: v for k, v in inner.items() if k != "state"}}
    for group in state["optimizer"]["param_groups"]:
        del group["params"]
        group["step"] = step
    if opt.grad_scaler:
        state["grad_scaler"] = opt.grad_scaler.state_dict()
    return state


@contextlib.contextmanager
def empty_optimizers_answered(optimizer):
    """See the module docstring; a no-op with Apex or Transformer Engine (megatron handles
    empty groups there) or when every optimizer holds parameters."""
    opts = [o for o in getattr(optimizer, "chained_optimizers", [optimizer])
            if isinstance(o, DistributedOptimizer)]
    empty = [o for o in opts if _owns_no_parameter(o)]
    if distrib_optimizer.HAVE_APEX_OR_TE or not empty:
        yield
        return
    step = common_step(o.optimizer for o in opts if o not in empty)
    for opt in empty:
        opt.state_dict = lambda _opt=opt: _state_dict_without_parameters(_opt, step)
    try:
        yield
    finally:
        for opt in empty:
            del opt.state_dict   # the class's method again
