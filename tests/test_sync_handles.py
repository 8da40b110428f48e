"""engine.generation.sync.handles without vLLM (rollout.sync_transport=handle; the syncs into
real vLLM engines, bitwise against the file transport at TP 1 and TP 2, are in test_vllm.py).

CPU: a bucket of mixed dtypes comes back bitwise, in order, from every worker's handle, as
views of the owner's shared pages (no copy). The lifetime bookkeeping: a buffer is held while
its call is outstanding (release refused) and, on CPU, until the sync closed; then reused by
the next sync unless a worker still holds a view of it. A bucket /dev/shm has no room for goes
as a file. The CUDA
path's bookkeeping on CPU, with the reductions and the GPU list monkeypatched: the buffer stays
on the bucket's device (a meta tensor stands in for a GPU), one reduce_tensor export per
worker, the device index remapped by UUID on the worker (negative control: the exporter's
index would be wrong there), a GPU the worker does not see refused by name.
"""
from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch

from engine.generation.sync import handles as sync_handles
from engine.generation.sync.handles import (SharedBucket, SharedBuckets, export, open_bucket,
                                            pack, rebuild_buffer, send_bucket)


def _bucket() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=gen)
    return [("a.weight", base), ("a.bias", torch.randn(5, generator=gen).bfloat16()),
            ("t.weight", base.t()),                       # non-contiguous, shares a storage
            ("steps", torch.tensor(7, dtype=torch.int64)),  # 0-dim
            ("h.weight", torch.randn(3, 7, generator=gen).half())]


def test_a_cpu_bucket_reaches_every_worker_bitwise_as_views_of_shared_pages():
    bucket = _bucket()
    buffer, slots = pack(bucket)
    assert buffer.is_shared() and all(s.offset % sync_handles.ALIGN == 0 for s in slots)
    shared = SharedBucket(0, slots, export(buffer, 2))
    for rank in (0, 1):
        got = open_bucket(shared, rank)
        assert [n for n, _ in got] == [n for n, _ in bucket]
        for (_, want), (_, t) in zip(bucket, got):
            assert t.dtype == want.dtype and t.shape == want.shape and torch.equal(t, want)
        # no copy: the worker's tensors are the owner's pages (same process: same mapping)
        assert got[0][1].untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    buffer[:4].fill_(0)   # written through: the views see it (they are not copies)
    assert not torch.equal(got[0][1], bucket[0][1])
    with pytest.raises(RuntimeError, match="for 2 workers reached worker rank 2"):
        open_bucket(shared, 2)
    with pytest.raises(ValueError, match="names a tensor twice"):
        pack([("x", torch.ones(1)), ("x", torch.ones(1))])


def test_a_buffer_is_held_until_its_call_returned_and_reused_only_after_the_sync_closed():
    shared = SharedBuckets()
    token = shared.hold(torch.ones(4))
    with pytest.raises(RuntimeError, match="still being loaded"):
        shared.release(token)
    shared.returned(token)
    shared.release(token)
    assert shared.held == {}

    bucket = _bucket()
    with shared.exported(bucket, 2) as sent:
        (held,) = shared.held.values()
        ref = weakref.ref(held)
        with pytest.raises(RuntimeError, match="still being loaded"):
            shared.release(sent.token)   # the call is outstanding
    del held
    gc.collect()
    assert ref() is not None and not shared.outstanding  # held until the sync closes
    shared.closed(set())
    assert shared.held == {} and [b is ref() for b in shared.free] == [True]
    new = [(n, t + 1) for n, t in bucket]
    with shared.exported(new, 2) as again:   # the next sync refills the same pages
        assert shared.held[again.token] is ref()
        assert all(torch.equal(t, want) for (_, t), (_, want)
                   in zip(open_bucket(again, 1), new))
    shared.closed({again.token})   # a worker still holds a view: released, never reused
    gc.collect()
    assert shared.free == [] and shared.held == {} and ref() is None
    with pytest.raises(KeyError):   # a failed call: held until the sync closes, then reused
        with shared.exported(bucket, 1):
            raise KeyError("worker failed")
    assert len(shared.held) == 1 and not shared.outstanding
    shared.closed(set())
    assert len(shared.free) == 1
    shared.closed(set())   # a sync by file: kept
    (kept,) = shared.free
    with shared.exported(bucket + [("big", torch.zeros(kept.numel()))], 1):
        pass   # a sync whose bucket it cannot hold: dropped at the close (one sync's at most)
    shared.closed(set())
    assert len(shared.free) == 1 and shared.free[0] is not kept


