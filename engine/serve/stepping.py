"""Continuous batching of a serve endpoint over a step-level backend
(engine.generation.sampling_backend.StepBackend over engine.generation.vllm.stepper): on the
thread that owns the engine, every engine step first takes what the HTTP side queued (each
request added to the engine, so it runs from this step on, beside the requests already
running), then runs one step; a request that finished is answered at once, one that moved
hands its ids so far to its Pending.progress (a live stream, engine.serve.live), and one whose
client went away (its future cancelled: a closed stream, engine.serve.live) is aborted, its
slot free from the next step. Nothing gathers: a request waits for at most the step running
when it arrived.

Admission is ServeQueue's (engine.serve.batching), counting what the engine holds: a request
whose choices would take the queued plus running choices past --max-queue gets 429; twins of a
request that failed alone get 503. Failures: a request the driver refuses when it is added
fails alone (its twins are then refused); a step that raises answers every running request 503
and is raised again (ServeEndpoint.serve goes on while the engine is alive). Stopping
(`until()`): the queue closes (queued and new requests get 503), the running requests finish
and are answered, then `run` returns.
"""
from __future__ import annotations

from typing import Callable

from engine.api.batcher import GenerationFailed, Pending
from engine.generation.sampling_backend import StepBackend
from engine.serve.batching import STOPPING, ServeQueue

POLL_S = 0.05   # how often an idle owner thread re-checks `until()`


class StepServing:
    """The module's loop: `run(until)` on the engine-owning thread."""

    def __init__(self, queue: ServeQueue, backend: StepBackend) -> None:
        self.queue, self.backend = queue, backend
        self.inflight: dict[str, Pending] = {}
        self.added = 0

    def _take(self, until: Callable[[], bool]) -> list[Pending]:
        """What is queued (after closing the queue once `until()` holds); waits up to POLL_S
        when the engine is idle and nothing is queued."""
        if until() and self.queue.closed is None:
            self.queue.close(STOPPING)
        with self.queue.cond:
            if not self.queue.pending and not self.backend.busy and self.queue.closed is None:
                self.queue.cond.wait(POLL_S)
            taken, self.queue.pending = self.queue.pending, []
            self.queue.running += len(taken)
        return taken

    def _answer(self, key: str, p: Pending, result=None, error=None) -> None:
        self.inflight.pop(key, None)
        with self.queue.cond:
            self.queue.running -= 1
        if error is not None:
            p.future.set_exception(GenerationFailed(error))
        elif not p.future.cancelled():
            p.future.set_result(result)

    def _add(self, p: Pending) -> None:
        key = f"serve-{self.added}"
        self.added += 1
        self.inflight[key] = p
        try:
            result = self.backend.add(key, p.request, stream=p.progress is not None)
        except Exception as e:  # noqa: BLE001 - this request alone fails (its twins refused)
            self.queue.failed_alone(p.request)
            self._answer(key, p, error=e)
            return
        if result is not None:
            self._answer(key, p, result)

    def _drop_cancelled(self) -> None:
        for key, p in list(self.inflight.items()):
            if p.future.cancelled():
                self.backend.abort(key)
                self._answer(key, p)

    def _step(self) -> None:
        try:
            moved = self.backend.step()
        except Exception as e:
            for key, p in list(self.inflight.items()):
                self.backend.abort(key)
                self._answer(key, p, error=e)
            raise
        for key, ids, result in moved:
            p = self.inflight.get(key)
            if p is None:
                continue
            if result is not None:
                self._answer(key, p, result)
            elif p.progress is not None:
                p.progress(ids)

    def run(self, until: Callable[[], bool]) -> None:
        """Serve until `until()` holds and the running requests are answered (module
        docstring); a failed step is raised once its requests got 503."""
        while True:
            for p in self._take(until):
                self._add(p)
            self._drop_cancelled()
            if self.backend.busy:
                self._step()
            elif self.queue.closed is not None and not self.inflight:
                return
