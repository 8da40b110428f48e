"""Environment calls (constructors, steps, closes) run concurrently, each within a deadline.

`run_calls` runs zero-argument callables on up to `num_workers` daemon threads and returns
(value, None) or (None, error text) per call, in order. A call that raises, or runs longer than
`timeout_s` from the moment it started, yields an error; Python cannot stop a thread, so a
timed-out call keeps running in the background (its result is discarded) and a fresh worker
takes its place. Daemon threads never keep the trainer from exiting. No collective; rank 0.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable


def run_calls(calls: list[Callable[[], Any]], num_workers: int, timeout_s: float | None
              ) -> list[tuple[Any, str | None]]:
    """See the module docstring; `timeout_s` None: no deadline."""
    out: list[tuple[Any, str | None]] = [(None, "not run")] * len(calls)
    if not calls:
        return out
    tasks: queue.SimpleQueue = queue.SimpleQueue()
    results: queue.SimpleQueue = queue.SimpleQueue()
    started: dict[int, float] = {}

    def worker() -> None:
        while (i := tasks.get()) is not None:
            started[i] = time.monotonic()
            try:
                outcome = (i, calls[i](), None)
            except BaseException as e:  # noqa: BLE001 - user environments may raise anything
                outcome = (i, None, f"{type(e).__name__}: {e}")
            started.pop(i, None)
            results.put(outcome)

    def spawn() -> None:
        threading.Thread(target=worker, name="env-step", daemon=True).start()

    for i in range(len(calls)):
        tasks.put(i)
    workers = min(num_workers, len(calls))
    for _ in range(workers):
        spawn()
    pending = set(range(len(calls)))
    while pending:
        now = time.monotonic()
        if timeout_s is not None:
            for i, t0 in list(started.items()):
                if i in pending and now - t0 >= timeout_s:
                    pending.discard(i)
                    out[i] = (None, f"timed out after {timeout_s:g} s (env.step_timeout_s)")
                    spawn()
                    workers += 1
        if not pending:
            break
        deadlines = [t0 + timeout_s for i, t0 in list(started.items())
                     if i in pending] if timeout_s is not None else []
        wait = (min(deadlines) - now) if deadlines else (timeout_s or 3600.0)
        try:
            i, value, error = results.get(timeout=max(wait, 0.001))
        except queue.Empty:
            continue
        if i in pending:
            pending.discard(i)
            out[i] = (value, error)
    for _ in range(workers):
        tasks.put(None)
    return out
