"""The queue between the HTTP thread and the thread that owns the engines, and the batching rule
of a batched backend (a step-level backend's loop over the same queue: engine.api.stepping).

The server's handlers `submit` one GenerateRequest per choice and await its future; the owner
thread runs `serve(backend, until)`, which takes batches and makes ONE backend.generate call per
batch (the rollout engines are not thread-safe: they are only ever touched there), then sets
each future (concurrent.futures, awaited on the server's loop through asyncio.wrap_future).

Batching rule. When the backend is free and a request is pending, the batch is every pending
request (oldest first, at most max_batch), taken as soon as no live episode (started, still
taking calls: engine.rl.agent.sessions) is EXPECTED to send one. An episode without a pending
request is expected
- while an answer to it is on its way (generated, its HTTP response not yet sent), and for
  gather_s seconds after that response (its scaffold is about to send the next call; one
  that runs a tool or thinks longer is not waited for);
- for max_wait_s seconds after its function started, until its first call;
or when max_batch requests are pending, or the oldest pending request has waited max_wait_s.
So lock-step episodes go together, whatever the spread of their arrivals (every live episode
pending is the common case), and no request waits longer than max_wait_s plus the generate
call running when it arrived. Measured against "gather_s after the oldest arrival"
(docs/agents.md): that rule splits episodes whose first calls trickle in into cohorts that stay
out of phase, batch after batch. Requests of an episode that stopped taking calls are answered
410 instead of generated. Batching changes no sample: each request is seeded on its own
(engine.api.backend).

Admission. With `max_pending`, a request whose choices (one generate request each: prompts
x n) would take the pending requests past max_pending is refused at once with 429 (QueueFull:
code queue_full, a Retry-After header): all of its choices are queued, or none. Once
`close(why)` ran (the server is stopping), every pending request is answered 503 at once and
every new one gets 503, so a stopping server never waits for its queue.

Failures. A generate call that raises answers its requests GenerationFailed (503, a short
message; the exception rides along as `cause` for the server's log, never in the body) and is
raised again on the owner thread. `run_batch` is the hook a server overrides to answer a
failed batch otherwise (engine.serve.batching retries its halves, so one failing request does
not fail the others).
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from engine.api.backend import GenerateBackend, GenerateRequest, GenerateResult
from engine.api.requests import ApiError

RETRY_AFTER_S = 1   # the Retry-After of a 429: the queue moves every generate call


class QueueFull(ApiError):
    """429: the queue holds max_pending requests; `retry_after_s` becomes the Retry-After
    header (engine.api.http.add_error_handlers)."""

    def __init__(self, pending: int, max_pending: int, limit: str = "") -> None:
        super().__init__(429, f"the server is busy: {pending} choices (prompts x n) wait for "
                         f"the engine (at most {max_pending}{limit}); retry after "
                         f"{RETRY_AFTER_S} s",
                         kind="rate_limit_error", code="queue_full")
        self.retry_after_s = RETRY_AFTER_S


class GenerationFailed(ApiError):
    """503: the generate call of this request raised `cause` (kept for the server's log; the
    body says only that generation failed)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(503, "generation failed; the server log has the details",
                         kind="server_error", code="generation_failed")
        self.cause = cause


def stopping_error(why: str) -> ApiError:
    """503 of a stopping server (code server_stopping)."""
    return ApiError(503, why, kind="server_error", code="server_stopping")


@dataclass
class Pending:
    episode: str
    request: GenerateRequest
    future: concurrent.futures.Future
    arrived: float
    # called on the owner thread with the ids sampled so far, by a step-level server
    # (engine.api.stepping) after each engine step; None: the result only
    progress: Callable[[list[int]], None] | None = None


@dataclass
class BatchStats:
    """What `serve` did: one entry per backend.generate call."""

    sizes: list[int] = field(default_factory=list)       # requests per call
    waits: list[float] = field(default_factory=list)     # seconds from the oldest arrival
    generate_s: float = 0.0                              # time inside backend.generate

    @property
    def mean_size(self) -> float:
        return sum(self.sizes) / len(self.sizes) if self.sizes else 0.0


