"""A Tinker request's future: how the service's worker thread hands a result (or an error) to
the HTTP routes that wait for it (engine.tinker.service, engine.tinker.routes)."""
from __future__ import annotations

import threading


class Future:
    """One request's outcome: `resolve(result)` or `fail(error)`, once, from the worker thread.
    `done` is a threading.Event; `on_done(callback)` runs `callback()` once the future is done
    (at once if it already is), from whichever thread resolves it: the routes wake their
    asyncio waiters with it (loop.call_soon_threadsafe), so no event-loop task polls."""

    def __init__(self):
        self.done = threading.Event()
        self.result: object = None     # a dict (JSON) or bytes (protobuf)
        self.error: str | None = None
        self._callbacks: list = []
        self._lock = threading.Lock()

    def resolve(self, result: object) -> None:
        self.result = result
        self._finish()

    def fail(self, error: str) -> None:
        self.error = error
        self._finish()

    def _finish(self) -> None:
        with self._lock:
            if self.done.is_set():
                return
            self.done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def on_done(self, callback) -> None:
        with self._lock:
            if not self.done.is_set():
                self._callbacks.append(callback)
                return
        callback()
