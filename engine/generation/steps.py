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
