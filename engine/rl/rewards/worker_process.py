"""The pool's handle of one scoring worker process (engine.rl.rewards.pool): a fresh
interpreter running engine.rl.rewards.worker in a session of its own, its two pipes, and the
calls sent to it and not yet answered."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import deque
from multiprocessing.connection import Connection
from pathlib import Path

ENGINE_ROOT = str(Path(__file__).resolve().parents[3])  # the folder holding `engine`


class WorkerProcess:
    """One worker process and its two pipe ends."""

    def __init__(self, fn_bytes: bytes) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([ENGINE_ROOT] + [p for p in env.get(
            "PYTHONPATH", "").split(os.pathsep) if p])
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "engine.rl.rewards.worker", str(to_child_r),
                 str(from_child_w)], pass_fds=(to_child_r, from_child_w), env=env,
                start_new_session=True, stdin=subprocess.DEVNULL)
        except OSError:
            for fd in (to_child_r, to_child_w, from_child_r, from_child_w):
                os.close(fd)
            raise
        os.close(to_child_r)
        os.close(from_child_w)
        self.inbox = Connection(to_child_w, readable=False)
        self.outbox = Connection(from_child_r, writable=False)
        self.inbox.send((list(sys.path), fn_bytes))
        self.ready = False
        # sent and unanswered: [key, item, start time]; only the first has started (its start
        # is when the one before was answered)
        self.tasks: deque[list] = deque()

    def kill(self) -> None:
        """SIGKILL the worker's process group (it and anything it started), reap it."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.inbox.close()
        self.outbox.close()
