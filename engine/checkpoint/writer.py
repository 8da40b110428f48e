"""The results queue of megatron's checkpoint writer, served by a process that dies with its
rank.

megatron-core 0.16's `FileSystemWriterAsync` (used by every `dist_checkpointing.save`) creates,
on the first save, a `multiprocessing` Manager server process (spawn) that lives as long as the
rank and is never told when the rank dies. A rank killed by SIGKILL (out-of-memory killer, a
failing node, a scheduler) leaves that server running as an orphan, holding the job's stdout
and stderr open: `torchrun ... | tee log` and any supervisor reading the job's output then wait
forever. `install()` starts the same kind of Manager ourselves, with the Linux parent-death
signal set in the server (it gets SIGKILL when its rank exits for any reason), and hands
megatron its queue. Elsewhere (no prctl) megatron's own queue is kept.

The server also ignores SIGTERM and SIGINT. A scheduler's SIGTERM or a Ctrl-C goes to the
whole process group, and the engine answers it by finishing the step and saving a checkpoint
(engine.run): a server killed by the same signal made that save fail with BrokenPipeError
whenever an earlier save had started it. It still dies with its rank (the parent-death
signal). A server found dead all the same is replaced at the next save. Its initializer lives in
engine.checkpoint.writer_server, which imports the standard library only: the spawned server
imports that module, not this one (torch, megatron).

Its entry in models.build.megatron_patches (`async_writer_queue`) gates it by megatron-core
version and probe (outside them megatron's own queue is kept).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
from multiprocessing.managers import SyncManager

from megatron.core.dist_checkpointing.strategies import filesystem_async

from engine.checkpoint.writer_server import die_with_parent
from models.build import megatron_patches

_manager = None   # kept referenced: the queue's server process lives as long as this rank


def install() -> None:
    """Give megatron's FileSystemWriterAsync a results queue whose server process dies with
    this rank. Idempotent while that server lives (a dead one is replaced); a no-op off Linux
    or when megatron already made its own queue, or outside the registry's versions."""
    global _manager
    if not megatron_patches.gate("async_writer_queue"):
        return
    if _manager is not None and not _manager._process.is_alive():
        filesystem_async._results_queue = _manager = None   # replaced below
    if not sys.platform.startswith("linux") or filesystem_async._results_queue is not None:
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
    filesystem_async._results_queue = manager.Queue()
    _manager = manager
