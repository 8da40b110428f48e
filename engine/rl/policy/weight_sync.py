"""Stream the trainer's weights into a rollout engine in bounded buckets (DESIGN section 9).

`sync_to_rollout` is the transport (collective): every pipeline stage of every model replica
exports its HF tensors (TP all-gathers inside models.bridge.export_hf_weights); each engine's
owner assembles the full model from its own replica's stages (its own export plus point-to-point
streams from the other stages' TP rank 0) and feeds its engine through `sync_weights`. `check_weight_sync` is the optional
debug probe (rollout.check_weight_sync). The producer is models.bridge.export_hf_weights
(Megatron -> HF names, TP gathered, vocab unpadded: the same code path as checkpoint
conversion). Buckets are formed lazily, so at
most one bucket of full tensors (plus the one tensor that did not fit) is alive at a time.
Units: `bucket_bytes` in bytes; `bucket_mb` in MiB (1 MB here = 2**20 bytes).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from engine.rl.rollout.base import RolloutEngine
from engine.training.comm_overlap import finish_param_gather
from models.bridge import export_hf_weights
from models.forward import forward_logits
from parallel import cpu_runtime

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


def _send_tensor(name: str | None, tensor: torch.Tensor | None, dst: int) -> None:
    dist.send_object_list([None if name is None else (name, tuple(tensor.shape), tensor.dtype)],
                          dst=dst)
    if name is not None:
        dist.send(tensor.contiguous(), dst=dst)


def _recv_stream(src: int) -> Iterator[tuple[str, torch.Tensor]]:
    while True:
        meta = [None]
        dist.recv_object_list(meta, src=src)
        if meta[0] is None:
            return
        name, shape, dtype = meta[0]
        buf = torch.empty(shape, dtype=dtype, device=cpu_runtime.device())
        dist.recv(buf, src=src)
        yield name, buf


def _stage_sources(owner: int, table: list[tuple[int, int, int]]) -> list[int]:
    """The ranks whose exports make up `owner`'s stream, in pipeline-stage order: for every
    stage of the owner's replica (same data/context-parallel index), the owner itself when it
    holds that stage, else the stage's TP rank 0. `table[r]` = (replica, stage, tp_rank)."""
    replica, own_stage, _ = table[owner]
    stages = sorted({s for rep, s, _ in table if rep == replica})
    return [owner if s == own_stage else
            next(r for r, (rep, st, tp) in enumerate(table) if rep == replica and st == s
                 and tp == 0)
            for s in stages]


def sync_to_rollout(chunks: list, hf_config: dict, engine: RolloutEngine | None,
                    bucket_mb: float, owners: Sequence[int] = (0,),
                    targets: Sequence[int] | None = None) -> SyncStats | None:
    """Stream the trainer's weights (HF names, full tensors) into the rollout engines.

    Collective over the world. `owners[e]` is the global rank owning engine e (`engine` is this
    rank's own engine, or None); `targets` the engines to fill (default: all). Every rank runs
    models.bridge.export_hf_weights for its pipeline stage (TP all-gathers inside each TP
    group, every model replica in parallel). Each target owner takes its own replica's
    tensors: its own stage's from its own export, the other stages' from their TP rank 0,
    point-to-point. No tensor passes through a rank that does not need it, and replicas on
    different nodes stream in parallel: with a replica inside a node (tp x pp <= GPUs per
    node) nothing crosses nodes. Returns SyncStats on the target owners, None elsewhere."""
    finish_param_gather(chunks)   # overlap_param_gather defers it to the next forward pass
    targets = list(range(len(owners))) if targets is None else list(targets)
    dests = [owners[e] for e in targets]
    me = dist.get_rank()
    table: list = [None] * dist.get_world_size()
    dist.all_gather_object(table, (ps.get_data_parallel_rank(with_context_parallel=True),
                                   ps.get_pipeline_model_parallel_rank(),
                                   ps.get_tensor_model_parallel_rank()))
    # the owners (other than me) that take my export as their stream of my stage
    receivers = [o for o in dests if o != me and me in _stage_sources(o, table)]

    def my_export() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in export_hf_weights(chunks, hf_config):
            for o in receivers:
                _send_tensor(name, tensor, dst=o)
            yield name, tensor
        for o in receivers:
            _send_tensor(None, None, dst=o)

    if me in dests:
        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for src in _stage_sources(me, table):
                yield from (my_export() if src == me else _recv_stream(src))

        return sync_weights(stream(), engine, bucket_mb)
    for _ in my_export():
        pass
    return None


def probe_tokens(vocab_size: int, length: int = 24) -> torch.Tensor:
    """The fixed [1, length] token probe of check_weight_sync."""
    return torch.tensor([[(7 * i + 3) % vocab_size for i in range(length)]])


def check_weight_sync(chunks: list, vocab_size: int, engine: RolloutEngine | None,
                      before: torch.Tensor | None) -> dict[str, float]:
    """Debug metrics after a sync, on rank 0: the largest max |engine logits - trainer logits|
    over all engines on a fixed probe (fp32, models.forward.forward_logits; collective over the
    world, needs cp == 1 and engines whose `supports_logit_probe`), and how far rank 0's engine's
    logits moved from `before`. `engine`: this rank's own engine, or None."""
    probe = probe_tokens(vocab_size)
    trainer = forward_logits(chunks, probe, vocab_size).cpu()
    mine = None
    if engine is not None:
        after = engine.probe_logits(probe)
        mine = (float((after - trainer).abs().max()),
                float((after - before).abs().max()) if before is not None else None)
    found: list = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    if dist.get_rank() != 0:
        return {}
    out = {"debug/sync_logit_max_diff": max(f[0] for f in found if f is not None)}
    if mine is not None and mine[1] is not None:
        out["debug/sync_logit_change"] = mine[1]
    return out
