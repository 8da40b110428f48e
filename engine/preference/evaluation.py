"""Evaluation over more items than one global batch, in chunks (DPO's and the reward model's
held-out pairs): every chunk's loss function reports its SHARE of the whole set's means (its
sums divided by the whole set's counts), so the chunks' reports simply add up, whatever their
sizes; the same numbers as one pass over the whole set."""
from __future__ import annotations

from typing import Callable, Sequence


def evaluate_in_chunks(items: Sequence, chunk: int, keys: Sequence[str],
                       run_chunk: Callable[[int, Sequence], dict]) -> dict[str, float]:
    """{key: sum over the chunks of run_chunk(offset, items[offset:offset + chunk])[key]}, the
    chunks taken in order; `run_chunk` reports shares of the whole set's means (module
    docstring)."""
    totals = dict.fromkeys(keys, 0.0)
    for i in range(0, len(items), chunk):
        out = run_chunk(i, items[i:i + chunk])
        for k in keys:
            totals[k] += out[k]
    return totals
