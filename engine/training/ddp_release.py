"""Freeing a finished megatron model in a process that goes on (layout sweeps, the test rank
pool): what Python's collector cannot free by itself.

Megatron's DistributedDataParallel registers a hook on each parameter's gradient accumulator (a
C++ autograd node) that closes over the DDP, and keeps the nodes in `grad_accs`; an autograd
graph still alive anywhere (a kept loss, a recorded routing) keeps nodes too. Those references
run through C++, so the DDP, its model, its gradient buffers and every process group they hold
(with their gloo or NCCL threads) live until the process exits, even after the groups are
destroyed. `release_ddp` cuts the DDP loose from all of it: the accumulator list and every
attribute (module, buffers, bucket groups, group handles) are dropped, so what the DDP held is
freed at the next collection even if a hook still points at the emptied DDP.
megatron's `RotaryEmbedding.forward` is an lru_cache keyed on the module (it holds up to 32
rotary modules and their CP groups): `clear_megatron_caches` empties it.
"""
from __future__ import annotations

from megatron.core.distributed import DistributedDataParallel
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding


def release_ddp(chunk) -> None:
    """Empty the megatron DDP `chunk` (module docstring); it cannot be used afterwards.
    Anything else is left alone."""
    if not isinstance(chunk, DistributedDataParallel):
        return
    if isinstance(getattr(chunk, "grad_accs", None), list):
        chunk.grad_accs.clear()
    vars(chunk).clear()


def clear_megatron_caches() -> None:
    """Drop the rotary modules megatron's RotaryEmbedding.forward cache holds."""
    cache_clear = getattr(RotaryEmbedding.forward, "cache_clear", None)
    if cache_clear is not None:
        cache_clear()
