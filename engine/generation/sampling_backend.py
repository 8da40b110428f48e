"""SamplingBackend: the batched generate protocol of engine.api.backend (what the agent
endpoint and `serve` call) over a rollout engine's `generate(prompts, SamplingParams)`, and
(`serve`) its `score(sequences, top_k)` (engine.generation.scoring).
"""
from __future__ import annotations

from typing import Callable

from engine.api.backend import GenerateRequest, GenerateResult, TokenScores
from engine.generation.base import Generation, SamplingParams
from engine.generation.steps import RequestsFailed, aborted_on_error


class SamplingBackend:
    """GenerateBackend over `generate(prompts, SamplingParams) -> [Generation]` (a rollout
    engine's `generate`, or a RolloutPool's wrapped with its n and generation batch): requests
    with the same (temperature, top_p) share one call (each with its own vLLM sampling fields,
    SamplingParams.sampling) with max_new_tokens = their largest
    max_tokens, each cut to its own max_tokens afterwards (exact: a seeded sample's first t
    tokens do not depend on the budget), a cut one finishing "length". A request with
    max_tokens 0 takes no generate call (ids [], "length").

    `max_len` (None: no limit): the most ids a prompt plus its max_new_tokens may reach in one
    call (the agent rollout passes train.seq_length + 1, what every call fits in; vLLM refuses
    a prompt whose length plus the call's max_new_tokens exceeds rollout.vllm.max_model_len).
    A request whose prompt would pass it with the shared budget goes in a call with its own
    max_tokens instead (one call per such budget): the samples are the same either way.

    `score` (None: no request may ask for scores): a rollout engine's `score(sequences, top_k)
    -> [SequenceScores]` (`serve` passes it). After the generate calls, the requests with
    score_top_k set are scored in ONE call: prompt + sampled ids of each, top_k = the largest
    score_top_k among them, each request's top dicts cut to its own k (most likely first, so
    the cut is its own top-k). The agent endpoint never asks: its log-probs are the
    generate calls' (the trained ones)."""

    def __init__(self, generate: Callable[[list[list[int]], SamplingParams], list[Generation]],
                 max_len: int | None = None,
                 score: Callable[[list[list[int]], int], list] | None = None) -> None:
        self._generate = generate
        self._score = score
        self.max_len = max_len
        self.calls = 0
        self.score_calls = 0

    def _calls(self, requests: list[GenerateRequest]) -> list[tuple[int, float, float,
                                                                     list[int]]]:
        """(max_new_tokens, temperature, top_p, request indices) of each generate call."""
        groups: dict[tuple[float, float], list[int]] = {}
        for i, r in enumerate(requests):
            if r.max_tokens > 0:
                groups.setdefault((r.temperature, r.top_p), []).append(i)
        calls = []
        for (temperature, top_p), idx in groups.items():
            budget = max(requests[i].max_tokens for i in idx)
            own: dict[int, list[int]] = {}
            shared = []
            for i in idx:
                r = requests[i]
                if self.max_len is not None and len(r.prompt_ids) + budget > self.max_len:
                    own.setdefault(r.max_tokens, []).append(i)
                else:
                    shared.append(i)
            calls += [(budget, temperature, top_p, shared)] if shared else []
            calls += [(b, temperature, top_p, own[b]) for b in sorted(own)]
        return calls

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        out = [GenerateResult([], [], "length") for _ in requests]
        for max_new_tokens, temperature, top_p, idx in self._calls(requests):
            sampling = [requests[i].sampling for i in idx]
            params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                    top_p=top_p, seeds=[requests[i].seed for i in idx],
                                    sampling=sampling if any(sampling) else None)
            self.calls += 1
            gens = self._generate([list(requests[i].prompt_ids) for i in idx], params)
            for i, gen in zip(idx, gens):
                budget = requests[i].max_tokens
                ids = list(gen.response_ids[:budget])
                cut = gen.finish_reason == "length" or len(gen.response_ids) > budget
                out[i] = GenerateResult(ids, [float(x) for x in gen.response_logprobs[:budget]],
                                        "length" if cut else "stop")
        self._add_scores(requests, out)
        return out

    def _add_scores(self, requests: list[GenerateRequest], out: list[GenerateResult]) -> None:
        """Scores of the requests that asked, in one score call (class docstring)."""
        asked = [i for i, r in enumerate(requests) if r.score_top_k is not None]
        if not asked:
            return
        if self._score is None:
            raise ValueError("a request asked for scores (score_top_k) but this "
                             "SamplingBackend has no score function")
        top_k = max(requests[i].score_top_k for i in asked)
        self.score_calls += 1
        scored = self._score([list(requests[i].prompt_ids) + out[i].ids for i in asked], top_k)
        for i, s in zip(asked, scored):
            k = requests[i].score_top_k
            out[i].scores = TokenScores([float(x) for x in s.logprobs],
                                        [dict(list(d.items())[:k]) for d in s.top])


