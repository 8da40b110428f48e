"""The lifetime of a weight-sync bucket buffer (rollout.sync_transport=handle), as one state
machine: the owner's side (`BufferTable`, held by engine.generation.sync.handles.SharedBuckets)
and the worker's (`WorkerViews`, in engine.generation.vllm.worker); the close that joins them
is engine.generation.vllm.weights.WeightSync._close_sync.

    (new) --export--> OUTSTANDING --returned--> RETURNED --closed, no view (CPU)--> FREE
                          ^                        |                                  |
                          |                        +--release (device; viewed)--> RELEASED
                          +--------------------------------export (reuse)------------+
                                                                   FREE --dropped--> RELEASED

- OUTSTANDING: packed and exported; the collective_rpc that carries its handles to the workers
  has not returned (vLLM's collective_rpc returns once every worker loaded it, and raises at
  the first failed worker without waiting for the others). Never released nor refilled.
- RETURNED: the call returned or failed. The owner still holds it: vLLM's layerwise reload
  keeps a worker's views of a layer's tensors until the layer is complete (a bucket may hold
  only part of it) and replays attention layers' loads when the sync closes, so nothing is
  overwritten before the sync closes and within a sync every bucket has its own buffer. A
  device (CUDA) buffer is released at once: torch keeps an exported block out of its allocator
  until every importer released it, so it is never reused.
- FREE (CPU only): the sync closed on every worker and no worker still views it (each reports
  the buffers it still references, `WorkerViews.still_viewed`): the next sync's buckets refill
  it (`BufferTable.reusable`) instead of faulting in fresh shared pages (the first sync of
  400 MB by handle took 0.46 s, the next ones 0.20 s; bucket_files' docstring). One sync's
  buffers at most: a close that frees buffers drops the older free ones; a sync without shared
  buckets (by file) changes nothing.
- RELEASED: the owner dropped its reference (terminal). A buffer a worker still views at the
  close is released, never reused; a worker still reading keeps its own mapping.

Any other move raises `BadTransition`, naming the buffer, both states and the moves allowed
from its state.
"""
from __future__ import annotations

import itertools
from enum import Enum

import torch
from torch.multiprocessing.reductions import StorageWeakRef


class State(str, Enum):
    OUTSTANDING = "outstanding"
    RETURNED = "returned"
    FREE = "free"
    RELEASED = "released"


NEW = None   # the state before a buffer's first export
# (from, to) -> what the move means (module docstring); every other move is refused
TRANSITIONS: dict[tuple[State | None, State], str] = {
    (NEW, State.OUTSTANDING): "a new buffer exported",
    (State.FREE, State.OUTSTANDING): "a free buffer refilled and exported by the next sync",
    (State.OUTSTANDING, State.RETURNED): "the call carrying it returned or failed",
    (State.RETURNED, State.FREE): "the sync closed and no worker views it (CPU)",
    (State.RETURNED, State.RELEASED): "a device buffer after its call, or one a worker still "
                                      "views at the close",
    (State.FREE, State.RELEASED): "dropped: a later close freed newer buffers",
}
WHY_NOT = {State.OUTSTANDING: "it is still being loaded by the engine's workers; it is "
                              "released once their call returned"}


class BadTransition(RuntimeError):
    """A weight-sync buffer asked to move where its lifetime does not allow."""


def check(token: int, current: State | None, new: State) -> None:
    """Refuse a move the lifetime does not allow (BadTransition naming both states)."""
    if (current, new) in TRANSITIONS:
        return
    name = current.value if current is not None else "new"
    allowed = [to.value for (src, to) in TRANSITIONS if src == current] or ["none"]
    why = f" ({WHY_NOT[current]})" if current in WHY_NOT else ""
    raise BadTransition(f"weight-sync bucket {token}: {name} -> {new.value} is not allowed"
                        f"{why}; from {name}: {', '.join(allowed)}")


class BufferTable:
    """The owner's buffers by token and their states (module docstring). A released buffer is
    forgotten (the owner's reference dropped); its token is never used again."""

    def __init__(self) -> None:
        self.buffers: dict[int, torch.Tensor] = {}
        self.states: dict[int, State] = {}
        self.ids = itertools.count()

    def state(self, token: int) -> State | None:
        """The buffer's state; None for a token never exported or released (forgotten)."""
        return self.states.get(token)

    def tokens(self, *states: State) -> list[int]:
        return [t for t, s in self.states.items() if s in states]

    def move(self, token: int, new: State) -> None:
        check(token, self.states.get(token), new)
        if new is State.RELEASED:
            del self.states[token], self.buffers[token]
        else:
            self.states[token] = new

    def export(self, buffer: torch.Tensor) -> int:
        """A new buffer, or a FREE one refilled (the same tensor), now OUTSTANDING: its token."""
        token = next((t for t in self.tokens(State.FREE) if self.buffers[t] is buffer), None)
        if token is None:
            token = next(self.ids)
            check(token, NEW, State.OUTSTANDING)
            self.buffers[token] = buffer
            self.states[token] = State.OUTSTANDING
        else:
            self.move(token, State.OUTSTANDING)
        return token

    def reusable(self, nbytes: int, device: torch.device) -> torch.Tensor | None:
        """The smallest FREE buffer on `device` of >= `nbytes`, else None."""
        fits = [self.buffers[t] for t in self.tokens(State.FREE)
                if self.buffers[t].device == device and self.buffers[t].numel() >= nbytes]
        return min(fits, key=lambda b: b.numel()) if fits else None

    def closed(self, still_viewed: set[int]) -> None:
        """The sync closed on every worker: each RETURNED buffer becomes FREE (CPU, no worker
        views it) or RELEASED (a worker still views it: never reused; a device buffer), and
        the older FREE ones are RELEASED; with no RETURNED buffer (a sync by file) nothing
        changes."""
        returned = self.tokens(State.RETURNED)
        if not returned:
            return
        for token in self.tokens(State.FREE):
            self.move(token, State.RELEASED)
        for token in returned:
            reuse = token not in still_viewed and self.buffers[token].device.type == "cpu"
            self.move(token, State.FREE if reuse else State.RELEASED)


class WorkerViews:
    """A worker's side: the owner's tokens of the shared buffers it opened in this sync, each
    with a weak reference to its storage (the worker holds views, the owner the buffer)."""

    def __init__(self) -> None:
        self.opened: list[tuple[int, StorageWeakRef]] = []

    def open(self, token: int, storage: torch.UntypedStorage) -> None:
        self.opened.append((token, StorageWeakRef(storage)))

    def still_viewed(self) -> list[int]:
        """After the sync closed: the tokens whose storage this worker still references (the
        owner releases those instead of freeing them); forgets every opened buffer."""
        held = [token for token, ref in self.opened if not ref.expired()]
        self.opened = []
        return held
