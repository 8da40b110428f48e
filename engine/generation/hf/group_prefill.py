"""The eager loop's prefill (engine.generation.hf.backend) with each distinct prompt run once:
a GRPO batch repeats every prompt rollout.n times, and a left-padded forward of the whole batch
computes each prompt's keys and values n times over (on the CPU the prefill was two thirds of
a 2 x 8-reply, 32-token generate call of a ~350-token prompt; docs/rollout-backends.md).

`shared_prefill` runs engine.generation.hf.prefill.prefill (one forward per batch of distinct
prompts of one length, no padding, at most PREFILL_TOKENS tokens each) and assembles the
batch's left-padded cache from it: row i's prompt keys/values at the columns
[longest - len(prompt_i), longest) of a transformers DynamicCache, zeros on its left padding
(masked by the loop's attention mask: they enter the attention as exact zeros), and row i's
first-step logits its prompt's last-position logits. The decode steps that follow are the
loop's own, unchanged (the same mask, positions and sampler). A row's values are those of its
prompt's own forward (bitwise those of a one-row forward for repeated prompts), where the
left-padded batch forward's differed from them by rounding only; its tokens are the same
unless a draw falls within that rounding of a boundary (tests/test_hf_rollout.py).

`shared_prefill_problem` says which engines keep the batch forward: a vision tower (image
prompts and M-RoPE positions), routed-expert recording (R3 records the prefill's gates per
row), rows with different weights (`rows_differ`: the same prompt is not the same forward)
and layers other than full attention (a sliding-window or linear-attention layer keeps
other state than whole key/value rows).
"""
from __future__ import annotations

import torch
from transformers import DynamicCache

from engine.generation.hf.prefill import prefill
from engine.generation.hf.static_decode import static_problem


def shared_prefill_problem(engine) -> str | None:
    """Why `engine` (an HFRolloutEngine) prefills with one batch forward instead, or None."""
    if engine.vision is not None:
        return "a vision tower (image prompts and M-RoPE positions)"
    if engine._routing is not None:
        return "routed experts are recorded per row (R3)"
    if engine.rows_differ:
        return "rows run different weights (per-row LoRA adapters)"
    return static_problem(engine.model)


def shared_prefill(model, keyword: str, prompts: list[list[int]], longest: int,
                   device: torch.device) -> tuple[torch.Tensor, DynamicCache]:
    """(fp32 logits [B, V] of every row's last prompt position, the batch's left-padded
    DynamicCache of `longest` columns) for `prompts` (module docstring). Runs under the
    caller's torch.no_grad()."""
    done = prefill(model, keyword, prompts, device)
    batch = len(prompts)
    logits = torch.empty((batch, done[0].logits.shape[-1]), dtype=torch.float32,
                         device=device)
    cache = DynamicCache(config=model.config)
    first = done[0].cache.layers
    for layer, source in enumerate(first):
        shape = (batch, *source.keys.shape[1:2], longest, source.keys.shape[-1])
        keys = torch.zeros(shape, dtype=source.keys.dtype, device=device)
        values = torch.zeros(shape[:-1] + (source.values.shape[-1],),
                             dtype=source.values.dtype, device=device)
        for one in done:
            rows = torch.tensor(one.rows, dtype=torch.long, device=device)
            own = one.cache.layers[layer]
            n = own.keys.shape[-2]
            keys[rows, :, longest - n:] = own.keys[one.index]
            values[rows, :, longest - n:] = own.values[one.index]
        cache.update(keys, values, layer)
    for one in done:
        logits[one.rows] = one.logits
    return logits, cache
