"""Scoring on vLLM (VLLMRolloutEngine.score; contract in engine.generation.scoring): vLLM's
prompt log-probs of each sequence, read back as SequenceScores, and the full-vocabulary table
of the engine's logit probe. vLLM is imported only inside `vllm_scores` (the reading and the
checks run without it).

vLLM 0.32's prompt log-probs are log_softmax of the raw logits in float32 in every
logprobs_mode (prompt tokens skip the sampling processors), and a request that asks for them
skips reading the prefix cache, so every position is computed. For each position after the
first, vLLM returns {token id: Logprob} holding the prompt's token and the `prompt_logprobs`
most likely ids (rank 1 = most likely; k + 1 entries when the prompt's token is not among them,
k when it is; prompt_logprobs=0: the prompt's token alone).
"""
from __future__ import annotations

import torch

from engine.generation.scoring import SequenceScores
from engine.generation.vllm.library import vllm_module
from engine.generation.vllm.process import preserved_global_rng


def scoring_problem(sequences: list[list[int]], top_k: int, max_logprobs: int,
                    max_model_len: int) -> str | None:
    """Why the engine cannot score `sequences` with `top_k`, or None: top_k over the engine's
    max_logprobs (vLLM's cap on log-probs per position; -1: none), or a sequence of
    max_model_len tokens or more (vLLM generates one token after the prompt)."""
    if max_logprobs != -1 and top_k > max_logprobs:
        return (f"top_k={top_k} is over this vLLM engine's max_logprobs={max_logprobs} (vLLM's "
                "cap on the log-probs it returns per position); ask for at most "
                f"{max_logprobs}, or build the engine with a larger max_logprobs (-1: none)")
    for i, seq in enumerate(sequences):
        if len(seq) >= max_model_len:
            return (f"sequence {i} has {len(seq)} tokens; vLLM scores sequences shorter than "
                    f"rollout.vllm.max_model_len={max_model_len}: raise it or shorten the "
                    "sequence")
    return None


def prompt_scores(ids: list[int], prompt_logprobs, top_k: int) -> SequenceScores:
    """SequenceScores of `ids` from vLLM's `prompt_logprobs` of that prompt (entry 0 None, entry
    i a {token id: Logprob} dict with ids[i] and the top_k most likely ids, module docstring)."""
    if len(prompt_logprobs) != len(ids) or prompt_logprobs[0] is not None:
        raise RuntimeError(f"vLLM returned {len(prompt_logprobs)} prompt log-prob rows for a "
                           f"sequence of {len(ids)} tokens")
    logprobs, top = [], []
    for token, row in zip(ids[1:], prompt_logprobs[1:]):
        logprobs.append(float(row[token].logprob))
        # the prompt's token is the extra entry when it is not among the top_k
        best = [(t, lp) for t, lp in row.items() if len(row) == top_k or t != token]
        if len(best) != top_k:
            raise RuntimeError(f"vLLM returned {len(row)} log-probs at a position for "
                               f"top_k={top_k}")
        top.append({t: float(lp.logprob) for t, lp in sorted(best, key=lambda p: p[1].rank)})
    return SequenceScores(logprobs=logprobs, top=top)


def scoring_args(k: int) -> dict:
    """vllm.SamplingParams' keywords of a scoring request: one token generated after the
    sequence (discarded), its prompt log-probs with the k most likely ids (-1: all)."""
    return dict(n=1, max_tokens=1, temperature=1.0, seed=0, prompt_logprobs=k,
                detokenize=False)


def prompt_logprob_outputs(llm, sequences: list[list[int]], k: int, lora_request=None) -> list:
    """vLLM's RequestOutputs of one `generate` call on `llm` (a vllm.LLM built without a
    tokenizer) over the token-id `sequences`, each with max_tokens=1 and prompt_logprobs=k
    (-1: the full vocabulary), the adapter `lora_request` served (None: the base); the global
    RNG states are left as they were."""
    vllm = vllm_module()   # imported by the engine's owner already (library)
    params = vllm.SamplingParams(**scoring_args(k))
    with preserved_global_rng():
        return llm.generate([vllm.TokensPrompt(prompt_token_ids=s) for s in sequences], params,
                            use_tqdm=False, lora_request=lora_request)


def vllm_scores(llm, sequences: list[list[int]], top_k: int, lora_request=None
                ) -> list[SequenceScores]:
    """Contract scores of the checked `sequences` on `llm` (one `prompt_logprob_outputs`
    call with prompt_logprobs=top_k). Refuses (ValueError, before anything is queued) what
    `scoring_problem` names, from the engine's max_logprobs and max_model_len."""
    model_config = llm.llm_engine.vllm_config.model_config
    problem = scoring_problem(sequences, top_k, int(model_config.max_logprobs),
                              int(model_config.max_model_len))
    if problem:
        raise ValueError(problem)
    outputs = prompt_logprob_outputs(llm, sequences, top_k, lora_request)
    return [prompt_scores(s, out.prompt_logprobs, top_k)
            for s, out in zip(sequences, outputs, strict=True)]


def logprob_table(rows, vocab_size: int) -> torch.Tensor:
    """Float32 [len(rows), vocab_size] from full-vocabulary prompt log-prob rows
    ({token id: Logprob} each; ids not in a row get -inf)."""
    table = torch.full((len(rows), vocab_size), float("-inf"))
    for i, row in enumerate(rows):
        table[i, torch.tensor(list(row))] = torch.tensor([lp.logprob for lp in row.values()])
    return table