class _Engine:
    """collective_rpc as vLLM's: every worker runs the call, it returns after all of them."""

    def __init__(self, shared: SharedBuckets, workers: int) -> None:
        self.shared, self.workers, self.loaded = shared, workers, []

    def collective_rpc(self, method, args=()):
        if method == "rl_load_shared_bucket":
            (bucket,) = args
            with pytest.raises(RuntimeError, match="still being loaded"):
                self.shared.release(next(iter(self.shared.held)))
            self.loaded += [[(n, t.clone()) for n, t in open_bucket(bucket, rank)]
                            for rank in range(self.workers)]
        else:
            path, names = args
            assert os.path.exists(path)
            self.path = path
        return [None] * self.workers


def test_send_bucket_by_handle_and_by_file_and_a_bad_transport_by_name():
    shared = SharedBuckets()
    engine, bucket = _Engine(shared, 2), _bucket()
    send_bucket(engine, bucket, "handle", shared, 2)
    assert len(engine.loaded) == 2 and not shared.outstanding
    assert all(torch.equal(t, want) for got in engine.loaded
               for (_, t), (_, want) in zip(got, bucket))
    send_bucket(engine, bucket, "file", shared, 2)
    assert not os.path.exists(engine.path)   # deleted once every worker returned
    with pytest.raises(ValueError, match="rollout.sync_transport='ipc' is not valid; choose "
                                         "one of handle, file"):
        send_bucket(engine, bucket, "ipc", shared, 2)


def test_a_bucket_without_room_in_dev_shm_goes_as_a_file(monkeypatch):
    """torch's shared memory lives in /dev/shm (containers often mount 64 MiB there): a bucket
    it has no room for is not written there (SIGBUS) but sent as a file, with a warning."""
    real = sync_handles.shutil.disk_usage
    monkeypatch.setattr(sync_handles.shutil, "disk_usage", lambda d: real(d)._replace(free=0)
                        if d == sync_handles.SHARED_MEMORY else real(d))
    shared = SharedBuckets()
    engine = _Engine(shared, 1)
    with pytest.warns(RuntimeWarning, match="lacks the room.*rollout.sync_transport=file"):
        send_bucket(engine, _bucket(), "handle", shared, 1)
    assert engine.loaded == [] and not os.path.exists(engine.path) and shared.held == {}


def test_the_cuda_path_exports_the_device_buffer_once_per_worker_and_remaps_by_uuid(
        monkeypatch):
    exported, rebuilt = [], []

    def fake_reduce_tensor(t):
        exported.append((t.device.type, t.numel()))
        return fake_rebuild, tuple(range(6)) + (0, "ipc-handle") + tuple(range(8, 15))

    def fake_rebuild(*args):
        rebuilt.append(args)
        return torch.empty(args[-1], dtype=torch.uint8)

    def no_host_handle(storage):
        raise AssertionError("a device buffer went through the CPU reduction")

    monkeypatch.setattr(sync_handles, "reduce_tensor", fake_reduce_tensor)
    monkeypatch.setattr(sync_handles, "reduce_storage", no_host_handle)
    monkeypatch.setattr(sync_handles, "gpu_uuids", lambda: ["GPU-a", "GPU-b"])
    bucket = [(n, t.to("meta")) for n, t in _bucket()]   # a device other than the host's
    buffer, slots = pack(bucket)
    assert buffer.device.type == "meta"   # packed on the tensors' device: no host copy
    handles = export(buffer, 2)
    assert exported == [("meta", buffer.numel())] * 2   # one export per worker
    assert [h.gpu_uuid for h in handles] == ["GPU-a"] * 2
    monkeypatch.setattr(sync_handles, "gpu_uuids", lambda: ["GPU-b", "GPU-a"])  # the worker's
    rebuild_buffer(handles[1])
    assert rebuilt[-1][6] == 1 and rebuilt[-1][7] == "ipc-handle"   # exporter's index was 0
    monkeypatch.setattr(sync_handles, "gpu_uuids", lambda: ["GPU-c"])
    with pytest.raises(RuntimeError, match="does not see.*rollout.sync_transport=file"):
        rebuild_buffer(handles[0])
    shared = SharedBuckets()   # a device buffer: released once its call returned, not reused
    with shared.exported(bucket, 2):
        assert len(shared.held) == 1
    shared.closed(set())
    assert shared.held == {} and shared.free == []
