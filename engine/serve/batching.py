"""The batching rule of a serve endpoint: its clients are independent (no episodes to wait
for), so the agent queue's rule (engine.api.batcher: wait while a live episode is expected
to call) reduces to a gathering window.

Rule: when the backend is free and a request is pending, every pending request (oldest first,
at most max_batch) goes in ONE generate call once the oldest has waited gather_s, or at once
when max_batch are pending. Requests that arrive while a generate call runs wait for it and go
together in the next one. SamplingBackend (engine.api.backend) turns the batch into one
engine call per (temperature, top_p), plus one per budget for requests whose prompt would pass
--max-context with the batch's largest max_tokens. Batching changes no sample: each request is
seeded on its own (engine.serve.endpoint for the seeds).

Admission (engine.api.batcher): a request whose choices (prompts x n) would take the waiting
choices past max_pending gets 429 (--max-queue, DEFAULT_MAX_QUEUE); a request of more than
--max-choices choices is a 400 before it is tokenized
(engine.serve.endpoint). Once the serving loop's `until()` holds (SIGTERM / Ctrl-C), the queue
closes between generate calls: what is pending and what arrives get 503 at once, the call in
flight is answered.

Failures: a generate call that raises is retried in halves (each half one call, again halved
while it fails), so a request that fails alone gets its 503 and the others of its batch their
replies (each request is seeded on its own: a retried one samples what it would have). While
`alive()` is false (the engine died) nothing is retried: the whole batch gets 503.
"""
from __future__ import annotations

from typing import Callable

from engine.api.backend import GenerateBackend, GenerateResult
from engine.api.batcher import GenerateQueue, Pending

CLIENTS = "serve"   # the one queue key of a serve endpoint's requests
DEFAULT_MAX_QUEUE = 1024   # --max-queue: choices waiting for the engine before 429s
STOPPING = "the server is stopping"


class ServeQueue(GenerateQueue):
    """GenerateQueue with the module's rule; no request is ever refused as "finished"."""

    def __init__(self, gather_s: float = 0.02, max_batch: int | None = None,
                 max_pending: int | None = DEFAULT_MAX_QUEUE) -> None:
        super().__init__(dict, lambda key: None, gather_s=gather_s, max_wait_s=gather_s,
                         max_batch=max_batch, max_pending=max_pending)
        self.alive: Callable[[], bool] = lambda: True   # the engine (ServeEndpoint.serve)

    def _wait(self, now: float) -> float:
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
        docstring): only requests that fail in a call of their own get their exception."""
        results = super().run_batch(backend, batch)
        if len(batch) == 1 or not isinstance(results[0], Exception) or not self.alive():
            return results
        half = len(batch) // 2
        return self.run_batch(backend, batch[:half]) + self.run_batch(backend, batch[half:])
