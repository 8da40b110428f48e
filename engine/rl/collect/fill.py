"""rollout/engine_fill: the mean share of busy sequence slots per decode step of a step's
generation, from what the engines report (each response's length).

A generate call of B rows on the hf backend decodes max_i n_i steps (n_i: row i's response
tokens in that call, its end-of-sequence token included) and row i is busy in n_i of them, so
the call's busy slots are sum_i n_i out of B x max_i n_i. The calls of a generation batch are
the pool's split over the engines (engine.generation.work_split.split_groups, recomputed here
from the same inputs); a step's fill sums busy and total slots over all its calls.

vLLM batches continuously (freed slots are refilled), so its calls are measured by the engine
instead where it can: a call with per-row fields (the rounds of partial rollouts) runs step by
step and reports (busy, total) slot-steps, busy = requests that got a token in a step, total =
min(B, max_num_seqs) x the engine steps it ran (engine.generation.vllm.rounds;
GenerateStats.fill, used by engine.rl.collect.partial). A plain vLLM rollout's calls run
LLM.generate, unmeasured: they get this module's formula, which equals the measure when the
B rows fit in max_num_seqs and their prefills in the first step.
"""
from __future__ import annotations

from engine.generation.work_split import split_groups


def fill_counts(prompt_lengths: list[int], response_lengths: list[int], n: int,
                max_new_tokens: int, num_engines: int) -> tuple[int, int]:
    """(busy slots, total slots) of one generation batch: `prompt_lengths` and
    `response_lengths` per row (group-major, groups of `n`, as RolloutPool.generate got them
    with `max_new_tokens`), over `num_engines` engines."""
    busy = total = 0
    for share in split_groups(prompt_lengths, n, max_new_tokens, num_engines):
        if share:
            lengths = [int(response_lengths[i]) for i in share]
            busy += sum(lengths)
            total += len(share) * max(lengths)
    return busy, total


def engine_fill(counts: list[tuple[int, int]]) -> float:
    """Busy over total slots of several generation batches' `fill_counts` (1.0 when nothing was
    decoded)."""
    busy, total = sum(c[0] for c in counts), sum(c[1] for c in counts)
    return busy / total if total else 1.0
