"""Weights across the split job (rollout.placement=disaggregated; engine.rl.disaggregated.world): the
training side's senders and the messages they send. The receiving end is
engine.rl.disaggregated.inbox.

Senders: every pipeline stage of a training replica sends ITS OWN part; the stage's first
rank (TP rank 0) does the sending (engine.rl.policy.weight_export: TP and expert parallel
gathered inside the stage, the same path as checkpoint conversion and the colocated sync).
Replica d feeds the rollout engines e with e % replicas == d, so no tensor passes through a rank
that does not hold it, and replicas stream in parallel. Each engine owner receives version v as
one stream per stage, in stage order, on the WEIGHTS group (tag TAG_WEIGHTS):
("bucket", v, [(name, shape, dtype, kind, changed), ...], base) followed by one uint8 tensor
per entry, ..., then ("end", v); or, from the first stage's sender only, ("stop",) when the
trainer stops before the rollout side's last batch. Buckets hold at most rollout.sync_bucket_mb
MiB of whole tensors. `kind` is the entry's encoding (engine.rl.disaggregated.delta: "full", the
raw bytes, or with rollout.sync_delta a delta, "index" or "mask", of `changed` elements against
version `base` that the receiver holds; base None: every entry of the message is full). The
sender keeps its last sent version (SenderBases: one host copy of its stage in the sent dtype)
and, per receiver, the version it holds; the first version a receiver gets is full.
With rollout.sync_quantization=fp8 the senders' streams carry FP8 weights and their scales
(raw bytes travel as they are; weight_export.export_stage_weights quantizes on the sender).

Messages from the rollout leader to training rank 0 (tag TAG_ROLLOUT, one ordered stream on
the bridge): ("batch", k, RolloutBatch, next_gen_batch, rollout.partial's
PartialCollector.state() after batch k or None), ("val", v, metrics) and ("error", kind,
message). Training rank 0 starts the rollout side with one TAG_CONTROL message.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from engine.rl.disaggregated.delta import SenderBases, WireStats
from engine.rl.disaggregated.world import SplitWorld, send_object, send_tensor
from engine.rl.policy.weight_export import (BucketStream, SyncStats, export_stage_weights,
                                            layout_table, stage_heads)

TAG_ROLLOUT, TAG_WEIGHTS, TAG_CONTROL = 11, 12, 13


@dataclass
class TransferPlan:
    """Who sends weights to whom (job ranks). `sends[r]`: the engine owners sender r streams its
    stage to; `sources[o]`: owner o's senders in pipeline-stage order; `first_stage`: the
    senders of stage 0 (they alone send "stop")."""

    sends: dict[int, list[int]] = field(default_factory=dict)
    sources: dict[int, list[int]] = field(default_factory=dict)
    first_stage: set[int] = field(default_factory=set)


def transfer_plan(split: SplitWorld, engine_owners: list[int]) -> TransferPlan:
    """Collective over the training world: the plan for engines owned by `engine_owners`
    (rollout-world ranks, the rollout placement's owners)."""
    heads = stage_heads(layout_table())
    replicas = sorted({rep for rep, _ in heads})[:len(engine_owners)]
    stages = sorted({pp for _, pp in heads})
    plan = TransferPlan(first_stage={heads[(rep, stages[0])] for rep in replicas})
    for e, owner in enumerate(engine_owners):
        rep = replicas[e % len(replicas)]
        job_owner = split.num_train + owner
        plan.sources[job_owner] = [heads[(rep, pp)] for pp in stages]
        for sender in plan.sources[job_owner]:
            plan.sends.setdefault(sender, []).append(job_owner)
    return plan


def push_weights(split: SplitWorld, chunks, hf_config: dict, bucket_mb: float,
                 plan: TransferPlan, version: int, bases: SenderBases, quantized=None,
                 adapters: bool = False) -> tuple[SyncStats, WireStats] | None:
    """Collective over the training world: every stage exports its weights (TP/EP gathered);
    each sender streams its stage's buckets, tagged `version`, to its engine owners, each
    tensor full or as a delta against the version that owner holds (`bases`: this rank's
    SenderBases, kept across versions). Returns the sender's SyncStats (whole-tensor bytes of
    its own stage per owner) and WireStats (what it put on the wire for all its owners), None
    on other ranks. `quantized`: a models.hf.quantized_stream.QuantizedSource
    (rollout.sync_quantization), used by the senders only. `adapters`
    (rollout.vllm.lora_sync=adapter): the LoRA adapters in peft's names instead of weights
    (weight_export.export_stage_weights), on every rank."""
    targets = plan.sends.get(dist.get_rank(), [])
    what = f"sending weight version {version}"
    stream = BucketStream(export_stage_weights(chunks, hf_config,
                                               quantized if targets else None, adapters),
                         bucket_mb)
    against = {dst: bases.base_for(dst) for dst in targets}
    wire = WireStats()
    for bucket in stream:  # every rank of the stage exports (TP/EP gathers); senders send
        if not targets:
            continue
        coded = [bases.encode(name, t, any(b is not None for b in against.values()))
                 for name, t in bucket]
        for dst in targets:
            mine = [c[0] if against[dst] is not None else c[1] for c in coded]
            meta = [(name, tuple(t.shape), t.dtype, e.kind, e.changed)
                    for (name, t), e in zip(bucket, mine)]
            send_object(split, ("bucket", version, meta, against[dst]), dst, TAG_WEIGHTS, what,
                        group=split.weights)
            for (_, t), e in zip(bucket, mine):
                send_tensor(split, e.payload, dst, TAG_WEIGHTS, what, group=split.weights)
                wire.bytes += e.payload.numel()
                wire.changed += e.changed
                wire.elements += t.numel()
    if not targets:
        return None
    for dst in targets:
        send_object(split, ("end", version), dst, TAG_WEIGHTS, what, group=split.weights)
    bases.sent(version, targets)
    return stream.stats(), wire


def send_stop(split: SplitWorld, plan: TransferPlan) -> None:
    """Training ranks: tell the engine owners no further version comes (early stop)."""
    me = dist.get_rank()
    if me in plan.first_stage:
        for dst in plan.sends[me]:
            send_object(split, ("stop",), dst, TAG_WEIGHTS, "sending stop", group=split.weights)
