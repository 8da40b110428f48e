"""Weight-sync buckets handed to a rollout engine's workers on the same machine as shared
tensors (rollout.sync_transport=handle, the default; `file` is engine.generation.sync.bucket_files).

Sender (the engine's owner, `SharedBuckets.exported`): a bucket's tensors are packed once into
one flat byte buffer (`pack`): in shared memory on CPU, on the tensors' own device on CUDA (a
device-to-device copy; nothing goes through the host). The buffer is exported with
torch.multiprocessing's reductions once per worker (`export`): on CPU `reduce_storage`, a file
descriptor of the shared pages that the worker receives from the owner's resource sharer (each
such handle can be received once, hence one per worker); on CUDA `reduce_tensor`, the CUDA IPC
handle of the allocation (torch pairs each export with one importer's release: one per worker
too). Only the handles and the layout (name, dtype, shape, byte offset per tensor) travel
through vLLM's collective_rpc, pickled.

Receiver (`open_bucket`, in each vLLM worker): rebuilds the buffer without a copy (CPU: maps
the same shared pages; CUDA: opens the IPC handle on the GPU that holds the buffer, found by
its UUID among the worker's visible devices, whose numbering may differ from the owner's) and
views each tensor at its offset; the model's weight loaders copy them into the parameters. A
worker of a TP > 1 engine on another GPU reads the owner's GPU over peer access; a GPU the
worker cannot see is refused, naming rollout.sync_transport=file.

Lifetime (`SharedBuckets`): one state machine, engine.generation.sync.lifetime (states,
allowed moves, the error naming a bad one). In short: the owner holds each bucket's buffer from
the export until the collective_rpc that carried it returned (every worker loaded it) and, on
CPU, until the sync closed; then the next sync refills it unless a worker still views it (the
owner keeps one sync's buckets, the weights' bytes, in /dev/shm between syncs). A CUDA buffer
is released once its call returned and never reused. A worker that never received its CPU
handle (it died first) leaves that descriptor with the owner's resource sharer.

/dev/shm (`new_buffer`): a CPU buffer's pages are reserved before anything is written
(`reserved_storage`: posix_fallocate on a fresh shared-memory file), so an owner that finds the
room gone, e.g. taken by another owner on the node that passed the same free-space check at the
same time, gets ENOSPC (NoSharedMemory: that bucket goes as a file, with a warning) instead of
the SIGBUS of a write into a full tmpfs (torch 2.13's own share_memory_ reserves too, but
fails with a RuntimeError the sync did not survive, and leaves the file's name behind).
Allocating and first filling a 400 MiB buffer took 0.16-0.23 s this way against 0.23-0.29 s
by share_memory_, which allocates private memory and copies it (2-core CPU host, 2026-11-27).

Measured against the file path: bucket_files' docstring and docs/benchmarks.md (weight sync).
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch.multiprocessing.reductions import reduce_storage, reduce_tensor

from engine.generation.sync.bucket_files import HEADROOM, SHARED_MEMORY, discard, write_bucket
from engine.generation.sync.lifetime import BufferTable, State

TRANSPORTS = ("handle", "file")
ALIGN = 64   # byte offset of every tensor in a bucket buffer: aligned for any dtype's view
CUDA_DEVICE_ARG = 6   # reduce_tensor's CUDA arguments: the device index is the 7th


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor of a bucket lies in its buffer."""
    name: str
    dtype: str          # torch dtype name without "torch."
    shape: tuple[int, ...]
    offset: int         # bytes from the buffer's start

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * getattr(torch, self.dtype).itemsize


@dataclass(frozen=True)
class BufferHandle:
    """One worker's handle of a bucket buffer: `rebuild(*args)` gives the shared storage (CPU)
    or the tensor (CUDA); `gpu_uuid` (CUDA): the GPU holding it."""
    rebuild: Callable
    args: tuple
    nbytes: int
    gpu_uuid: str | None = None


