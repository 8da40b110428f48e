"""Prefill of the requests joining the hf step driver (engine.generation.hf.stepper) in one
step: as few model forwards as their prompts allow, each row's values those of its own
one-row forward up to rounding.

- Rows with the same prompt (a group's rollout.n replies) share ONE forward of it: its
  last-position logits and its cache serve each of them (the slot cache's `place` copies from
  the cache and leaves it as it is, so one cache fills several slots). A row's logits are then
  bitwise those of its own one-row forward, and its first token (drawn with its own uniform
  u(seed, step)) exactly the one it drew alone.
- Distinct prompts of the same length go through one forward of [B, L] (at most
  PREFILL_TOKENS tokens), without padding: every row's causal mask and positions 0 .. L - 1
  are those of its one-row forward, so its values differ from that forward's only by
  rounding (the matmuls' blocking over B x L rows; the decode step's batching already differs
  so, engine.generation.hf.static_decode's tolerance). Prompts of different lengths are never
  padded into one forward.
- A forward that raises (`prefill_apart`): each distinct prompt again alone, so only the rows
  of a prompt that fails in its own forward fail.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# tokens one prefill forward takes at most (rows x prompt length): bounds its activations
# (B x L x intermediate) on a large model; the rows of a step beyond it take more forwards
PREFILL_TOKENS = 4096


@dataclass
class Prefilled:
    """One distinct prompt's prefill.

    Attributes:
        rows: the joiners it serves (indices into `prefill`'s prompts), in order.
        logits: fp32 [V], the prompt's last position.
        cache: the forward's transformers cache (DynamicCache; keys [B, heads, L, head_dim]).
        index: the prompt's row in `cache` (and in the forward's batch).
    """

    rows: list[int]
    logits: torch.Tensor
    cache: object
    index: int


def length_batches(prompts: list[tuple[int, ...]], limit: int) -> list[list[tuple[int, ...]]]:
    """`prompts` (distinct) grouped by length, in order of first appearance, each group cut
    into batches of at most max(1, limit // length) prompts."""
    by_length: dict[int, list[tuple[int, ...]]] = {}
    for prompt in prompts:
        by_length.setdefault(len(prompt), []).append(prompt)
    batches = []
    for length, group in by_length.items():
        size = max(1, limit // length)
        batches += [group[i:i + size] for i in range(0, len(group), size)]
    return batches


def prefill(model, keyword: str, prompts: list[list[int]],
            device: torch.device) -> list[Prefilled]:
    """The prefill of `prompts` (token ids, one per joining row): one Prefilled per distinct
    prompt (module docstring), from one forward per batch of length_batches(.., PREFILL_TOKENS).
    `keyword`: the name of the cache in the model's output (backend.cache_keyword). Runs under
    the caller's torch.no_grad()."""
    rows: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        rows.setdefault(tuple(prompt), []).append(i)
    out = []
    for batch in length_batches(list(rows), PREFILL_TOKENS):
        ids = torch.tensor(batch, dtype=torch.long, device=device)
        result = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        logits = result.logits[:, -1, :].float()
        cache = getattr(result, keyword)
        out += [Prefilled(rows[p], logits[j], cache, j) for j, p in enumerate(batch)]
    return out


def prefill_apart(model, keyword: str, prompts: list[list[int]], device: torch.device
                  ) -> tuple[list[Prefilled], dict[int, BaseException]]:
    """`prefill`, and when one of its forwards raises, each distinct prompt's prefill alone:
    (the Prefilled of every prompt whose forward ran, row index -> the exception of each row
    whose prompt failed in a forward of its own). So a prompt that makes the model raise fails
    its own rows only (the step driver answers them alone), at the cost of one forward per
    distinct prompt in that step; a row's values are then those of its one-row forward."""
    try:
        return prefill(model, keyword, prompts, device), {}
    except Exception:  # noqa: BLE001 - which prompt failed is found below, one at a time
        pass
    rows: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        rows.setdefault(tuple(prompt), []).append(i)
    done, failed = [], {}
    for prompt, idx in rows.items():
        try:
            (one,) = prefill(model, keyword, [list(prompt)], device)
        except Exception as e:  # noqa: BLE001 - this prompt's rows fail alone
            failed.update({i: e for i in idx})
            continue
        done.append(Prefilled(idx, one.logits, one.cache, one.index))
    return done, failed
