"""/dev/shm reserved before a weight-sync buffer is written (engine.generation.sync.handles.
reserved_storage; issue 76, item 6).

Owners colocated on one node sync at once: each can pass the free-space check before any of
them allocates, and the last to allocate finds the room gone. What is proved here:
- in-process: the buffer's pages are allocated (st_blocks) before anything is written, the
  file leaves no name in its folder, and a reservation that fails (ENOSPC, raised by a
  patched posix_fallocate) sends that bucket as a file with the warning, nothing left behind;
- the race itself, for real, in a child process given its own 8 MiB /dev/shm (a tmpfs mounted
  in a user + mount namespace, `unshare`; skipped where the host refuses namespaces): two
  owners whose checks both saw the 8 MiB free (the figure each gets when both check before
  either allocates; the check's figure is pinned, the allocations are the kernel's) each sync a
  5 MiB bucket. The first reserves its pages and goes by handle; the second's reservation
  fails cleanly and its bucket goes as a file; both arrive bitwise and /dev/shm holds only the
  first owner's pages. Before the reservation, the second owner's torch.share_memory_ raised
  a RuntimeError out of the sync (torch 2.13, which reserves itself; torch versions that only
  ftruncate die of SIGBUS writing the pages).
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from engine.generation.sync import handles as sync_handles
from engine.generation.sync.handles import (NoSharedMemory, SharedBuckets, reserved_storage,
                                            send_bucket)

ROOT = Path(__file__).resolve().parents[1]


def test_the_pages_are_reserved_before_any_write_and_the_file_leaves_no_name(tmp_path):
    storage = reserved_storage(3 << 20, str(tmp_path))
    fd, size = storage._share_fd_cpu_()   # the descriptor torch exports to the workers
    assert size == 3 << 20 and os.fstat(fd).st_blocks * 512 >= 3 << 20   # allocated, unwritten
    assert os.listdir(tmp_path) == []
    buffer = torch.empty(0, dtype=torch.uint8).set_(storage)
    assert buffer.is_shared() and buffer.numel() == 3 << 20


class _Engine:
    """One worker's collective_rpc: how the bucket came (handle or file) and what it held."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def collective_rpc(self, method, args=()):
        self.calls.append(method)
        return [None]


def test_a_failed_reservation_sends_the_bucket_as_a_file_leaving_nothing(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(sync_handles.os, "posix_fallocate", full)
    with pytest.raises(NoSharedMemory, match=f"{tmp_path} has no room left for a weight-sync "
                                             "bucket of 2 MiB .No space left on device"):
        reserved_storage(2 << 20, str(tmp_path))
    assert os.listdir(tmp_path) == []
    shared, engine = SharedBuckets(), _Engine()
    with pytest.warns(RuntimeWarning, match="lacks the room.*goes as a file"):
        send_bucket(engine, [("w", torch.ones(16))], "handle", shared, 1)
    assert engine.calls == ["rl_load_bucket"] and shared.held == {}


RACE = """
import json, os, shutil, types, warnings
import torch
from engine.generation.sync import handles as sync_handles
from engine.generation.sync.bucket_files import read_bucket
from engine.generation.sync.handles import SharedBuckets, open_bucket, send_bucket

seen = shutil.disk_usage("/dev/shm")   # both owners check before either allocates
sync_handles.shutil = types.SimpleNamespace(disk_usage=lambda folder: seen)  # the check only

class Engine:
    def collective_rpc(self, method, args=()):
        if method == "rl_load_shared_bucket":
            self.by, got = "handle", open_bucket(args[0], 0)
        else:
            self.by, got = "file in " + os.path.dirname(args[0]), read_bucket(*args)
        self.equal = torch.equal(got[0][1], BUCKET[0][1])
        return [None]

BUCKET = [("w", torch.arange(5 * 2**20 // 4, dtype=torch.float32))]   # 5 MiB
owners = [(SharedBuckets(), Engine()) for _ in range(2)]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for shared, engine in owners:
        send_bucket(engine, BUCKET, "handle", shared, 1)
print(json.dumps({"by": [e.by for _, e in owners], "equal": [e.equal for _, e in owners],
                  "warnings": [str(w.message) for w in caught],
                  "shm_names": os.listdir("/dev/shm"),
                  "shm_used_mib": shutil.disk_usage("/dev/shm").used / 2**20}))
"""


def _namespace_refused() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare"
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True, text=True)
    return (probe.stderr.strip() or f"exit {probe.returncode}") if probe.returncode else None


def test_two_owners_racing_for_a_small_dev_shm_one_by_handle_one_by_file():
    if (why := _namespace_refused()) is not None:
        pytest.skip(f"this host gives no user + mount namespace for a small /dev/shm: {why}")
    code = f"cd {ROOT} && exec {sys.executable} -c {_quote(textwrap.dedent(RACE))}"
    run = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                          f"mount -t tmpfs -o size=8m tmpfs /dev/shm && {code}"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["by"] == ["handle", f"file in {tempfile.gettempdir()}"], got   # /dev/shm full: the temporary dir
    assert got["equal"] == [True, True]
    assert len(got["warnings"]) == 1 and "goes as a file" in got["warnings"][0], got
    assert got["shm_names"] == [] and 5 <= got["shm_used_mib"] < 5.5, got   # the first's pages


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"