class GenerateQueue:
    """Pending generate requests (module docstring).

    Args:
        live_episodes: {episode id: (monotonic start time, calls accepted)} of the live
            episodes now (called under the queue's lock).
        refusal: why an episode takes no more calls, or None.
        gather_s, max_wait_s, max_batch: the batching rule (None: no batch size limit).
        max_pending: admission (module docstring); None: unbounded.
    """

    def __init__(self, live_episodes: Callable[[], dict[str, tuple[float, int]]],
                 refusal: Callable[[str], str | None], gather_s: float = 0.2,
                 max_wait_s: float = 2.0, max_batch: int | None = None,
                 max_pending: int | None = None) -> None:
        if max_pending is not None and max_pending < 1:
            raise ValueError(f"max_pending={max_pending} must be >= 1 (None: unbounded)")
        self.live_episodes, self.refusal = live_episodes, refusal
        self.gather_s, self.max_wait_s, self.max_batch = gather_s, max_wait_s, max_batch
        self.max_pending = max_pending
        self.limit_name = ""   # how a 429 names max_pending's setting, e.g. ", --max-queue"
        self.closed: str | None = None         # why the server is stopping (close)
        self.pending: list[Pending] = []
        self.answered: dict[str, float] = {}   # episode -> when its last response was sent
        self.outstanding: dict[str, int] = {}  # episode -> requests submitted, not responded
        self.cond = threading.Condition()
        self.stats = BatchStats()
        self.running = 0   # choices in the engine (step-level serving: engine.api.stepping)

    def submit(self, episode: str, request: GenerateRequest) -> concurrent.futures.Future:
        """Queue one request (any thread); its future gets a GenerateResult or an ApiError.
        Raises 503 when closed, QueueFull (429) when max_pending wait (module docstring)."""
        return self.submit_many(episode, [request])[0]

    def submit_many(self, episode: str, requests: list[GenerateRequest],
                    progress: list[Callable[[list[int]], None]] | None = None
                    ) -> list[concurrent.futures.Future]:
        """Queue the choices of one call together: all of them, or none (503 / 429 as
        `submit`, the choices counted); `progress`: one Pending.progress per request."""
        futures = [concurrent.futures.Future() for _ in requests]
        calls = progress if progress is not None else [None] * len(requests)
        with self.cond:
            self.check_admission(len(requests))
            now = time.monotonic()
            self.pending += [Pending(episode, r, f, now, c)
                             for r, f, c in zip(requests, futures, calls)]
            self.outstanding[episode] = self.outstanding.get(episode, 0) + len(requests)
            self.cond.notify_all()
        return futures

    def check_admission(self, choices: int = 1) -> None:
        """Raise what a request of `choices` generate requests arriving now gets: 503 when
        closed, 429 when they would take the pending requests past max_pending."""
        with self.cond:
            if self.closed is not None:
                raise stopping_error(self.closed)
            waiting = self.waiting()
            if self.max_pending is not None and waiting + choices > self.max_pending:
                raise QueueFull(waiting, self.max_pending, self.limit_name)

    def waiting(self) -> int:
        """The requests admission counts (under the lock): the queued choices, plus those
        running in the engine under step-level serving (engine.api.stepping; 0 under the
        batch rule: the call in flight is not counted)."""
        return len(self.pending) + self.running

    def failed_alone(self, request: GenerateRequest) -> None:
        """`request` failed on its own (the step-level loop calls it when the driver refused
        it or it failed alone in a step): nothing here; `serve`'s queue refuses its twins
        (engine.serve.batching)."""

    def check_twins(self, requests: list[GenerateRequest]) -> None:
        """Raise the ApiError of `requests` when one has a twin that failed alone (the
        step-level loop asks before adding a queued request): never here; `serve`'s queue
        raises 503 repeated_failure (engine.serve.batching)."""

    def close(self, why: str) -> None:
        """The server is stopping: every pending request and every later one gets 503
        (`why`), at once."""
        with self.cond:
            self.closed = why
            failed, self.pending = self.pending, []
            self.cond.notify_all()
        for p in failed:
            p.future.set_exception(stopping_error(why))

    def responded(self, episode: str, requests: int) -> None:
        """The server's handler sent its response for `requests` submitted requests (or
        failed): the episode's next call is expected within gather_s."""
        with self.cond:
            left = self.outstanding.get(episode, 0) - requests
            if left > 0:
                self.outstanding[episode] = left
            else:
                self.outstanding.pop(episode, None)
            self.answered[episode] = time.monotonic()
            self.cond.notify_all()

    def wake(self) -> None:
        """Re-check the batching rule now (an episode started or ended)."""
        with self.cond:
            self.cond.notify_all()

    def _expected_until(self, now: float) -> float | None:
        """When the last expected episode stops being expected (module docstring); None when
        none is expected now."""
        waiting = {p.episode for p in self.pending}
        until = None
        for eid, (started, calls) in self.live_episodes().items():
            if eid in waiting:
                continue
            if self.outstanding.get(eid):
                return float("inf")          # an answer is on its way: wait (max_wait_s)
            ends = [self.answered[eid] + self.gather_s] if eid in self.answered else []
            if calls == 0:
                ends.append(started + self.max_wait_s)
            end = max(ends, default=now)
            if end > now:
                until = end if until is None else max(until, end)
        return until

    def wait_s(self, now: float) -> float:
        """The batching rule at monotonic time `now` (module docstring), with requests pending:
        0 when they go now, else how many seconds they wait (a pure function of the queue's
        state and `now`; next_batch calls it)."""
        if self.max_batch is not None and len(self.pending) >= self.max_batch:
            return 0.0
        cap = self.pending[0].arrived + self.max_wait_s - now
        expected = self._expected_until(now)
        return 0.0 if cap <= 0 or expected is None else min(cap, expected - now)

    def next_batch(self, until: Callable[[], bool], poll_s: float = 0.05) -> list[Pending]:
        """The next batch by the rule, or [] once nothing is pending and `until()` holds."""
        with self.cond:
            while True:
                now = time.monotonic()
                wait = self.wait_s(now) if self.pending else poll_s
                if self.pending and wait <= 0:
                    take = self.max_batch or len(self.pending)
                    batch, self.pending = self.pending[:take], self.pending[take:]
                    return batch
                if not self.pending and until():
                    return []
                self.cond.wait(max(min(wait, poll_s), 1e-4))

    def serve(self, backend: GenerateBackend, until: Callable[[], bool]) -> None:
        """The owner thread: batches through `backend` until `until()` holds and nothing is
        pending. A request whose generate call failed gets GenerationFailed (503); the first
        such exception of a batch is raised here once the batch is answered."""
        while batch := self.next_batch(until):
            now = time.monotonic()
            live = []
            for p in batch:
                why = self.refusal(p.episode)
                if why:
                    p.future.set_exception(ApiError(
                        410, f"episode {p.episode} takes no more calls: {why}"))
                else:
                    live.append(p)
            if not live:
                continue
            self.stats.waits.append(now - live[0].arrived)
            self.stats.sizes.append(len(live))
            t0 = time.perf_counter()
            try:
                results = self.run_batch(backend, live)
            finally:
                self.stats.generate_s += time.perf_counter() - t0
            for p, r in zip(live, results):
                if isinstance(r, BaseException):
                    p.future.set_exception(GenerationFailed(r))
                else:
                    p.future.set_result(r)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                raise failed[0]

    def run_batch(self, backend: GenerateBackend, batch: list[Pending]
                  ) -> list[GenerateResult | Exception]:
        """One backend.generate call for `batch`: a result per request, or (the call raised,
        or answered the wrong number) its exception for every request."""
        try:
            results = backend.generate([p.request for p in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"{len(results)} results for {len(batch)} requests")
            return list(results)
        except Exception as e:  # noqa: BLE001 - answered per request, raised by serve
            return [e] * len(batch)

    def fail_pending(self, why: str | None = None) -> None:
        """Answer 410 to every pending request (`why`: the server stopped serving), or with
        `why` None to those of episodes that take no more calls."""
        with self.cond:
            reasons = [why or self.refusal(p.episode) for p in self.pending]
            failed = [(p, r) for p, r in zip(self.pending, reasons) if r]
            self.pending = [p for p, r in zip(self.pending, reasons) if not r]
        for p, reason in failed:
            p.future.set_exception(ApiError(
                410, f"episode {p.episode} takes no more calls: {reason}"))

    def forget(self, episode: str) -> None:
        """Drop what the queue knows of a closed episode."""
        with self.cond:
            self.answered.pop(episode, None)
            self.outstanding.pop(episode, None)
            self.cond.notify_all()
