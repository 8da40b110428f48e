"""Checkpoints of megatron-core's layer-wise distributed optimizer in fp32 (Muon with
optim.distributed_optimizer=true, engine.training.muon).

megatron-core 0.16.1's `LayerWiseDistributedOptimizer.sharded_state_dict` post-processes each
chained optimizer's sharded state dict as a mixed-precision optimizer's (`sd["optimizer"]
["state"]`, `sd["optimizer"]["param_groups"]`): it wraps an empty state (a rank that owns no
parameter of that optimizer) so it is not saved, and takes each param group's metadata from a
rank that owns parameters in it. An fp32 optimizer (`FP32Optimizer`, model.dtype=float32)
answers the torch optimizer's own layout (`sd["state"]`, `sd["param_groups"]`), and the
post-processing fails with KeyError: 'optimizer'. `LayerWiseOptimizer` presents each fp32
optimizer's answer under the key "optimizer" while megatron-core post-processes it and removes
the key again, so the saved layout is the one FP32Optimizer.load_state_dict reads. Nothing
else changes; bf16 runs (mixed-precision optimizers) go through megatron-core untouched. Its
entry in models.build.megatron_patches (`layer_wise_fp32_checkpoints`) refuses, by name, a
megatron-core outside the versions it was written for or whose probe fails.
"""
from __future__ import annotations

from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
from megatron.core.optimizer.optimizer import FP32Optimizer

from models.build import megatron_patches

_KEY = "optimizer"


class LayerWiseOptimizer(LayerWiseDistributedOptimizer):
    """megatron-core's LayerWiseDistributedOptimizer whose sharded state dict also works with
    fp32 optimizers in the chain (module docstring)."""

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        wrapped = [i for i, opt in enumerate(self.chained_optimizers)
                   if isinstance(opt, FP32Optimizer)]
        for i in wrapped:
            opt = self.chained_optimizers[i]
            answer = opt.sharded_state_dict
            opt.sharded_state_dict = lambda *a, _answer=answer, **k: {_KEY: _answer(*a, **k)}
        try:
            sd = super().sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
        finally:
            for i in wrapped:
                del self.chained_optimizers[i].sharded_state_dict   # the bound method again
        if len(self.chained_optimizers) == 1:
            return sd[_KEY] if wrapped else sd
        return {i: (v[_KEY] if i in wrapped else v) for i, v in sd.items()}


def with_fp32_checkpoints(optimizer):
    """`optimizer` (megatron-core's LayerWiseDistributedOptimizer, from
    get_megatron_muon_optimizer) as a LayerWiseOptimizer: the same object, its class
    switched to the subclass above (no state is added)."""
    assert type(optimizer) is LayerWiseDistributedOptimizer, type(optimizer)
    megatron_patches.gate("layer_wise_fp32_checkpoints")   # refuses (raises) or applies
    optimizer.__class__ = LayerWiseOptimizer
    return optimizer
