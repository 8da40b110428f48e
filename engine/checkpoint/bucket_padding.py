"""Distributed-optimizer state of a multi-bucket gradient buffer, saved correctly.

megatron-core's "fully_reshardable" optimizer format (0.16 and current main, its issue #504)
gathers each DDP bucket's master weights and Adam moments into one "world" tensor per buffer
*without* the padding at the end of each bucket (`get_parameter_state_dp_zero`), then cuts each
parameter out of it at the parameter's offset in the *padded* buffer (`param_index_map`). With
one bucket per buffer (gradient reduction not overlapped) the two agree; with several buckets
(parallel.overlap_grad_reduce, or the separate bucket of tied embeddings with pp > 1) every
parameter after the first padded bucket end is cut from the wrong place, and the checkpoint
holds wrong master weights and moments (seen: a DP2 run saved with 0.02 MiB buckets resumed
with different weights).

`optimizer_sharded_state_dict` builds the optimizer's sharded state dict with each
DistributedOptimizer's `get_parameter_state_dp_zero` answer re-expanded to the padded layout
(bucket b's values back at its start offset, zeros in the padding), so the offsets megatron
uses are right. A no-op where the answer already has the padded length (a megatron that fixes
it) or where nothing is padded.
"""
from __future__ import annotations

import contextlib

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from engine.checkpoint.empty_optimizer import empty_optimizers_answered


def _expand(opt: DistributedOptimizer, state: dict | None) -> dict | None:
    """`state` (get_parameter_state_dp_zero's) with every compact world tensor re-expanded."""
    if state is None:
        return None
    for gbuf_idx, dtype_states in state.items():
        if not isinstance(gbuf_idx, int):
            continue
        buffer = opt.buffers[gbuf_idx]
        unpadded = [b.numel_unpadded for b in buffer.buckets]
        for world in dtype_states.values():
            for key, tensor in list(world.items()):
                if not torch.is_tensor(tensor) or tensor.numel() != sum(unpadded) \
                        or tensor.numel() == buffer.numel:
                    continue
                full = tensor.new_zeros(buffer.numel)
                offset = 0
                for (start, _), n in zip(buffer.bucket_indices, unpadded):
                    full[start:start + n] = tensor[offset:offset + n]
                    offset += n
                world[key] = full
    return state


@contextlib.contextmanager
def _padded_world_state(optimizer):
    opts = [o for o in getattr(optimizer, "chained_optimizers", [optimizer])
            if isinstance(o, DistributedOptimizer)]
    for opt in opts:
        original = opt.get_parameter_state_dp_zero
        opt.get_parameter_state_dp_zero = (
            lambda *a, _opt=opt, _orig=original, **k: _expand(_opt, _orig(*a, **k)))
    try:
        yield
    finally:
        for opt in opts:
            del opt.get_parameter_state_dp_zero   # the class's method again


def optimizer_sharded_state_dict(optimizer, model_sd: dict, is_loading: bool,
                                 metadata: dict) -> dict:
    """`optimizer.sharded_state_dict(model_sd, is_loading, metadata)` with the bucket padding
    fix of the module docstring (collective over the DP group, as megatron's), and optimizers
    without parameters on this rank answered (engine.checkpoint.empty_optimizer)."""
    with _padded_world_state(optimizer), empty_optimizers_answered(optimizer):
        return optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
