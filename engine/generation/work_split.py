"""What each rollout engine generates: the split of one generation batch over the engines, and
the per-response sampling seeds that make the result independent of that split.

A generation batch is group-major: responses [g*n, (g+1)*n) answer prompt g. Groups stay whole
on one engine (an engine's prefix cache then serves all n samples of a prompt). Groups are
assigned longest-expected-work first to the least loaded engine (ties: the lower engine index),
a deterministic function of the prompt lengths only. Expected work of a group:
n * (prompt tokens + max_new_tokens), the tokens its KV cache will hold.
"""
from __future__ import annotations

import hashlib


def response_seed(seed: int, gen_batch: int, prompt_index: int, sample_index: int) -> int:
    """The sampling seed of one response: a function of (run seed, generation batch, prompt
    position in the batch, sample index) only, never of the engine count or of which other
    prompts share a generate call. A non-negative 63-bit integer."""
    key = f"{seed}/{gen_batch}/{prompt_index}/{sample_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def batch_seeds(seed: int, gen_batch: int, num_prompts: int, n: int) -> list[int]:
    """response_seed for every response of a group-major generation batch."""
    return [response_seed(seed, gen_batch, g, j) for g in range(num_prompts) for j in range(n)]


def split_groups(prompt_lengths: list[int], n: int, max_new_tokens: int,
                 num_engines: int) -> list[list[int]]:
    """Response indices per engine (each list ascending), for a group-major batch of
    len(prompt_lengths) == number of responses; every index appears exactly once."""
    if len(prompt_lengths) % n:
        raise ValueError(f"{len(prompt_lengths)} responses are not whole groups of {n}")
    groups = len(prompt_lengths) // n
    work = [n * (prompt_lengths[g * n] + max_new_tokens) for g in range(groups)]
    load = [0] * num_engines
    assigned: list[list[int]] = [[] for _ in range(num_engines)]
    for g in sorted(range(groups), key=lambda g: (-work[g], g)):
        e = min(range(num_engines), key=lambda e: (load[e], e))
        load[e] += work[g]
        assigned[e].extend(range(g * n, (g + 1) * n))
    return [sorted(a) for a in assigned]
