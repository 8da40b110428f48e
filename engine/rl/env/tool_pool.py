"""Worker processes that execute tool calls for env.fn=tools (rank 0 starts them; a trainer
process never runs a tool).

`ToolPool(specs, size, timeout_s, max_chars)` keeps up to `size` worker processes
(engine.rl.env.tool_worker, started on first use with this interpreter and sys.path). `call`
is thread-safe: it takes an idle worker (waiting while all are busy), sends the call, and waits
at most `timeout_s` seconds for the answer; a worker that times out or dies is killed and
replaced on its next use. Returns (True, output) or (False, error text); output is capped at
`max_chars` characters by the worker.
"""
from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import sys


class ToolWorker:
    def __init__(self, specs: list[str], max_chars: int) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine.rl.env.tool_worker", str(max_chars), *specs],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
            encoding="utf-8", bufsize=1)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def call(self, name: str, arguments: dict, timeout_s: float | None) -> tuple[bool, str]:
        try:
            self.proc.stdin.write(json.dumps({"name": name, "arguments": arguments}) + "\n")
            self.proc.stdin.flush()
        except (OSError, TypeError, ValueError) as e:  # dead pipe, or arguments not JSON
            return False, f"the tool call could not be sent: {type(e).__name__}: {e}"
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            self.kill()
            return False, f"the tool {name!r} timed out after {timeout_s:g} s"
        line = self.proc.stdout.readline()
        if not line:
            self.kill()
            return False, f"the tool {name!r} crashed its worker process"
        reply = json.loads(line)
        return (True, reply["output"]) if reply["ok"] else (False, reply["error"])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class ToolPool:
    """See the module docstring."""

    def __init__(self, specs: list[str], size: int, timeout_s: float | None,
                 max_chars: int) -> None:
        self.specs, self.timeout_s, self.max_chars = list(specs), timeout_s, max_chars
        self._slots: queue.Queue = queue.Queue()
        self._all: list[ToolWorker] = []
        for _ in range(size):
            self._slots.put(None)

    def call(self, name: str, arguments: dict) -> tuple[bool, str]:
        worker = self._slots.get()
        try:
            if worker is None or not worker.alive:
                worker = ToolWorker(self.specs, self.max_chars)
                self._all.append(worker)
            return worker.call(name, arguments, self.timeout_s)
        finally:
            self._slots.put(worker if worker is not None and worker.alive else None)

    def close(self) -> None:
        for w in self._all:
            w.kill()
        self._all.clear()