class StepBackend:
    """GenerateRequest-level continuous batching over a step driver (the interface of
    engine.generation.vllm.stepper.VLLMStepDriver: add, add_scoring, abort, step, busy), for
    a server whose requests join the running engine step (engine.api.stepping). The same
    results as SamplingBackend.generate, request by request: each request runs with its own
    max_tokens (a seeded sample's first t tokens do not depend on the budget), max_tokens 0
    takes no generation, and a request with score_top_k = k is scored after its reply
    (prompt + sampled ids, its own k) by a scoring request of the same driver.

    Keys: the caller's, unique among the requests in flight; a scoring request runs under
    key + SCORING. `calls` counts the requests added to the driver (generations and
    scorings)."""

    SCORING = "/score"

    def __init__(self, driver) -> None:
        self.driver = driver
        self.requests: dict[str, GenerateRequest] = {}
        self.scored: dict[str, GenerateResult] = {}   # key -> its reply, while it is scored
        self.calls = 0

    @property
    def busy(self) -> bool:
        return self.driver.busy

    def add(self, key: str, request: GenerateRequest, stream: bool = False
            ) -> GenerateResult | None:
        """Start `request`; its result at once when nothing is to run (max_tokens 0 without
        scores), else None (it comes from `step`; `stream`: its ids after every step too).
        Raises what the driver refuses."""
        if request.max_tokens == 0:
            return self._finish(key, request, GenerateResult([], [], "length"))
        params = SamplingParams(max_new_tokens=request.max_tokens,
                                temperature=request.temperature, top_p=request.top_p,
                                seeds=[request.seed], sampling=None if request.sampling is None
                                else [request.sampling])
        self.driver.add(key, list(request.prompt_ids), params, stream)
        self.calls += 1
        self.requests[key] = request
        return None

    def _finish(self, key: str, request: GenerateRequest, result: GenerateResult
                ) -> GenerateResult | None:
        """`result`, or None after starting its scoring (class docstring)."""
        if request.score_top_k is None:
            return result
        self.driver.add_scoring(key + self.SCORING, list(request.prompt_ids) + result.ids,
                                request.score_top_k)
        self.calls += 1
        self.requests[key], self.scored[key] = request, result
        return None

    def in_flight(self) -> set[str]:
        """The caller's keys whose generation or scoring runs (engine.generation.steps'
        aborted_on_error aborts them by these)."""
        return set(self.requests)

    def aborted_on_error(self):
        """engine.generation.steps' aborted_on_error over this backend: a block that raises
        leaves none of the requests it added running (its user outside engine.generation,
        engine.api.stepping, takes it from here)."""
        return aborted_on_error(self)

    def abort(self, key: str) -> None:
        """Stop `key`'s generation or scoring (a cancelled client)."""
        self.requests.pop(key, None)
        self.scored.pop(key, None)
        self.driver.abort(key)
        self.driver.abort(key + self.SCORING)

    def step(self) -> list[tuple[str, list[int], GenerateResult | Exception | None]]:
        """One engine step: (key, ids sampled so far, its result once finished) of each
        request that moved; (key, [], the exception) of each that failed alone in it (the
        driver's RequestsFailed: the others' outputs come as usual)."""
        try:
            outputs, failed = self.driver.step(), {}
        except RequestsFailed as e:
            outputs, failed = e.outputs, e.failed
        out = []
        for o in outputs:
            if o.key.endswith(self.SCORING):
                if o.done is None:
                    continue
                key = o.key[:-len(self.SCORING)]
                result = self.scored.pop(key)
                self.requests.pop(key)
                result.scores = TokenScores([float(x) for x in o.done.logprobs],
                                            [dict(d) for d in o.done.top])
                out.append((key, result.ids, result))
            elif o.done is None:
                out.append((o.key, o.ids, None))
            else:
                request = self.requests.pop(o.key)
                gen = o.done
                result = self._finish(o.key, request, GenerateResult(
                    list(gen.response_ids), [float(x) for x in gen.response_logprobs],
                    gen.finish_reason))
                out.append((o.key, list(gen.response_ids), result))
        for key, error in failed.items():
            key = key[:-len(self.SCORING)] if key.endswith(self.SCORING) else key
            self.requests.pop(key, None)
            self.scored.pop(key, None)
            out.append((key, [], error))
        return out
