"""What the checkpoint writer's queue server process runs first (engine.checkpoint.writer).

The server is a spawned interpreter that imports this module to find its initializer, so the
module imports the standard library only (no torch, no megatron: the server stays small and
starts in a fraction of a second).
"""
from __future__ import annotations

import ctypes
import os
import signal


def die_with_parent(parent_pid: int) -> None:
    """Manager server initializer: SIGKILL this process when its parent exits (Linux); the
    process group's SIGTERM / SIGINT are the rank's to answer, not this server's."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent_pid:   # the parent died before prctl took effect
        os._exit(0)
