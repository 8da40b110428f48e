"""The colocated weight sync: stream the trainer's weights into the rollout engines in bounded
buckets (docs/design/rl.md).

`sync_to_rollout` is the transport (collective): every pipeline stage of every model replica
exports its HF tensors (engine.rl.policy.weight_export, the path the disaggregated sender uses
too); each engine's owner assembles the full model from its own replica's stages (its own
export plus point-to-point streams from the other stages' TP rank 0) and feeds its engine
through `sync_weights`, bucketed by weight_export.BucketStream. `check_weight_sync` is the
optional debug probe (rollout.check_weight_sync). Units: `bucket_mb` in MiB (2**20 bytes).
With rollout.sync_quantization the streams carry FP8 weights (sent between ranks as their raw
bytes: collectives backends need not know float8) and their scales.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from engine.rl.policy.weight_export import (BucketStream, LayoutTable, SyncStats,
                                            export_stage_weights, layout_table, stage_heads)
from engine.generation.base import RolloutEngine
from models.build.forward import forward_logits
from models.hf.quantized_stream import QuantizedSource
from parallel import cpu_runtime

_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)

def sync_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], engine: RolloutEngine,
                 bucket_mb: float) -> SyncStats:
    """Stream `named_tensors` (HF names, full tensors) to `engine.update_weights`, one call per
    bucket of at most `bucket_mb` MiB, and time it (CUDA work is synchronised before stopping
    the clock)."""
    stream = BucketStream(named_tensors, bucket_mb)
    for bucket in stream:
        engine.update_weights(bucket)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return stream.stats()


def _send_tensor(name: str | None, tensor: torch.Tensor | None, dst: int) -> None:
    dist.send_object_list([None if name is None else (name, tuple(tensor.shape), tensor.dtype)],
                          dst=dst)
    if name is not None:
        raw = tensor.contiguous()
        dist.send(raw.view(torch.uint8) if raw.dtype in _FLOAT8 else raw, dst=dst)


def _recv_stream(src: int) -> Iterator[tuple[str, torch.Tensor]]:
    while True:
        meta = [None]
        dist.recv_object_list(meta, src=src)
        if meta[0] is None:
            return
        name, shape, dtype = meta[0]
        wire = torch.uint8 if dtype in _FLOAT8 else dtype
        buf = torch.empty(shape, dtype=wire, device=cpu_runtime.device())
        dist.recv(buf, src=src)
        yield name, buf.view(dtype)


def stage_sources(owner: int, table: LayoutTable) -> list[int]:
    """The ranks whose exports make up `owner`'s stream, in pipeline-stage order: for every
    stage of the owner's replica, the owner itself when it holds that stage, else the stage's
    TP rank 0."""
    replica, own_stage, _ = table[owner]
    heads = stage_heads(table)
    stages = sorted(stage for rep, stage in heads if rep == replica)
    return [owner if stage == own_stage else heads[(replica, stage)] for stage in stages]


def sync_to_rollout(chunks: list, hf_config: dict, engine: RolloutEngine | None,
                    bucket_mb: float, owners: Sequence[int] = (0,),
                    targets: Sequence[int] | None = None,
                    quantized: QuantizedSource | None = None,
                    adapters: bool = False) -> SyncStats | None:
    """Stream the trainer's weights (HF names, full tensors) into the rollout engines.

    Collective over the world. `owners[e]` is the global rank owning engine e (`engine` is this
    rank's own engine, or None); `targets` the engines to fill (default: all). Every rank runs
    models.bridge.weights.export_hf_weights for its pipeline stage (TP all-gathers inside each TP
    group, every model replica in parallel). Each target owner takes its own replica's
    tensors: its own stage's from its own export, the other stages' from their TP rank 0,
    point-to-point. No tensor passes through a rank that does not need it, and replicas on
    different nodes stream in parallel: with a replica inside a node (tp x pp <= GPUs per
    node) nothing crosses nodes. `quantized` (rollout.sync_quantization): the exports that
    reach an engine are quantized as the source checkpoint stores them, on the rank that
    exports (weight_export.export_stage_weights); ranks whose export reaches no engine skip it.
    `adapters` (rollout.vllm.lora_sync=adapter): every rank exports its stage's LoRA adapters in
    peft's names instead of weights (the same transport).
    Returns SyncStats on the target owners, None elsewhere."""
    targets = list(range(len(owners))) if targets is None else list(targets)
    dests = [owners[e] for e in targets]
    me = dist.get_rank()
    table = layout_table()
    # the owners (other than me) that take my export as their stream of my stage
    receivers = [o for o in dests if o != me and me in stage_sources(o, table)]
    used = quantized if (receivers or me in dests) else None

    def my_export() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in export_stage_weights(chunks, hf_config, used, adapters):
            for o in receivers:
                _send_tensor(name, tensor, dst=o)
            yield name, tensor
        for o in receivers:
            _send_tensor(None, None, dst=o)

    if me in dests:
        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for src in stage_sources(me, table):
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
    over all engines on a fixed probe (fp32, models.build.forward.forward_logits; collective over the
    world, needs cp == 1 and engines whose `supports_logit_probe`), and how far rank 0's engine's
    logits moved from `before`. Where the engine reports log-probs (`logit_probe_space`
    "logprobs", vLLM) both sides are compared as log_softmax of the logits. `engine`: this
    rank's own engine, or None."""
    probe = probe_tokens(vocab_size)
    trainer = forward_logits(chunks, probe, vocab_size).cpu()
    mine = None
    if engine is not None:
        if engine.logit_probe_space == "logprobs":
            trainer = trainer.float().log_softmax(-1)
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
