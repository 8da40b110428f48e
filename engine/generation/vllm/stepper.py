"""Step-level generation on a VLLMRolloutEngine: requests join vLLM's running batch as they
arrive and leave it at their own end (continuous batching), driven through vLLM 0.32's public
LLMEngine API (`add_request`, `step`, `abort_request`, `has_unfinished_requests`) on the
thread that owns the engine (the engine is not thread-safe: every call of this module runs
there).

Contract: the same as VLLMRolloutEngine.generate's, request by request. A request's vLLM
SamplingParams are built by the engine's own `vllm_params` (its seed, the contract's log-probs,
the stop ids), its finished output is read by the engine's `generation` and a scoring request
by engine.generation.vllm.scoring's `prompt_scores`: so a request's tokens and log-probs are
what `generate` gives it, whatever runs beside it and whenever it arrived (vLLM seeds a
generator per request; tested against `generate` and alone vs under load in
tests/test_serve_steps.py).

Per step, only what the step needs (what a lone `serve` request cost beyond vLLM's own server:
docs/benchmarks.md, "A lone request: serve against vLLM's server"):
- The global RNG states: vLLM's CPU sampling draws from the global torch RNG of the process
  that samples, even with per-request seeds. The backend's engines sample in another process
  (on CPU the model runs in vLLM's worker process, engine_args' "mp" executor; on GPUs the
  engine core has a process of its own), so a step leaves this process's RNGs alone (tested);
  a step runs under `preserved_global_rng` only when vLLM samples in this process
  (`samples_here`: an in-process engine core whose executor runs the model here). The save
  and restore cost ~0.2 ms a step on an idle 2-core host (numpy's state most of it), and
  1.5 ms at load 6: a fifth of a lone request's time there.
- Log-probs (`logprobs`, default True): each generation carries the contract's log-prob of
  every sampled token (what rollout trains on). With `logprobs=False` (`serve`, whose reported
  log-probs all come from a scoring pass, engine.api.evaluation) vLLM is asked for none (its
  per-token log-prob lists, built in the worker, sent and gathered here, were a quarter of a
  lone greedy request's time), and a Generation's response_logprobs are NaN, one per token
  (requests.generation; so_far's too); scoring requests are unchanged.

Keys: the caller's request keys are vLLM's external request ids (unique per driver: a key
still running is refused). A step's outputs: for each streamed request (`add(stream=True)`)
with new tokens, its ids so far (`StepOutput.ids`), and for every request once finished its
`Generation` (or `SequenceScores` for a scoring request, `add_scoring`). vLLM hands a streamed
request's new tokens only (its DELTA outputs, gathered here with their log-prob entries) and
the others' at their end only (FINAL_ONLY): no step copies a whole reply. `abort(key)`
removes a request from the engine (a cancelled client); its slot is free from the next step;
`so_far(key)` gives a streamed request's ids and log-probs before it is aborted (the cut of a
partial rollout, engine.rl.collect.partial_session).

CPU: vLLM 0.32 prefills a prompt that does not fit a step's token budget in chunks and rewinds
its seeded generator with set_offset, which a CPU generator refuses ("CPU Generator does not
use offset": 24 seeded 400-token prompts added at once killed the engine). On a CPU host a
request is therefore held by the driver (`waiting`) and handed to vLLM at a step whose
prefills fit max_num_batched_tokens beside the running requests' decode tokens (`_feed`); a
single prompt longer than that budget still goes alone, and vLLM chunks it. On GPUs requests
go to vLLM at once (CUDA generators take offsets).

Events (`events`, the last MAX_EVENTS): ("added", key, step), ("finished", key, step),
("aborted", key, step), with `step` the number of engine steps run before the event, so tests
and benchmarks read which request joined a running batch and which finished first without
clocks.

`generate` and `score` of the engine must not run while requests are in the driver (vLLM's
offline `LLM.generate` steps every request of the engine and would take their outputs): a
server uses one or the other (engine.api.stepping uses the driver only).
"""
from __future__ import annotations

import contextlib
import importlib
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

