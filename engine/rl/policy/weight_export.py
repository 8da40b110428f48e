"""The one weight-export path of RL: the trainer's weights as HF-named full tensors, per
pipeline stage, in bounded buckets. Shared by the colocated sync (engine.rl.policy.weight_sync)
and the disaggregated sender (engine.rl.disaggregated.weight_send).

- `export_stage_weights`: finish the deferred parameter all-gather (ddp overlap_param_gather
  defers it to the next forward pass), then models.bridge.weights.export_hf_weights for this rank's
  pipeline stage (Megatron -> HF names, TP and expert-parallel gathered inside the stage, vocab
  unpadded: the same code path as checkpoint conversion).
- `layout_table` / `stage_heads`: which rank holds which (replica, stage, TP rank), so each
  stage's TP rank 0 can send its stage and each engine owner knows its sources.
- `BucketStream`: consecutive buckets of at most `bucket_mb` MiB (1 MB = 2**20 bytes), formed
  lazily (at most one bucket of full tensors, plus the one tensor that did not fit, is alive),
  counting what passed (`stats`). A quantized weight's scale (`*_scale_inv`, right after its
  weight in the stream) always joins its weight's bucket, so an engine loads both in one call.
- rollout.sync_quantization=fp8: `export_stage_weights(..., quantized)` yields the weights the
  source checkpoint stores in FP8 as FP8 + scales (models.hf.quantized_stream.QuantizedSource).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from engine.training.comm_overlap import finish_param_gather
from models.bridge.weights import export_hf_weights
from models.formats.fp8 import SCALE_SUFFIX
from models.hf.conditional import peft_layers
from models.lora.peft import export_peft_tensors
from models.lora.sites import lora_spec_of, merged_weight
from models.hf.quantized_stream import QuantizedSource

BYTES_PER_MB = 2 ** 20

# table[rank] = (model replica: data/context-parallel rank, pipeline stage, TP rank)
LayoutTable = list[tuple[int, int, int]]


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the tensor's elements (numel * element size)."""
    return tensor.numel() * tensor.element_size()


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]],
                 bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream of (name, tensor) into consecutive lists of total bytes <= bucket_bytes.

    Greedy and order preserving: a tensor joins the current bucket if it still fits, otherwise
    the bucket is yielded and a new one starts with it; a tensor larger than `bucket_bytes` thus
    forms a bucket of its own. A `*_scale_inv` tensor (a quantized weight's scale, streamed
    right after its weight) never starts a bucket: it stays with its weight (a bucket may exceed the
    limit by one scale: 4 bytes per weight block). Lazy: the input is consumed one tensor at a
    time, and a bucket is yielded as soon as the first tensor that does not fit has been
    read."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor_bytes(tensor)
        if bucket and size + nbytes > bucket_bytes and not name.endswith(SCALE_SUFFIX):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


@dataclass
class SyncStats:
    """What one weight stream moved. seconds: wall time of the whole stream (producing the
    tensors, e.g. the TP gather, plus consuming them)."""

    num_tensors: int
    num_buckets: int
    total_bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (1 GB = 1e9 bytes); 0.0 when no time was measured."""
        return self.total_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class BucketStream:
    """Iterate the buckets (lists of (name, tensor), at most `bucket_mb` MiB each) of
    `named_tensors`; `stats()` is what passed so far, timed from construction."""

    def __init__(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_mb: float):
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        self._buckets = iter_buckets(named_tensors, max(1, int(bucket_mb * BYTES_PER_MB)))
        self._start = time.perf_counter()
        self._tensors = self._count = self._bytes = 0

    def __iter__(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        for bucket in self._buckets:
            self._tensors += len(bucket)
            self._count += 1
            self._bytes += sum(tensor_bytes(t) for _, t in bucket)
            yield bucket

    def stats(self) -> SyncStats:
        return SyncStats(self._tensors, self._count, self._bytes,
                         time.perf_counter() - self._start)


def export_stage_weights(chunks: list, hf_config: dict, quantized: QuantizedSource | None = None,
                         adapters: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's pipeline stage as HF-named full tensors (a lazy stream). Collective over the
    stage's TP (and expert-parallel) group: every rank of the stage must consume it. The
    deferred parameter gather is finished here, before the stream starts. With LoRA adapters
    the tensors are the merged weights, base + scaling * B A (models.lora.sites.merged_weight,
    one weight at a time). `quantized` (rollout.sync_quantization; pass it only on ranks whose
    stream reaches an engine): the weights its source stores quantized are yielded as their
    stored parts (FP8: the fp8 weight, then its fp32 `weight_scale_inv`). `adapters`
    (rollout.vllm.lora_sync=adapter, engine.generation.vllm.lora): the LoRA adapters alone, in
    peft's names and format (models.lora.peft.export_peft_tensors), instead of any weight.
    """
    finish_param_gather(chunks)
    if adapters:
        return export_peft_tensors(chunks, peft_layers(hf_config))
    merged = merged_weight if lora_spec_of(chunks) is not None else None
    stream = export_hf_weights(chunks, hf_config, transform=merged)
    return stream if quantized is None else quantized.quantize(stream)


def layout_table() -> LayoutTable:
    """Collective over the default group (the training world): every rank's (replica, stage,
    TP rank), indexed by rank."""
    table: list = [None] * dist.get_world_size()
    dist.all_gather_object(table, (ps.get_data_parallel_rank(with_context_parallel=True),
                                   ps.get_pipeline_model_parallel_rank(),
                                   ps.get_tensor_model_parallel_rank()))
    return table


def stage_heads(table: LayoutTable) -> dict[tuple[int, int], int]:
    """(replica, stage) -> the rank that sends that stage: its TP rank 0."""
    return {(replica, stage): rank for rank, (replica, stage, tp) in enumerate(table) if tp == 0}
