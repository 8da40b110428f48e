"""The exit of a vLLM worker process without the interpreter's teardown (installed by the worker
extension's `rl_exit_without_teardown` when a CPU engine starts; engine.generation.vllm.worker;
GPU workers keep vLLM's own exit: not run there).

An engine's shutdown (vLLM's executor) asks its workers to exit and waits for them: 5 s
(VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS), then SIGTERM, which the worker ignores
(`rl_leave_signals_to_owner`), then up to 4 s more, then SIGKILL. The worker's own work is done
long before: vLLM's worker_main has run its orderly shutdown (message queues closed, the
model-parallel groups destroyed), multiprocessing's finalizers, the thread joins and the stream
flushes. What is left is the interpreter's final garbage collection and module teardown over a
heap holding torch and vLLM, which outlasted the grace (measured: docs/benchmarks.md, "The
vLLM CPU worker's exit").

`install` registers an atexit callback, run when the interpreter begins its exit: the other
atexit callbacks run (as at a normal exit), stdout and stderr are flushed, and the process ends
through the C library's exit(`status`), so the C-level exit handlers and C++ static
destructors still run (vLLM's CPU shared-memory communicator unlinks its /dev/shm segments
there: os._exit would leave them behind), but not the interpreter's final collection and
module teardown. The status: vLLM's worker_main returns normally on every path that reaches
the interpreter's exit (it logs and swallows its failures; its signal handlers raise a
SystemExit without a code), so the exit status it would have had is 0.
"""
from __future__ import annotations

import atexit
import ctypes
import sys

_installed: list = []   # the callback registered in this process (once)


def install(status: int = 0) -> bool:
    """Register the exit callback in this process (once; a later call does nothing). True when
    this call registered it."""
    if _installed:
        return False

    def exit_now() -> None:
        atexit.unregister(exit_now)   # the callbacks run below must not run this one again
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        ctypes.CDLL(None).exit(status)

    atexit.register(exit_now)
    _installed.append(exit_now)
    return True
