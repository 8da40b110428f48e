"""The batching rule of a serve endpoint: its clients are independent (no episodes to wait
for), so the agent queue's rule (engine.api.batcher: wait while a live episode is expected
to call) reduces to a gathering window.

Rule: when the backend is free and a request is pending, every pending request (oldest first,
at most max_batch) goes in ONE generate call once the oldest has waited gather_s, or at once
when max_batch are pending. Requests that arrive while a generate call runs wait for it and go
together in the next one. SamplingBackend (engine.api.backend) turns the batch into one
engine call per (temperature, top_p) (each request keeps its own vLLM sampling fields in it,
SamplingParams.sampling: per row), plus one per budget for requests whose prompt would pass
--max-context with the batch's largest max_tokens. Batching changes no sample: each request is
seeded on its own (engine.serve.endpoint for the seeds). A backend with a step-level driver
(engine.api.stepping) does not batch this way: its requests join the running engine step.

Admission (engine.api.batcher): a request whose choices (prompts x n) would take the waiting
choices past max_pending gets 429 (--max-queue, DEFAULT_MAX_QUEUE); a request of more than
--max-choices choices is a 400 before it is tokenized
(engine.serve.endpoint). Once the serving loop's `until()` holds (SIGTERM / Ctrl-C), the queue
closes between generate calls: what is pending and what arrives get 503 at once, the call in
flight is answered.

Failures: a generate call that raises is retried in halves (each half one call, again halved
while it fails), so a request that fails alone gets its 503 and the others of its batch their
replies (each request is seeded on its own: a retried one samples what it would have). While
`alive()` is false (the engine died) nothing is retried: the whole batch gets 503. The retries
are bounded (a failing request costs about 2 log2(batch) extra calls once, not per arrival):
a request that failed in a call of its own is never retried, and its twins (the same prompt
ids, max_tokens, temperature, top_p, score_top_k and sampling fields; the seed is left out,
so an unseeded client's automatic retry, which gets a new seed, is a twin) are answered 503
without a call: at admission (code repeated_failure, Retry-After the seconds left) and, when
already queued, before their batch is generated. `FailedTwins` remembers the fingerprints (a
128-bit hash) of at most TWIN_CAPACITY such requests for TWIN_TTL_S seconds each, the oldest
forgotten first.
"""
from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from typing import Callable

from engine.api.backend import GenerateBackend, GenerateRequest, GenerateResult
from engine.api.batcher import GenerateQueue, Pending
from engine.api.requests import ApiError

CLIENTS = "serve"   # the one queue key of a serve endpoint's requests
DEFAULT_MAX_QUEUE = 1024   # --max-queue: choices waiting for the engine before 429s
STOPPING = "the server is stopping"
TWIN_TTL_S = 60.0     # how long a request that failed alone refuses its twins
TWIN_CAPACITY = 1024  # failed fingerprints remembered at most (the oldest go first)


def fingerprint(request: GenerateRequest) -> bytes:
    """128-bit hash of what decides whether a request fails: its prompt ids and sampling
    settings, not its seed (module docstring)."""
    key = repr((request.prompt_ids, request.max_tokens, request.temperature, request.top_p,
                request.score_top_k, request.sampling)).encode()
    return hashlib.blake2b(key, digest_size=16).digest()


