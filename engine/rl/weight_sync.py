"""Stream the trainer's weights into a rollout engine in bounded buckets (DESIGN section 9).

The producer is usually `models.bridge.export_hf_weights` (Megatron -> HF names, TP gathered,
vocab unpadded: the same code path as checkpoint conversion). Buckets are formed lazily, so at
most one bucket of full tensors (plus the one tensor that did not fit) is alive at a time.
Units: `bucket_bytes` in bytes; `bucket_mb` in MiB (1 MB here = 2**20 bytes).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from engine.rl.rollout.base import RolloutEngine

BYTES_PER_MB = 2 ** 20


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the tensor's elements (numel * element size)."""
    return tensor.numel() * tensor.element_size()


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]],
                 bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream of (name, tensor) into consecutive lists of total bytes <= bucket_bytes.

    Greedy and order preserving: a tensor joins the current bucket if it still fits, otherwise
    the bucket is yielded and a new one starts with it; a tensor larger than `bucket_bytes` thus
    forms a bucket of its own. Lazy: the input is consumed one tensor at a time, and a bucket is
    yielded as soon as the first tensor that does not fit has been read."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor_bytes(tensor)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


@dataclass
class SyncStats:
    """What one weight sync moved. seconds: wall time of the whole stream (producing the tensors,
    e.g. the TP gather, plus loading them into the engine)."""

    num_tensors: int
    num_buckets: int
    total_bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (1 GB = 1e9 bytes); 0.0 when no time was measured."""
        return self.total_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def sync_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], engine: RolloutEngine,
                 bucket_mb: float) -> SyncStats:
    """Stream `named_tensors` (HF names, full tensors) to `engine.update_weights`, one call per
    bucket of at most `bucket_mb` MiB, and time it (CUDA work is synchronised before stopping
    the clock)."""
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
    num_tensors = num_buckets = total_bytes = 0
    start = time.perf_counter()
    for bucket in iter_buckets(named_tensors, max(1, int(bucket_mb * BYTES_PER_MB))):
        engine.update_weights(bucket)
        num_buckets += 1
        num_tensors += len(bucket)
        total_bytes += sum(tensor_bytes(t) for _, t in bucket)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return SyncStats(num_tensors=num_tensors, num_buckets=num_buckets, total_bytes=total_bytes,
                     seconds=time.perf_counter() - start)
