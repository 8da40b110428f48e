"""Which of the Tinker service's queued requests run together in one call of the model: the
worker takes the first queued request and then those right behind it that `joins` admits
(engine.tinker.service)."""
from __future__ import annotations

MAX_SAMPLE_ROWS = 512   # rows of one generate call that sample requests join


def one_call(a: dict, b: dict) -> bool:
    """Whether sample requests' checked params `a` and `b` can share a generate call (the
    engine's temperature and top_p are per call; everything else is per row:
    engine.tinker.sampler.sample_on)."""
    return (a["temperature"], a["top_p"]) == (b["temperature"], b["top_p"])


def joins(batch: list, item: tuple, max_sessions: int) -> bool:
    """Whether queued work `item` runs in one call with `batch` (kind, payload, future)
    items: forward_backward with forward_backward; a sample request with sample requests of
    `one_call` params, up to MAX_SAMPLE_ROWS rows and `max_sessions`
    sampling sessions (all of whose adapters the sampler then holds at once)."""
    (kind, first, _), (other, payload, _) = batch[0], item
    if kind != other:
        return False
    if kind == "forward_backward":
        return True
    sessions = {p["session"] for _, p, _ in batch} | {payload["session"]}
    return one_call(payload["params"], first["params"]) and len(sessions) <= max_sessions \
        and sum(p["num_samples"] for _, p, _ in batch) + payload["num_samples"] \
        <= MAX_SAMPLE_ROWS
