"""Scoring given token sequences on a rollout engine (RolloutEngine.score): the log-probability
of every token after the first, and the most likely next tokens at each position, as the
OpenAI-style `echo` + `logprobs` of a completions server and lm-evaluation-harness
log-likelihood requests need them.

Contract (every backend): for a sequence `ids` of n >= 1 token ids, with
`logp_i = log_softmax(logits_i)` computed in float32 from the model's RAW next-token logits after
`ids[:i]` (temperature 1, no top-k/top-p filtering: vLLM's `raw_logprobs`; a bf16 model's
logits are upcast to float32 before the log_softmax), `SequenceScores.logprobs[i - 1] =
logp_i[ids[i]]` for i in 1..n-1, and `SequenceScores.top[i - 1]` holds the `top_k` largest
entries of `logp_i` as {token id: log-prob}, most likely first (empty dicts when top_k is 0).
A sequence's scores do not depend on the other sequences of the call.

This module also holds the transformers implementation (`hf_scores`, used by
engine.generation.hf.backend); vLLM's is engine.generation.vllm.scoring.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

# float32 elements of one chunk's [rows, longest, vocab] log-probs (1 GiB): `hf_scores` splits
# the batch so that a chunk stays under it (a single sequence over it runs alone)
MAX_CHUNK_ELEMENTS = 2 ** 28


@dataclass
class SequenceScores:
    """The scores of one sequence of n token ids (module contract).

    logprobs: n - 1 floats, entry i - 1 = log P(ids[i] | ids[:i]).
    top: n - 1 dicts, entry i - 1 = the top_k most likely next ids after ids[:i] -> their
        log-probs, exactly top_k entries ordered most likely first ({} when top_k is 0).
    """

    logprobs: list[float]
    top: list[dict[int, float]]


def check_sequences(sequences, top_k: int, vocab_size: int | None) -> list[list[int]]:
    """`sequences` as lists of Python ints, after refusing (ValueError naming the parameter and
    the sequence's position) an empty sequence, a non-integer id, an id outside
    [0, vocab_size) (when the vocabulary size is known), and a top_k that is not an integer in
    [0, vocab_size]."""
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0, got {top_k!r}")
    if vocab_size is not None and top_k > vocab_size:
        raise ValueError(f"top_k={top_k} is more than the vocabulary ({vocab_size} tokens)")
    checked = []
    for i, seq in enumerate(sequences):
        if len(seq) == 0:
            raise ValueError(f"sequence {i} is empty; every sequence needs at least one token")
        odd = [t for t in seq if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
        if odd:
            raise ValueError(f"sequence {i} has non-integer token ids: {odd[:5]}")
        bad = [int(t) for t in seq
               if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            raise ValueError(f"sequence {i} has token ids outside [0, {vocab_size}): {bad[:5]}")
        checked.append([int(t) for t in seq])
    return checked


def chunks(lengths: list[int], vocab_size: int, max_elements: int) -> list[list[int]]:
    """Positions of `lengths` grouped into batches, shortest sequences first, each batch's
    rows x longest x vocab_size <= max_elements (a sequence over it alone)."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda j: lengths[j]):
        if groups and (len(groups[-1]) + 1) * lengths[i] * vocab_size <= max_elements:
            groups[-1].append(i)   # sorted: this sequence is the chunk's longest
        else:
            groups.append([i])
    return groups


def row_scores(logp: torch.Tensor, targets: torch.Tensor, top_k: int) -> SequenceScores:
    """SequenceScores from float32 log-probs `logp` [n - 1, V] (row i - 1: after ids[:i]) and
    `targets` = ids[1:] [n - 1]."""
    chosen = logp.gather(-1, targets[:, None])[:, 0].cpu().tolist()
    if top_k == 0:
        return SequenceScores(logprobs=chosen, top=[{} for _ in chosen])
    values, ids = logp.topk(top_k, dim=-1)   # sorted, largest first
    top = [dict(zip(i, v)) for i, v in zip(ids.cpu().tolist(), values.cpu().tolist())]
    return SequenceScores(logprobs=chosen, top=top)


@torch.no_grad()
def hf_scores(model, sequences: list[list[int]], top_k: int, device: torch.device,
              pad_token_id: int = 0, max_elements: int = MAX_CHUNK_ELEMENTS
              ) -> list[SequenceScores]:
    """Module contract for a transformers causal LM `model` on `device`: no-grad forwards over
    the checked `sequences`, right-padded with `pad_token_id` and an attention mask (causal
    attention: a real token never sees the padding after it; positions count from 0 in every
    row), in chunks of at most `max_elements` float32 log-probs (`chunks`). Returns one
    SequenceScores per sequence, in order."""
    vocab = int(model.config.get_text_config().vocab_size)
    result: list[SequenceScores | None] = [None] * len(sequences)
    for group in chunks([len(s) for s in sequences], vocab, max_elements):
        longest = max(len(sequences[i]) for i in group)
        ids = torch.full((len(group), longest), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(group), longest), dtype=torch.long)
        for row, i in enumerate(group):
            ids[row, :len(sequences[i])] = torch.tensor(sequences[i], dtype=torch.long)
            mask[row, :len(sequences[i])] = 1
        ids, mask = ids.to(device), mask.to(device)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), dim=-1)   # [rows, longest - 1, V] float32
        del logits
        for row, i in enumerate(group):
            n = len(sequences[i]) - 1
            result[i] = row_scores(logp[row, :n], ids[row, 1:n + 1], top_k)
    return result
