"""The receiving end of the weight transfer on a rollout engine owner (engine.rl.disaggregated.weight_send).

A background thread receives each version as soon as the trainer sends it, into host memory,
while the engine keeps generating with the version it holds; the main thread takes it between
generation batches (`take`) and loads it. The thread holds at most ONE version ahead (the
trainer's next send waits until the main thread has taken it), and the owner keeps the version
its engine serves (`WeightState.current`) to reload a restarted engine: host memory up to
2 x the model's bytes in the training dtype per engine owner.

rollout.sync_delta (engine.rl.disaggregated.delta): entries may come as deltas against the
version the thread received last (ReceiverBases: the tensors of that version, which are the
ones in the queue or the served `current`: no extra copy); each is rebuilt into a new tensor,
the base left untouched, so the Version handed on holds whole tensors, bitwise those of a full
sync. A delta against a version this owner does not hold is refused (DeltaRefused), never
applied.

Timeouts: the thread waits for the start of a version without a deadline (the trainer sends it
after a training step of any length); the main thread's `take` waits at most
rollout.peer_timeout_s and then names the sender (BridgeTimeout). A transfer error in the
thread reaches the main thread at its next `take`.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

import torch

from engine.rl.disaggregated.delta import FULL, ReceiverBases, decode, payload_bytes
from engine.rl.disaggregated.weight_send import TAG_WEIGHTS
from engine.rl.disaggregated.world import BridgeTimeout, SplitWorld, recv_object, recv_tensor

_NO_DEADLINE_S = 365 * 24 * 3600.0


@dataclass
class Version:
    """One received version (None: the trainer stopped) and its buckets of HF-named tensors."""

    version: int | None
    buckets: list[list[tuple[str, torch.Tensor]]] = field(default_factory=list)


def receive_version(split: SplitWorld, sources: list[int],
                    bases: ReceiverBases | None = None) -> Version:
    """The next version from `sources` (one stream per pipeline stage, in stage order); its
    deltas are applied to `bases`, which then hold this version (a fresh ReceiverBases when
    None: full tensors only)."""
    bases = ReceiverBases() if bases is None else bases
    out = Version(None)
    for i, src in enumerate(sources):
        while True:
            first = i == 0 and out.version is None  # the wait for the trainer's next step
            head = recv_object(split, src, TAG_WEIGHTS, "waiting for the next weight version",
                               timeout_s=_NO_DEADLINE_S if first else None, group=split.weights)
            if head[0] == "stop":
                return Version(None)
            if out.version is None:
                out.version = head[1]
            elif head[1] != out.version:
                raise RuntimeError(f"weight stream of {split.describe_peer(src)} carries version "
                                   f"{head[1]}, the other stages version {out.version}")
            if head[0] == "end":
                break
            out.buckets.append(receive_bucket(split, src, head, bases))
    bases.version = out.version
    bases.tensors = {name: t for bucket in out.buckets for name, t in bucket}
    return out


def receive_bucket(split: SplitWorld, src: int, head: tuple, bases: ReceiverBases
                   ) -> list[tuple[str, torch.Tensor]]:
    """The entries of one ("bucket", v, meta, base) message, whole tensors."""
    _, version, meta, against = head
    bucket = []
    for name, shape, dtype, kind, changed in meta:
        esize = torch.empty((), dtype=dtype).element_size()
        n = payload_bytes(kind, torch.Size(shape).numel(), changed, esize)
        raw = recv_tensor(split, torch.empty(n, dtype=torch.uint8), src, TAG_WEIGHTS,
                          f"receiving weight version {version}", group=split.weights)
        base = None if kind == FULL else bases.base(name, against, version)
        bucket.append((name, decode(kind, changed, raw, shape, dtype, base)))
    return bucket


class WeightInbox:
    """The receiving thread of one engine owner (module docstring)."""

    def __init__(self, split: SplitWorld, sources: list[int]) -> None:
        self.split, self.sources = split, sources
        self._box: queue.Queue = queue.Queue(maxsize=1)
        self.bases = ReceiverBases()   # the last received version (the deltas' base)
        threading.Thread(target=self._run, name="weight-inbox", daemon=True).start()

    def _run(self) -> None:
        try:
            while True:
                got = receive_version(self.split, self.sources, self.bases)
                self._box.put(got)
                if got.version is None:
                    return
        except Exception as e:  # noqa: BLE001 - handed to the main thread
            self._box.put(e)

    def take(self, expected: int) -> Version:
        """The next version (blocks up to rollout.peer_timeout_s)."""
        try:
            got = self._box.get(timeout=self.split.timeout_s)
        except queue.Empty:
            raise BridgeTimeout(
                f"waiting for weight version {expected}: no answer from "
                f"{self.split.describe_peer(self.sources[0])} within rollout.peer_timeout_s="
                f"{self.split.timeout_s:g} s (the trainer died, hung or is far behind)") from None
        if isinstance(got, Exception):
            raise got
        return got
