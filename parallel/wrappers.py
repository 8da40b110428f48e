"""The model inside megatron's wrappers (DistributedDataParallel, Float16Module): one `unwrap`
for every package that reaches a GPTModel chunk's modules through them."""
from __future__ import annotations


def unwrap(chunk):
    """The GPTModel inside DDP / Float16Module wrappers (the chunk itself if bare)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk
