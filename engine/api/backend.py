"""The generate backend behind both OpenAI servers (the agent endpoint, `serve`), and the seed
of every call.

A backend turns a batch of requests into one sampled continuation each, in ONE call (a server
gathers the requests of concurrent clients into that call: engine.api.batcher).
It runs on the thread that owns the rollout engines, never on the HTTP thread.

Contract of `GenerateBackend.generate(requests) -> results` (one result per request, in order):
- result.ids: the sampled ids, at most request.max_tokens of them, the end-of-sequence id
  included when one was sampled (finish_reason "stop"), else finish_reason "length";
- result.logprobs: one per sampled id, per the log-probability contract of
  engine.generation.base (log_softmax(logits / T) of the unmodified logits at the request's
  temperature; top-p only restricts the draw);
- request i's sample depends on (its prompt ids, its seed, its sampling settings) only: never
  on the other requests of the batch, their number or their order;
- a request with max_tokens 0 is generated nothing (ids [], finish_reason "length");
- scoring (`serve` only; the agent endpoint never asks): a request with score_top_k = k (not
  None) gets result.scores over prompt_ids + result.ids: for that sequence s of m ids,
  scores.logprobs[i - 1] = log P(s[i] | s[:i]) = log_softmax of the model's RAW logits after
  s[:i] (float32; temperature and top_p do not change them: vLLM's raw_logprobs), and
  scores.top[i - 1] the k most likely next ids {id: log-prob}, most likely first ({} for k
  0), i = 1..m-1. result.logprobs stay the sampling ones (above).
- sampling (`serve` only): vLLM's sampling fields (engine.api.sampling_fields.SamplingFields;
  None: neutral) shape the draw and the stop ids (stop_token_ids, ignore_eos: finish_reason
  "stop" when the reply ends in one of its stop ids), never result.logprobs (the contract
  above: the unshaped logits) nor the scores (serve's reported log-probs: raw, as vLLM's
  raw_logprobs).

Seeds: call c of an episode, choice k, samples with call_seed(episode response seed, c, k):
turn_seed for choice 0 (the seeds of engine.rl.env.episodes' turns, so an agent whose calls
follow the environment path's turns samples what that path samples), a hash for the other
choices. engine.generation.sampling_backend serves this protocol with a rollout engine.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

from engine.api.sampling_fields import SamplingFields


@dataclass(frozen=True)
class GenerateRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int          # >= 0 (0: nothing generated)
    temperature: float       # >= 0 (0: greedy)
    top_p: float             # (0, 1]
    seed: int                # non-negative 63-bit
    score_top_k: int | None = None   # k >= 0: score prompt + reply (module docstring)
    sampling: SamplingFields | None = None   # vLLM's sampling fields (module docstring)


@dataclass
class TokenScores:
    """Raw-logit log-probs of a sequence of m ids (module docstring): m - 1 entries each."""

    logprobs: list[float]            # entry i - 1: log P(ids[i] | ids[:i])
    top: list[dict[int, float]]      # entry i - 1: the k most likely ids after ids[:i]


@dataclass
class GenerateResult:
    ids: list[int]
    logprobs: list[float]
    finish_reason: str       # "stop" or "length"
    scores: TokenScores | None = None   # when the request asked score_top_k


class GenerateBackend(Protocol):
    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """One result per request, in order, in one batched call (module docstring)."""


def turn_seed(response_seed: int, turn: int) -> int:
    """The sampling seed of one turn of one episode: turn 0 uses the response seed itself (so a
    one-turn episode samples what single-turn RL samples); later turns hash (seed, turn).
    engine.rl.env.episodes seeds its turns with it; call_seed's choice 0 is it."""
    if turn == 0:
        return response_seed
    key = f"{response_seed}/turn/{turn}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def call_seed(response_seed: int, call: int, choice: int = 0) -> int:
    """The sampling seed of choice `choice` of call `call` of an episode (module docstring)."""
    if choice == 0:
        return turn_seed(response_seed, call)
    key = f"{response_seed}/call/{call}/choice/{choice}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