from engine.generation.base import SamplingParams
from engine.generation.steps import MAX_EVENTS, StepOutput
from engine.generation.vllm.library import vllm_module
from engine.generation.vllm.process import preserved_global_rng
from engine.generation.vllm.requests import generation, stop_ids
from engine.generation.vllm.scoring import prompt_scores, scoring_args, scoring_problem


@dataclass
class _Running:
    prompt: list[int]
    greedy: bool
    top_k: int | None = None   # a scoring request's k
    stops: frozenset = frozenset()   # the ids that end it (requests.stop_ids)
    ids: list[int] = field(default_factory=list)         # a streamed request's ids so far
    logprobs: list = field(default_factory=list)        # and vLLM's log-prob entries


def samples_here(engine) -> bool:
    """Whether `engine`'s (a VLLMRolloutEngine) vLLM samples in this process: its engine core
    is here (the CPU layout) with an executor other than vLLM's MultiprocExecutor, whose
    workers are processes of their own (module docstring: never with the backend's
    engine_args)."""
    _, executor = engine._vllm_parts()
    if executor is None:          # the engine core runs in a process of its own
        return False
    multiproc = importlib.import_module("vllm.v1.executor.multiproc_executor")
    return not isinstance(executor, multiproc.MultiprocExecutor)


class VLLMStepDriver:
    """The module's driver over `engine` (a VLLMRolloutEngine built in this process);
    `logprobs`: whether generations carry the contract's log-probs (module docstring)."""

    def __init__(self, engine, logprobs: bool = True) -> None:
        self.engine = engine
        self.logprobs = logprobs
        self._rng_kept = preserved_global_rng if samples_here(engine) else \
            contextlib.nullcontext
        self.running: dict[str, _Running] = {}
        self.waiting: dict[str, tuple[list[int], object]] = {}   # CPU: not in vLLM yet
        self.steps = 0
        self.events: deque[tuple[str, str, int]] = deque(maxlen=MAX_EVENTS)

    @property
    def llm_engine(self):
        return self.engine.llm.llm_engine

    @property
    def busy(self) -> bool:
        """True while a request is in the engine (running or waiting in vLLM's scheduler)."""
        return bool(self.running)

    def in_flight(self) -> set[str]:
        """The keys of the requests in the driver (added, not finished, not aborted)."""
        return set(self.running)

    def _add(self, key: str, prompt: list[int], params, state: _Running) -> None:
        if key in self.running:
            raise ValueError(f"request {key!r} is already running in the step driver")
        if self.engine.on_cpu:    # handed to vLLM by _feed (module docstring, "CPU")
            self.waiting[key] = (list(prompt), params)
        else:
            self.llm_engine.add_request(key, {"prompt_token_ids": list(prompt)}, params,
                                        lora_request=self.engine.lora_request())
        self.running[key] = state
        self.events.append(("added", key, self.steps))

    def _feed(self) -> None:
        """CPU: hand waiting requests to vLLM, oldest first, while this step's prefills fit
        beside the running requests' decode tokens (scheduler_config.max_num_batched_tokens)
        and within max_num_seqs; one at least when vLLM holds none (module docstring)."""
        config = self.engine.vllm_config.scheduler_config
        held = len(self.running) - len(self.waiting)
        used = held
        for key, (prompt, params) in list(self.waiting.items()):
            if held and (used + len(prompt) > config.max_num_batched_tokens
                         or held >= config.max_num_seqs):
                break
            self.llm_engine.add_request(key, {"prompt_token_ids": prompt}, params,
                                        lora_request=self.engine.lora_request())
            del self.waiting[key]
            held, used = held + 1, used + len(prompt)

    def add(self, key: str, prompt: list[int], params: SamplingParams,
            stream: bool = False) -> None:
        """Start one generation (params.seeds: one seed, or params.seed; the engine's rule);
        `stream`: report its ids after every step (vLLM's delta outputs), else only its end
        (vLLM's final-only outputs: no per-step copies). Raises (ValueError) what `generate`
        refuses, before anything runs."""
        (vllm_params,) = self.engine.vllm_params([list(prompt)], params)
        self.add_built(key, prompt, vllm_params, params.temperature == 0, stream)

    def add_built(self, key: str, prompt: list[int], vllm_params, greedy: bool,
                  stream: bool = False) -> None:
        """`add` with the request's vLLM SamplingParams already built by the engine's
        `vllm_params` (a whole call's requests built together: engine.generation.vllm.rounds);
        `greedy`: built at temperature 0. Without `logprobs` (the driver's) the request asks
        vLLM for none."""
        vllm_params.output_kind = _output_kind(stream)
        if not self.logprobs:
            vllm_params.logprobs = None
        self._add(key, prompt, vllm_params, _Running(
            list(prompt), greedy, stops=stop_ids(vllm_params)))

    def add_scoring(self, key: str, sequence: list[int], top_k: int) -> None:
        """Start scoring one sequence (engine.generation.scoring's contract, as `score`)."""
        model_config = self.engine.vllm_config.model_config
        problem = scoring_problem([sequence], top_k, int(model_config.max_logprobs),
                                  int(model_config.max_model_len))
        if problem:
            raise ValueError(problem)
        self._add(key, sequence, self._scoring_params(top_k),
                  _Running(list(sequence), True, top_k))

    @staticmethod
    def _scoring_params(top_k: int):
        return vllm_module().SamplingParams(**scoring_args(top_k),
                                            output_kind=_output_kind(False))

    def so_far(self, key: str) -> tuple[list[int], list[float]]:
        """A running streamed request's sampled ids so far and the contract's log-prob of each
        (what a partial rollout carries when it cuts the request; [] and [] for a key not
        running; NaN log-probs from a driver without `logprobs`)."""
        state = self.running.get(key)
        if state is None:
            return [], []
        if not self.logprobs:
            return list(state.ids), [float("nan")] * len(state.ids)
        return list(state.ids), [step[token].logprob
                                 for step, token in zip(state.logprobs, state.ids)]

    def abort(self, key: str) -> None:
        """Remove a running request (nothing happens for a key not running)."""
        if self.running.pop(key, None) is not None:
            if self.waiting.pop(key, None) is None:
                self.llm_engine.abort_request([key])
            self.events.append(("aborted", key, self.steps))

    def step(self) -> list[StepOutput]:
        """One engine step: the requests with new tokens, the finished ones with their
        result (module docstring). Nothing to run: []."""
        if not self.running:
            return []
        self._feed()
        with self._rng_kept():   # only where vLLM samples in this process (module docstring)
            outputs = self.llm_engine.step()
        self.steps += 1
        out = []
        for o in outputs:
            state = self.running.get(o.request_id)
            if state is None:        # aborted meanwhile
                continue
            completion = o.outputs[0]
            if not o.finished or state.ids:     # a delta: gather (module docstring)
                state.ids += completion.token_ids
                state.logprobs += completion.logprobs or []
                completion = SimpleNamespace(
                    token_ids=state.ids, logprobs=state.logprobs if self.logprobs else None,
                    finish_reason=completion.finish_reason)
            if not o.finished:
                out.append(StepOutput(o.request_id, list(state.ids)))
                continue
            del self.running[o.request_id]
            self.events.append(("finished", o.request_id, self.steps))
            if state.top_k is not None:
                done = prompt_scores(state.prompt, o.prompt_logprobs, state.top_k)
                out.append(StepOutput(o.request_id, [], done))
                continue
            if self.logprobs:     # the contract's sampler carries the log-probs asked
                self.engine.check_contract(state.greedy)
            done = generation(state.prompt, completion, state.stops)
            out.append(StepOutput(o.request_id, list(done.response_ids), done))
        return out


def _output_kind(stream: bool):
    """vLLM's RequestOutputKind: DELTA for a streamed request, FINAL_ONLY otherwise."""
    kinds = vllm_module().sampling_params.RequestOutputKind   # its owner imported vLLM already
    return kinds.DELTA if stream else kinds.FINAL_ONLY
