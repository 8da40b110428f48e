"""Step-level generation on an HFRolloutEngine: requests join the running batch as they arrive
and leave it at their own end (continuous batching), over the slot cache of
engine.generation.hf.slot_cache, on the thread that owns the engine (every call of this module
runs there). The interface and events are engine.generation.vllm.stepper.VLLMStepDriver's.

A step: (1) one decode forward of every running row (the engine's StaticDecoder.step, compiled
when rollout.hf.compile is on; an eager StaticDecoder of the driver's own otherwise), each row
sampling its next token; (2) the scoring requests added since the last step, each by the
engine's own `score` (one forward); (3) the generations added since the last step, prefilled
together (engine.generation.hf.prefill: rows with the same prompt, a group's replies, share
one forward of it; distinct prompts of one length are batched without padding), each sampling
its first token with its own uniform; those that go on are copied into free slots (the slot
cache's `arrange` / `place`). A finished or aborted row frees its slot at once.

Contract: `generate`'s, request by request. Each row samples with engine.generation.sampling's
`draw` and its own uniforms u(seed, step) (`uniforms`: its seed, `row_seeds` of its one
prompt, and its own step counter, from SamplingParams.first_steps; its vLLM sampling fields,
SamplingParams.sampling: engine.generation.processing), stops at an eos id of the engine (its
fields' stop ids) or at its bound (max_new_tokens, or row_max_new_tokens), and reports log-probs per
engine.generation.base's contract: so its tokens do not depend on what runs beside it or when
it joined, and its log-probs differ from `generate`'s only by rounding (the static path's
tolerance: tests/test_hf_stepper.py, fp32 on the CPU).

Keys, outputs and events are VLLMStepDriver's: a step's outputs are, for each streamed request
(`add(stream=True)`) that moved, its ids so far, and for each request once finished its
Generation (SequenceScores for a scoring request); events ("added", key, step),
("finished", key, step), ("aborted", key, step) with `step` the steps run before the event,
and ("failed", key, step) for a request that failed alone (its own prefill or scoring raised:
`step` raises engine.generation.steps.RequestsFailed once the other requests' step ran).

Refused by name (`step_problem`, also raised by the constructor): a model with a vision tower
(image prompts decode on the eager loop), layers other than full attention (the slot cache
copies and shifts whole key/value rows: static_decode.static_problem), and an engine
reporting routed experts (R3). `generate` and `score` of the engine must not run while
requests are in the driver (they share the engine's decoder caches): a server uses one or the
other.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from engine.generation.base import Generation, SamplingParams
from engine.generation.hf.backend import cache_keyword
from engine.generation.hf.prefill import prefill_apart
from engine.generation.hf.slot_cache import SlotCache
from engine.generation.hf.static_decode import StaticDecoder, static_problem
from engine.generation.processing import row_stops, shape
from engine.generation.sampling import STEP_CHUNK, draw, row_seeds, uniforms
from engine.generation.scoring import check_sequences
from engine.generation.steps import MAX_EVENTS, RequestsFailed, StepOutput
from models.vision.inputs import ImagePrompt


def step_problem(engine) -> str | None:
    """Why HFStepDriver does not serve `engine` (module docstring), or None."""
    if engine.vision is not None:
        return (f"{engine.hf_path} has a vision tower (image prompts decode on the eager "
                "loop, one generate call per batch)")
    if getattr(engine, "_routing", None) is not None:
        return "the engine reports routed experts (R3), which the step driver does not record"
    problem = static_problem(engine.model)
    return None if problem is None else f"{engine.hf_path}: {problem}"


@dataclass
class _Row:
    prompt: list[int]
    seed: int
    first_step: int            # its step counter's start (SamplingParams.first_steps)
    limit: int                 # its bound on response tokens
    temperature: float
    top_p: float
    stream: bool
    sampling: object = None    # its vLLM sampling fields (SamplingParams.sampling; None)
    stops: frozenset = frozenset()   # the ids that end it (processing.row_stops)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    chunk: tuple[int, list[float]] = (-1, [])   # (first step, its STEP_CHUNK uniforms)

    @property
    def step(self) -> int:
        """The decode step its next token counts as (its uniform's counter)."""
        return self.first_step + len(self.ids)

    def uniform(self) -> float:
        """u(seed, step): engine.generation.sampling's number for its next token, made for
        STEP_CHUNK steps at a time (one hash per step cost about a millisecond per decode
        step on a CPU); the same float64 as `uniforms(seed, step, 1)`."""
        start = self.step - self.step % STEP_CHUNK
        if self.chunk[0] != start:
            seed = torch.tensor([self.seed], dtype=torch.int64)
            self.chunk = (start, uniforms(seed, start, STEP_CHUNK)[0].tolist())
        return self.chunk[1][self.step - start]


class HFStepDriver:
    """The module's driver over `engine` (an HFRolloutEngine of this process)."""

    def __init__(self, engine) -> None:
        problem = step_problem(engine)
        if problem:
            raise ValueError(f"the hf step driver does not serve this engine: {problem}")
        self.engine = engine
        self.own_decoder = engine.decoder is None   # the engine decodes eagerly
        decoder = engine.decoder or StaticDecoder(engine.model, cache_keyword(engine.model),
                                                  False, engine.device)
        self.layout = SlotCache(decoder, engine.pad_token_id, engine.device)
        self.eos = set(engine.eos_token_ids)
        self.waiting: dict[str, _Row] = {}            # added, prefilled at the next step
        self.scoring: dict[str, tuple[list[int], int]] = {}
        self.running: dict[int, tuple[str, _Row]] = {}    # slot -> (key, row)
        self.steps = 0
        self.events: deque[tuple[str, str, int]] = deque(maxlen=MAX_EVENTS)

    @property
    def busy(self) -> bool:
        """True while a request is in the driver (waiting for its prefill or running)."""
        return bool(self.waiting or self.scoring or self.running)

    def _keys(self) -> set[str]:
        return set(self.waiting) | set(self.scoring) | {k for k, _ in self.running.values()}

    def in_flight(self) -> set[str]:
        """The keys of the requests in the driver (added, not finished, not aborted)."""
        return self._keys()

    def _added(self, key: str) -> None:
        if key in self._keys():
            raise ValueError(f"request {key!r} is already running in the step driver")
        self.events.append(("added", key, self.steps))

    def add(self, key: str, prompt: list[int], params: SamplingParams,
            stream: bool = False) -> None:
        """Start one generation (params.seeds: one seed, or params.seed; first_steps and
        row_max_new_tokens: one entry each when given); `stream`: report its ids after every
        step, else only its end. Raises (ValueError) what `generate` refuses, and more than
        one entry in a per-prompt list, before anything runs."""
        if isinstance(prompt, ImagePrompt):
            raise ValueError("an image prompt is not served by the hf step driver (image "
                             "prompts decode on the eager loop)")
        for name in ("seeds", "first_steps", "row_max_new_tokens", "sampling"):
            given = getattr(params, name)
            if given is not None and len(given) != 1:
                raise ValueError(f"SamplingParams.{name} has {len(given)} entries; the step "
                                 "driver takes one prompt per request (one entry)")
        (checked,) = check_sequences([prompt], 0, self.engine.vocab_size)
        limit = (params.max_new_tokens if params.row_max_new_tokens is None
                 else int(params.row_max_new_tokens[0]))
        sampling = None if params.sampling is None else params.sampling[0]
        row = _Row(checked, row_seeds(params, 1)[0],
                   0 if params.first_steps is None else int(params.first_steps[0]), limit,
                   float(params.temperature), float(params.top_p), stream, sampling,
                   row_stops([sampling], self.eos, 1)[0])
        self._added(key)
        self.waiting[key] = row

    def add_scoring(self, key: str, sequence: list[int], top_k: int) -> None:
        """Start scoring one sequence (engine.generation.scoring's contract, as `score`)."""
        (checked,) = check_sequences([sequence], top_k, self.engine.vocab_size)
        self._added(key)
        self.scoring[key] = (checked, int(top_k))

    def so_far(self, key: str) -> tuple[list[int], list[float]]:
        """A request's sampled ids so far and the log-prob of each (what a partial rollout
        carries when it cuts the request, engine.rl.collect.partial_session; [] and [] for a
        key not in the driver or not yet prefilled)."""
        for k, row in self.running.values():
            if k == key:
                return list(row.ids), list(row.logprobs)
        return [], []

    def abort(self, key: str) -> None:
        """Remove a request (nothing happens for a key not in the driver); its slot is free
        at once."""
        found = self.waiting.pop(key, None) is not None or \
            self.scoring.pop(key, None) is not None
        for slot, (k, _) in list(self.running.items()):
            if k == key:
                self._free(slot)
                found = True
        if found:
            self.events.append(("aborted", key, self.steps))

    def _free(self, slot: int) -> None:
        del self.running[slot]
        self.layout.release(slot)
        if not self.running:
            self.layout.clear()
            if self.own_decoder:
                self.layout.decoder.release()   # the driver's own caches: nothing runs

    def step(self) -> list[StepOutput]:
        """One engine step (module docstring): the requests with new tokens, the finished
        ones with their result. Nothing to run: []. A request whose own prefill or scoring
        raised fails alone: it leaves the driver (event "failed") and, once every other
        request's step ran, RequestsFailed carries the failures and the step's outputs; a
        decode forward (every running row's) that raises is raised as it is."""
        if not self.busy:
            return []
        self.engine._check_ready("the hf step driver")
        self.steps += 1
        failed: dict[str, BaseException] = {}
        with torch.no_grad():
            out = self._decode() if self.running else []
            for key in list(self.scoring):
                sequence, top_k = self.scoring.pop(key)
                try:
                    (done,) = self.engine.score([sequence], top_k)
                except Exception as e:  # noqa: BLE001 - this request fails alone
                    self._failed(failed, key, e)
                    continue
                out.append(self._finished(key, [], done))
            if self.waiting:
                out += self._join(failed)
        if failed:
            raise RequestsFailed(failed, out)
        return out

    def _failed(self, failed: dict[str, BaseException], key: str, error: BaseException) -> None:
        failed[key] = error
        self.events.append(("failed", key, self.steps))

    def _finished(self, key: str, ids: list[int], done) -> StepOutput:
        self.events.append(("finished", key, self.steps))
        return StepOutput(key, ids, done)

    def _moved(self, key: str, row: _Row, token: int, logprob: float) -> StepOutput | None:
        """Record a row's sampled token: its output (None: not streamed, not finished)."""
        row.ids.append(token)
        row.logprobs.append(logprob)
        if token in row.stops or len(row.ids) >= row.limit:
            stop = token in row.stops
            done = Generation(list(row.prompt), list(row.ids), list(row.logprobs),
                              "stop" if stop else "length")
            return self._finished(key, list(row.ids), done)
        return StepOutput(key, list(row.ids)) if row.stream else None

    def _sample(self, logits: torch.Tensor, rows: list[_Row]) -> list[tuple[int, float]]:
        """(token, log-prob) of each row from its fp32 logits [len(rows), V]: rows of the same
        (temperature, top_p) drawn together, each with its own u(seed, step) and its own
        sampling fields (engine.generation.processing.shape over its prompt and ids so far)."""
        groups: dict[tuple[float, float], list[int]] = {}
        for i, row in enumerate(rows):
            groups.setdefault((row.temperature, row.top_p), []).append(i)
        result: list = [None] * len(rows)
        for (temperature, top_p), idx in groups.items():
            u = None if temperature == 0 else torch.tensor(
                [rows[i].uniform() for i in idx], dtype=torch.float64, device=logits.device)
            shaping = shape(logits[idx], [rows[i].sampling for i in idx],
                            [rows[i].prompt for i in idx], [rows[i].ids for i in idx], self.eos)
            token, logprob = draw(logits[idx], temperature, top_p, u, shaping)
            for i, t, lp in zip(idx, token.tolist(), logprob.tolist()):
                result[i] = (t, lp)
        return result

    def _decode(self) -> list[StepOutput]:
        """One decode forward of the running rows, a token each."""
        logits = self.layout.decode()
        slots = sorted(self.running)
        rows = [self.running[s][1] for s in slots]
        out = []
        for slot, row, (token, logprob) in zip(slots, rows, self._sample(logits[slots], rows)):
            key = self.running[slot][0]
            moved = self._moved(key, row, token, logprob)
            if moved is not None and moved.done is not None:
                self._free(slot)
            else:
                self.layout.set_token(slot, token)
            if moved is not None:
                out.append(moved)
        return out

    def _join(self, failed: dict[str, BaseException]) -> list[StepOutput]:
        """Prefill the waiting requests (engine.generation.hf.prefill: one forward per distinct
        prompt, distinct prompts of one length batched; a prompt whose own forward raises
        fails its rows into `failed`), sample each one's first token, and place those that go
        on into free slots, in the order they were added."""
        keys, rows = list(self.waiting), list(self.waiting.values())
        self.waiting.clear()
        drawn: list = [None] * len(rows)
        prefilled, errors = prefill_apart(self.engine.model, cache_keyword(self.engine.model),
                                          [row.prompt for row in rows], self.engine.device)
        for i, error in errors.items():
            self._failed(failed, keys[i], error)
        for done in prefilled:
            sharing = [rows[i] for i in done.rows]
            logits = done.logits[None].expand(len(sharing), -1)
            for i, first in zip(done.rows, self._sample(logits, sharing)):
                drawn[i] = (first, done)
        out, going = [], []
        for key, row, drawn_row in zip(keys, rows, drawn):
            if drawn_row is None:   # failed
                continue
            (token, logprob), done = drawn_row
            moved = self._moved(key, row, token, logprob)
            if moved is not None:
                out.append(moved)
            if moved is None or moved.done is None:
                going.append((key, row, done))
        if going:   # a row will still write limit - 1 columns (its tokens 0 .. limit - 2)
            self.layout.arrange([(len(r.prompt), r.limit - len(r.ids)) for _, r, _ in going])
            for (key, row, done), slot in zip(going, self.layout.free_slots()):
                self.layout.place(slot, done.cache, len(row.prompt), row.ids[-1],
                                  row.limit - len(row.ids), done.index)
                self.running[slot] = (key, row)
        return out