@dataclass(frozen=True)
class SharedBucket:
    """What collective_rpc carries for one bucket: the owner's token for its buffer
    (SharedBuckets), the layout and one handle per worker (index: the worker's rank in the
    engine)."""
    token: int
    slots: tuple[TensorSlot, ...]
    handles: tuple[BufferHandle, ...]


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def slot_view(buffer: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    """The tensor `slot` describes, a view of the uint8 `buffer` (no copy)."""
    return buffer[slot.offset:slot.offset + slot.nbytes].view(
        getattr(torch, slot.dtype)).view(slot.shape)


def layout(bucket: list[tuple[str, torch.Tensor]]) -> tuple[tuple[TensorSlot, ...], int]:
    """Where each tensor of [(HF name, tensor), ...] goes in a bucket buffer; (slots in bucket
    order, the buffer's bytes)."""
    if len({name for name, _ in bucket}) != len(bucket):
        raise ValueError("a weight-sync bucket names a tensor twice")
    slots, offset = [], 0
    for name, t in bucket:
        slots.append(TensorSlot(name, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                                offset))
        offset += aligned(t.numel() * t.element_size())
    return tuple(slots), max(offset, ALIGN)


def pack_into(buffer: torch.Tensor, slots: tuple[TensorSlot, ...],
              bucket: list[tuple[str, torch.Tensor]]) -> None:
    """Copy the bucket's tensors into `buffer` at their slots (on CUDA: finished on return)."""
    with torch.no_grad():
        for slot, (_, t) in zip(slots, bucket):
            slot_view(buffer, slot).copy_(t.detach())
    if buffer.device.type == "cuda":   # the copies are done before any worker reads
        torch.cuda.current_stream(buffer.device).synchronize()


def new_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 buffer of `nbytes` on `device`; on the CPU in shared memory (/dev/shm), its pages
    reserved before anything is written (`reserved_storage`), refused with NoSharedMemory where
    /dev/shm lacks the room (writing past it would kill the process with SIGBUS)."""
    if device.type != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    free = shutil.disk_usage(SHARED_MEMORY).free if os.path.isdir(SHARED_MEMORY) else 0
    if free < nbytes * HEADROOM:
        raise NoSharedMemory(f"{SHARED_MEMORY} has {free / 2**20:.0f} MiB free, a weight-sync "
                             f"bucket needs {nbytes / 2**20:.0f} MiB")
    return torch.empty(0, dtype=torch.uint8).set_(reserved_storage(nbytes))


def reserved_storage(nbytes: int, folder: str = SHARED_MEMORY) -> torch.UntypedStorage:
    """`nbytes` of shared memory with every page allocated before the first write: a new file
    in `folder` (unlinked at once: nothing is left behind, whatever happens), its pages taken
    by posix_fallocate, which fails with ENOSPC (NoSharedMemory, nothing kept) where the room
    is gone; mapped by torch as a descriptor-shared storage, the kind torch.multiprocessing
    exports (reduce_storage) and share_memory_ makes."""
    fd = -1
    try:
        fd, path = tempfile.mkstemp(prefix="rl_sync_bucket_", dir=folder)
        os.unlink(path)
        os.posix_fallocate(fd, 0, nbytes)
        return torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)   # maps a dup of fd
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.ENOMEM):
            raise
        raise NoSharedMemory(f"{folder} has no room left for a weight-sync bucket of "
                             f"{nbytes / 2**20:.0f} MiB ({e.strerror}; another process may "
                             "have taken it since the free-space check)") from e
    finally:
        if fd >= 0:
            os.close(fd)


class NoSharedMemory(OSError):
    """/dev/shm lacks the room for a bucket buffer (send_bucket sends it as a file instead)."""


def pack(bucket: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, tuple[TensorSlot, ...]]:
    """[(HF name, tensor), ...] copied into one new uint8 buffer (shared memory when the first
    tensor is on the CPU, that tensor's device otherwise); (buffer, slots in bucket order)."""
    slots, nbytes = layout(bucket)
    buffer = new_buffer(nbytes, bucket[0][1].device)
    pack_into(buffer, slots, bucket)
    return buffer, slots


def gpu_uuids() -> list[str]:
    """The UUIDs of this process's visible GPUs, by device index."""
    return [str(torch.cuda.get_device_properties(i).uuid)
            for i in range(torch.cuda.device_count())]


def export(buffer: torch.Tensor, workers: int) -> tuple[BufferHandle, ...]:
    """One handle of `buffer` per worker (module docstring): CPU, reduce_storage of its shared
    storage; any other device, reduce_tensor (CUDA IPC) with the device's UUID."""
    nbytes = buffer.numel()
    if buffer.device.type == "cpu":
        return tuple(BufferHandle(*reduce_storage(buffer.untyped_storage()), nbytes)
                     for _ in range(workers))
    index = buffer.device.index if buffer.device.index is not None else 0
    uuid = gpu_uuids()[index]
    return tuple(BufferHandle(*reduce_tensor(buffer), nbytes, uuid) for _ in range(workers))


def rebuild_buffer(handle: BufferHandle) -> torch.Tensor:
    """The uint8 buffer `handle` names, in this process, without a copy (module docstring)."""
    if handle.gpu_uuid is None:
        storage = handle.rebuild(*handle.args)
        return torch.empty(0, dtype=torch.uint8).set_(storage)[:handle.nbytes]
    visible = gpu_uuids()
    if handle.gpu_uuid not in visible:
        raise RuntimeError(f"the weight-sync bucket is on GPU {handle.gpu_uuid}, which this "
                           f"vLLM worker does not see (its GPUs: {visible}); set "
                           "rollout.sync_transport=file")
    args = list(handle.args)
    args[CUDA_DEVICE_ARG] = visible.index(handle.gpu_uuid)
    return handle.rebuild(*args)


def open_bucket(bucket: SharedBucket, rank: int) -> list[tuple[str, torch.Tensor]]:
    """The worker of rank `rank`: [(HF name, tensor), ...] in the sender's order, views of the
    shared buffer (the owner holds it until every worker returned)."""
    if not 0 <= rank < len(bucket.handles):
        raise RuntimeError(f"a bucket for {len(bucket.handles)} workers reached worker rank "
                           f"{rank}")
    buffer = rebuild_buffer(bucket.handles[rank])
    return [(slot.name, slot_view(buffer, slot)) for slot in bucket.slots]


class SharedBuckets:
    """The buffers an engine's owner exported and still holds: a BufferTable whose moves
    (engine.generation.sync.lifetime) are `hold` (exported: outstanding), `returned`,
    `release` (refused while the call is outstanding) and `closed` (the sync closed: a CPU
    buffer no worker views becomes free, refilled by the next sync's `buffer`)."""

    def __init__(self) -> None:
        self.table = BufferTable()

    @property
    def held(self) -> dict[int, torch.Tensor]:
        """Outstanding and returned buffers by token."""
        return {t: self.table.buffers[t]
                for t in self.table.tokens(State.OUTSTANDING, State.RETURNED)}

    @property
    def outstanding(self) -> set[int]:
        return set(self.table.tokens(State.OUTSTANDING))

    @property
    def free(self) -> list[torch.Tensor]:
        """CPU buffers of the last closed sync, reusable."""
        return [self.table.buffers[t] for t in self.table.tokens(State.FREE)]

    def buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A buffer of >= `nbytes` on `device`: the smallest free one that fits (CPU), else a
        new one (new_buffer)."""
        reuse = self.table.reusable(nbytes, device)
        return reuse if reuse is not None else new_buffer(nbytes, device)

    def hold(self, buffer: torch.Tensor) -> int:
        return self.table.export(buffer)

    def returned(self, token: int) -> None:
        self.table.move(token, State.RETURNED)

    def release(self, token: int) -> None:
        self.table.move(token, State.RELEASED)

    def closed(self, still_held: set[int]) -> None:
        """The sync closed on every worker; `still_held`: tokens a worker still has a view of
        (BufferTable.closed)."""
        self.table.closed(still_held)

    @contextlib.contextmanager
    def exported(self, bucket: list[tuple[str, torch.Tensor]], workers: int
                 ) -> Iterator[SharedBucket]:
        """`bucket` packed and exported to `workers` workers, held for the block (the call
        that carries it to them, which returns once every worker loaded it); then a CUDA
        buffer is released, a CPU one held until `closed`."""
        slots, nbytes = layout(bucket)
        buffer = self.buffer(nbytes, bucket[0][1].device)
        pack_into(buffer, slots, bucket)
        token = self.hold(buffer)
        try:
            yield SharedBucket(token, slots, export(buffer, workers))
        finally:
            self.returned(token)
            if buffer.device.type != "cpu":
                self.release(token)


def send_bucket(llm, bucket: list[tuple[str, torch.Tensor]], transport: str,
                shared: SharedBuckets, workers: int) -> None:
    """One bucket to every worker of `llm` (vllm.LLM with engine.generation.vllm.worker's
    extension; `workers` of them) by `transport`: `handle` (this module) or `file`
    (bucket_files: a file on /dev/shm, deleted once every worker read it). Returns once every
    worker has loaded it."""
    if transport == "handle":
        try:
            with shared.exported(bucket, workers) as handles:
                llm.collective_rpc("rl_load_shared_bucket", args=(handles,))
            return
        except NoSharedMemory:   # raised before anything was sent
            warnings.warn(f"rollout.sync_transport=handle: {SHARED_MEMORY} lacks the room for "
                          "a weight-sync bucket, which goes as a file instead (set "
                          "rollout.sync_transport=file to choose it)", RuntimeWarning)
            transport = "file"
    if transport != "file":
        raise ValueError(f"rollout.sync_transport={transport!r} is not valid; choose one of "
                         f"{', '.join(TRANSPORTS)}")
    path, names = write_bucket(bucket)
    try:
        llm.collective_rpc("rl_load_bucket", args=(path, names))
    finally:
        discard(path)
