"""What a step-level generation driver hands back (engine.generation.vllm.stepper,
engine.generation.hf.stepper: the same interface, `add`, `add_scoring`, `abort`, `so_far`, `step`,
`busy`, `in_flight`, `steps`, `events`), shared so a server reads either driver's outputs alike,
and the one abort-on-exit every user of a driver runs its requests under (`aborted_on_error`)."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from engine.generation.base import Generation
from engine.generation.scoring import SequenceScores

MAX_EVENTS = 4096   # a driver's `events` keeps the last this many ("added" / "finished" / ...)


@dataclass
class StepOutput:
    """One request that moved in a step: its key, its sampled ids so far ([] for a scoring
    request) and, once it finished, its result."""
    key: str
    ids: list[int]                                  # sampled so far ([] for scoring)
    done: Generation | SequenceScores | None = None  # set once the request finished


class RequestsFailed(Exception):
    """Raised by a driver's `step` when requests failed on their own in it (a request's own
    prefill or scoring raised: engine.generation.hf.stepper): `failed` maps each one's key to
    its exception, and those requests have left the driver; every other request's step ran,
    `outputs` holding what it returned (finished results included), and they go on. A user
    that knows it answers the failed ones alone (engine.generation.sampling_backend
    .StepBackend); to any other it is the step's failure as before."""

    def __init__(self, failed: dict[str, BaseException], outputs: list[StepOutput]) -> None:
        first = next(iter(failed.items()))
        super().__init__(f"{len(failed)} request(s) failed in a step, e.g. {first[0]!r}: "
                         f"{type(first[1]).__name__}: {first[1]}")
        self.failed, self.outputs = failed, outputs


class BusySlots:
    """Busy slot-steps of a driver whose requests are all streamed (rollout/engine_fill:
    engine.generation.vllm.rounds, engine.rl.collect.partial_session): a request is busy in a
    step when its ids grew in it (vLLM under speculative decoding: several tokens count once).
    `count(outputs)` after every step; `busy` is the total."""

    def __init__(self) -> None:
        self.busy = 0
        self.seen: dict[str, int] = {}

    def count(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            if len(out.ids) > self.seen.get(out.key, 0):
                self.busy += 1
                self.seen[out.key] = len(out.ids)


@contextmanager
def aborted_on_error(driver) -> Iterator[None]:
    """Abort-on-exit of a step driver's users (engine.generation.vllm.rounds' stepped_generate,
    engine.rl.collect.partial_session, engine.api.stepping's StepServing): when the block exits
    by an exception, every request added to `driver` inside the block that has not finished
    (`driver.in_flight()` now, less the keys it held when the block began) is aborted, so
    nothing of the block stays in the engine. Without it vLLM keeps a failed call's requests
    running, and a retry that reuses their keys gets their leftover tokens under the new
    request's key. Requests the driver held before the block are left as they are; the
    exception is raised again, and an abort that fails too (a dead engine) is added to it as
    a note instead of hiding it. `driver`: a step driver or anything with `in_flight()` (the
    keys it holds) and `abort(key)` (engine.generation.sampling_backend.StepBackend)."""
    before = set(driver.in_flight())
    try:
        yield
    except BaseException as error:
        for key in sorted(set(driver.in_flight()) - before):
            try:
                driver.abort(key)
            except Exception as e:  # noqa: BLE001 - the block's own error is the one raised
                error.add_note(f"aborting request {key!r} failed too: {type(e).__name__}: {e}")
        raise
