"""Continuous batching of an OpenAI-compatible server over a step-level backend (the protocol
of engine.generation.sampling_backend.StepBackend: add, abort, step, busy; over a step
driver such as engine.generation.vllm.stepper's), shared by `serve` (engine.serve.endpoint)
and the agent endpoint (engine.rl.agent.server). On the thread that owns the engine, every
engine step first takes what the HTTP side queued (each request added to the engine, so it
runs from this step on, beside the requests already running), then runs one step; a request
that finished is answered at once, one that moved hands its ids so far to its
Pending.progress (a live stream, engine.serve.live), and one whose client went away (its
future cancelled) is aborted, its slot free from the next step. Nothing gathers: a request
waits for at most the step running when it arrived.

Keys: a request runs in the driver as "<queue key>-<n>" (n counts the requests this loop
added), so the driver's events (("added" | "finished" | "aborted", key, engine steps so far))
name the agent episode of each request: tests and benchmarks read which requests shared an
engine step from them.

Refusals (the agent endpoint; `serve`'s queue refuses nothing): a queued request of an
episode that takes no more calls (GenerateQueue.refusal: it finished or ran past its
deadline) is answered 410 instead of added, and a running one is aborted and answered 410
(its slot is freed; its handler could not record the reply anyway).

Admission is the queue's (engine.api.batcher.GenerateQueue.check_admission), counting what
the engine holds: a request whose choices would take the queued plus running choices past
max_pending gets 429 (`GenerateQueue.running`). Failures: a request the driver refuses when
it is added, or that fails alone in a step (its own prefill or scoring raised: the backend's
step reports it with its exception, engine.generation.steps.RequestsFailed), fails alone: it
gets 503 (GenerationFailed), the step's other results are delivered and the other requests
go on, and `serve` refuses its twins (GenerateQueue.failed_alone, checked again before a
queued request is added: GenerateQueue.check_twins). A step that raises otherwise (a decode
forward of every running row) answers every running request 503 and is raised again.

Stopping, once `until()` holds: with `stopping` (serve) the queue closes with that reason
(queued and new requests get 503), the running requests finish and are answered, then `run`
returns; without it (the agent endpoint, whose queue serves the next generation batch too)
`run` returns once nothing is queued or running, the queue left open.
"""
from __future__ import annotations

import time
from typing import Callable

from engine.api.batcher import GenerateQueue, GenerationFailed, Pending
from engine.api.requests import ApiError

POLL_S = 0.05   # how often an idle owner thread re-checks `until()`


def refused(p: Pending, why: str) -> ApiError:
    """410 of a request whose episode takes no more calls."""
    return ApiError(410, f"episode {p.episode} takes no more calls: {why}")


class StepServing:
    """The module's loop: `run(until)` on the engine-owning thread. `step_s`: seconds spent in
    the backend's steps (the engine's busy time)."""

    def __init__(self, queue: GenerateQueue, backend, stopping: str | None = None) -> None:
        self.queue, self.backend, self.stopping = queue, backend, stopping
        self.inflight: dict[str, Pending] = {}
        self.added = 0
        self.step_s = 0.0

    def _take(self, stop: bool) -> list[Pending]:
        """What is queued (after closing the queue once stopping: module docstring); waits up
        to POLL_S when the engine is idle, nothing is queued and the loop is not ending."""
        if stop and self.stopping is not None and self.queue.closed is None:
            self.queue.close(self.stopping)
        ending = stop or self.queue.closed is not None
        with self.queue.cond:
            if not self.queue.pending and not self.backend.busy and not ending:
                self.queue.cond.wait(POLL_S)
            taken, self.queue.pending = self.queue.pending, []
            self.queue.running += len(taken)
        return taken

    def _answer(self, key: str, p: Pending, result=None, error=None) -> None:
        self.inflight.pop(key, None)
        with self.queue.cond:
            self.queue.running -= 1
        if p.future.cancelled():
            return
        if isinstance(error, ApiError):
            p.future.set_exception(error)
        elif error is not None:
            p.future.set_exception(GenerationFailed(error))
        else:
            p.future.set_result(result)

    def _add(self, p: Pending) -> None:
        key = f"{p.episode}-{self.added}"
        self.added += 1
        self.inflight[key] = p
        why = self.queue.refusal(p.episode)
        if why:
            self._answer(key, p, error=refused(p, why))
            return
        try:   # a twin that failed alone since this request was queued: 503, not added
            self.queue.check_twins([p.request])
        except ApiError as e:
            self._answer(key, p, error=e)
            return
        try:
            result = self.backend.add(key, p.request, stream=p.progress is not None)
        except Exception as e:  # noqa: BLE001 - this request alone fails (its twins refused)
            self.queue.failed_alone(p.request)
            self._answer(key, p, error=e)
            return
        if result is not None:
            self._answer(key, p, result)

    def _drop_gone(self) -> None:
        """Abort the running requests whose client went away or whose episode closed."""
        reasons: dict[str, str | None] = {}
        for key, p in list(self.inflight.items()):
            if p.episode not in reasons:
                reasons[p.episode] = self.queue.refusal(p.episode)
            if p.future.cancelled() or reasons[p.episode]:
                self.backend.abort(key)
                why = reasons[p.episode]
                self._answer(key, p, error=refused(p, why) if why else None)

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            moved = self.backend.step()
        except Exception as e:   # run's aborted_on_error aborts them in the engine
            for key, p in list(self.inflight.items()):
                self._answer(key, p, error=e)
            raise
        finally:
            self.step_s += time.perf_counter() - t0
        for key, ids, result in moved:
            p = self.inflight.get(key)
            if p is None:
                continue
            if isinstance(result, Exception):   # it failed alone: its twins are refused
                self.queue.failed_alone(p.request)
                self._answer(key, p, error=result)
            elif result is not None:
                self._answer(key, p, result)
            elif p.progress is not None:
                p.progress(ids)

    def run(self, until: Callable[[], bool]) -> None:
        """Serve until `until()` holds and the running requests are answered (module
        docstring); a failed step is raised once its requests got 503, and whatever raises
        leaves none of the loop's requests running in the engine (the backend's
        aborted_on_error, engine.generation.steps)."""
        with self.backend.aborted_on_error():
            while True:
                stop = until()
                for p in self._take(stop):
                    self._add(p)
                self._drop_gone()
                if self.backend.busy:
                    self._step()
                elif not self.inflight and (self.queue.closed is not None or (
                        stop and self.stopping is None and not self.queue.pending)):
                    return
