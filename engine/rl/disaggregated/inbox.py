"""The receiving end of the weight transfer on a rollout engine owner (engine.rl.disaggregated.weight_send).

A background thread receives each version as soon as the trainer sends it, into host memory,
while the engine keeps generating with the version it holds; the main thread takes it between
generation batches (`take`) and loads it. The thread holds at most ONE version ahead (the
trainer's next send waits until the main thread has taken it), and the owner keeps the version
its engine serves (`WeightState.current`) to reload a restarted engine: host memory up to
2 x the model's bytes in the training dtype per engine owner.

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

from engine.rl.disaggregated.weight_send import TAG_WEIGHTS
from engine.rl.disaggregated.world import BridgeTimeout, SplitWorld, recv_object, recv_tensor

_NO_DEADLINE_S = 365 * 24 * 3600.0


@dataclass
class Version:
    """One received version (None: the trainer stopped) and its buckets of HF-named tensors."""

    version: int | None
    buckets: list[list[tuple[str, torch.Tensor]]] = field(default_factory=list)


def receive_version(split: SplitWorld, sources: list[int]) -> Version:
    """The next version from `sources` (one stream per pipeline stage, in stage order)."""
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
            bucket = []
            for name, shape, dtype in head[2]:
                n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                raw = recv_tensor(split, torch.empty(n, dtype=torch.uint8), src, TAG_WEIGHTS,
                                  f"receiving weight version {head[1]}", group=split.weights)
                bucket.append((name, raw.view(dtype).reshape(shape)))
            out.buckets.append(bucket)
    return out


class WeightInbox:
    """The receiving thread of one engine owner (module docstring)."""

    def __init__(self, split: SplitWorld, sources: list[int]) -> None:
        self.split, self.sources = split, sources
        self._box: queue.Queue = queue.Queue(maxsize=1)
        threading.Thread(target=self._run, name="weight-inbox", daemon=True).start()

    def _run(self) -> None:
        try:
            while True:
                got = receive_version(self.split, self.sources)
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