class FailedTwins:
    """Fingerprints of requests that failed in a generate call of their own, each kept
    `ttl_s` seconds, at most `capacity` of them (the oldest evicted first); ttl_s 0 or
    capacity 0: nothing is remembered. Not thread-safe: ServeQueue holds its lock."""

    def __init__(self, ttl_s: float = TWIN_TTL_S, capacity: int = TWIN_CAPACITY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.capacity, self.clock = ttl_s, capacity, clock
        self.failed: OrderedDict[bytes, float] = OrderedDict()   # fingerprint -> when

    def add(self, request: GenerateRequest) -> None:
        if self.ttl_s <= 0 or self.capacity <= 0:
            return
        key = fingerprint(request)
        self.failed.pop(key, None)
        self.failed[key] = self.clock()
        while len(self.failed) > self.capacity:
            self.failed.popitem(last=False)

    def left_s(self, request: GenerateRequest) -> float | None:
        """Seconds its twin's failure still refuses `request`; None: not refused."""
        key = fingerprint(request)
        when = self.failed.get(key)
        if when is None:
            return None
        left = when + self.ttl_s - self.clock()
        if left <= 0:
            del self.failed[key]
            return None
        return left


def twin_failed(left_s: float, ttl_s: float) -> ApiError:
    """503 (code repeated_failure) of a request whose twin failed alone (module docstring)."""
    error = ApiError(503, "an identical request (the same prompt ids and sampling settings, "
                     "any seed) failed generation on its own; identical requests are refused "
                     f"for {ttl_s:g} s after such a failure: retry after {math.ceil(left_s)} s "
                     "or change the request", kind="server_error", code="repeated_failure")
    error.retry_after_s = math.ceil(left_s)
    return error


class ServeQueue(GenerateQueue):
    """GenerateQueue with the module's rule; no request is ever refused as "finished"."""

    def __init__(self, gather_s: float = 0.02, max_batch: int | None = None,
                 max_pending: int | None = DEFAULT_MAX_QUEUE,
                 twins: FailedTwins | None = None) -> None:
        super().__init__(dict, lambda key: None, gather_s=gather_s, max_wait_s=gather_s,
                         max_batch=max_batch, max_pending=max_pending)
        self.alive: Callable[[], bool] = lambda: True   # the engine (ServeEndpoint.serve)
        self.twins = twins if twins is not None else FailedTwins()

    def submit_many(self, episode: str, requests: list[GenerateRequest], progress=None):
        """GenerateQueue.submit_many, and 503 (repeated_failure) when one of the choices has
        a twin that failed alone (module docstring)."""
        self.check_twins(requests)
        return super().submit_many(episode, requests, progress)

    def check_twins(self, requests: list[GenerateRequest]) -> None:
        """Raise twin_failed when one of `requests` has a twin that failed alone."""
        with self.cond:
            left = [s for s in map(self.twins.left_s, requests) if s is not None]
        if left:
            raise twin_failed(max(left), self.twins.ttl_s)

    def failed_alone(self, request: GenerateRequest) -> None:
        """`request` failed in a call of its own: its twins are refused (module docstring)."""
        with self.cond:
            self.twins.add(request)

    def wait_s(self, now: float) -> float:
        """GenerateQueue.wait_s under serve's rule: 0 at max_batch pending, else the oldest
        request's gather window left."""
        if self.max_batch is not None and len(self.pending) >= self.max_batch:
            return 0.0
        return max(0.0, self.pending[0].arrived + self.gather_s - now)

    def next_batch(self, until: Callable[[], bool], poll_s: float = 0.05) -> list[Pending]:
        """The next batch by the rule; [] once `until()` holds, after closing the queue (the
        module docstring: pending requests get 503 instead of a batch)."""
        def stopping() -> bool:
            if until():
                self.close(STOPPING)
                return True
            return False

        return [] if stopping() else super().next_batch(stopping, poll_s)

    def run_batch(self, backend: GenerateBackend, batch: list[Pending]
                  ) -> list[GenerateResult | Exception]:
        """One generate call; when it fails and the engine is alive, each half again (module
        docstring): only requests that fail in a call of their own get their exception, and
        their queued twins get one without a call."""
        with self.cond:
            twin = [self.twins.left_s(p.request) is not None for p in batch]
        if any(twin):
            rest = iter(self.run_batch(backend, [p for p, t in zip(batch, twin) if not t])
                        if not all(twin) else ())
            return [RuntimeError("an identical request failed generation on its own")
                    if t else next(rest) for t in twin]
        results = super().run_batch(backend, batch)
        if not isinstance(results[0], Exception) or not self.alive():
            return results
        if len(batch) == 1:
            self.failed_alone(batch[0].request)
            return results
        half = len(batch) // 2
        return self.run_batch(backend, batch[:half]) + self.run_batch(backend, batch[half:])
