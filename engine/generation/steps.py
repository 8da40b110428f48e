"""What a step-level generation driver hands back (engine.generation.vllm.stepper,
engine.generation.hf.stepper: the same interface, `add`, `add_scoring`, `abort`, `so_far`, `step`,
`busy`, `steps`, `events`), shared so a server reads either driver's outputs alike."""
from __future__ import annotations

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
