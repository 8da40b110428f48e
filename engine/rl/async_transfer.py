"""What crosses the bridge between training and rollout ranks (rollout.placement=disaggregated;
engine.rl.split_world): weights, version-tagged, in rollout.sync_bucket_mb buckets; rollout
batches; control messages. Every wait has rollout.peer_timeout_s (BridgeTimeout names the peer).

Weights of version v (the policy after v RL steps) go from each SENDER (the first rank, TP 0 and
pipeline stage 0, of a training replica; replica d feeds the rollout engines e with
e % senders == d) to every engine owner it feeds, as a stream of messages with tag TAG_WEIGHTS:
("bucket", v, [(name, shape, dtype), ...]) followed by one uint8 tensor per entry (the raw
bytes), ..., then ("end", v); or ("stop",) when the trainer stops before the rollout side's
last batch. The sender gets its replica's tensors through engine.rl.weight_sync.sync_to_rollout
(models.bridge.export_hf_weights: TP gathered on every stage, the other pipeline stages
streamed to it point-to-point), so one code path converts for checkpoints, colocated sync and
this transfer. Batches go from the rollout leader to training rank 0 with tag TAG_BATCH.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from engine.rl.split_world import SplitWorld, recv_object, recv_tensor, send_object, send_tensor
from engine.rl.weight_sync import SyncStats, sync_to_rollout

TAG_BATCH, TAG_WEIGHTS, TAG_CONTROL = 11, 12, 13


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


class BridgeSender:
    """The `engine` sync_to_rollout feeds on a sender rank: each bucket goes to every target
    (job ranks of engine owners) tagged with `version`."""

    def __init__(self, split: SplitWorld, targets: list[int], version: int) -> None:
        self.split, self.targets, self.version = split, targets, version

    def update_weights(self, bucket) -> None:
        meta = [(n, tuple(t.shape), t.dtype) for n, t in bucket]
        for dst in self.targets:
            what = f"sending weight version {self.version}"
            send_object(self.split, ("bucket", self.version, meta), dst, TAG_WEIGHTS, what)
            for _, t in bucket:
                send_tensor(self.split, _raw(t), dst, TAG_WEIGHTS, what)

    def end(self) -> None:
        for dst in self.targets:
            send_object(self.split, ("end", self.version), dst, TAG_WEIGHTS,
                        f"ending weight version {self.version}")


def engine_senders(split: SplitWorld, engine_owners: list[int]) -> dict[int, list[int]]:
    """Collective over the training world: {sender job rank: [engine owner job ranks]}.
    `engine_owners` are rollout-world ranks (the rollout placement's owners)."""
    table: list = [None] * dist.get_world_size()
    dist.all_gather_object(table, (ps.get_data_parallel_rank(with_context_parallel=True),
                                   ps.get_pipeline_model_parallel_rank(),
                                   ps.get_tensor_model_parallel_rank()))
    heads = sorted((rep, r) for r, (rep, pp, tp) in enumerate(table) if pp == 0 and tp == 0)
    senders = [r for _, r in heads][:len(engine_owners)]
    out: dict[int, list[int]] = {s: [] for s in senders}
    for e, owner in enumerate(engine_owners):
        out[senders[e % len(senders)]].append(split.num_train + owner)
    return out


def push_weights(split: SplitWorld, chunks, hf_config: dict, bucket_mb: float,
                 senders: dict[int, list[int]], version: int) -> SyncStats | None:
    """Collective over the training world: stream version `version` to every engine owner."""
    me = dist.get_rank()
    sender = BridgeSender(split, senders[me], version) if me in senders else None
    stats = sync_to_rollout(chunks, hf_config, sender, bucket_mb, tuple(senders))
    if sender is not None:
        sender.end()
    return stats


def send_stop(split: SplitWorld, senders: dict[int, list[int]]) -> None:
    """Training ranks: tell the engine owners no further version comes (early stop)."""
    for dst in senders.get(dist.get_rank(), []):
        send_object(split, ("stop",), dst, TAG_WEIGHTS, "sending stop")


@dataclass
class Received:
    version: int | None      # None: the trainer stopped
    buckets: int
    nbytes: int


def receive_weights(split: SplitWorld, engine, src: int) -> Received:
    """An engine owner: load the next version from sender job rank `src` into `engine`, bucket
    by bucket (the engine switches only now, between generation batches)."""
    buckets = nbytes = 0
    while True:
        head = recv_object(split, src, TAG_WEIGHTS, "waiting for the next weight version")
        if head[0] == "stop":
            return Received(None, buckets, nbytes)
        if head[0] == "end":
            return Received(head[1], buckets, nbytes)
        bucket = []
        for name, shape, dtype in head[2]:
            n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            raw = recv_tensor(split, torch.empty(n, dtype=torch.uint8), src, TAG_WEIGHTS,
                              f"receiving weight version {head[1]}")
            bucket.append((name, raw.view(dtype).reshape(shape)))
            nbytes += n
        engine.update_weights(bucket)
        buckets += 1
