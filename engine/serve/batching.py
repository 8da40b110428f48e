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
"""
from __future__ import annotations

from engine.api.batcher import GenerateQueue
from engine.api.requests import ApiError

CLIENTS = "serve"   # the one queue key of a serve endpoint's requests


class ServeQueue(GenerateQueue):
    """GenerateQueue with the module's rule; no request is ever refused as "finished"."""

    def __init__(self, gather_s: float = 0.02, max_batch: int | None = None) -> None:
        super().__init__(dict, lambda key: None, gather_s=gather_s, max_wait_s=gather_s,
                         max_batch=max_batch)

    def _wait(self, now: float) -> float:
        if self.max_batch is not None and len(self.pending) >= self.max_batch:
            return 0.0
        return max(0.0, self.pending[0].arrived + self.gather_s - now)

    def fail_all(self, why: str) -> None:
        """Answer 503 to every pending request (the endpoint is stopping)."""
        with self.cond:
            failed, self.pending = self.pending, []
        for p in failed:
            p.future.set_exception(ApiError(503, why, kind="server_error"))
