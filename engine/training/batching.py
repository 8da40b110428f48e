"""Micro-batches, order restoration, packing and padding (docs/design/loss-math.md).

Pure functions, no process groups. The partition over DP ranks lives in `engine.training.partition` and is
re-exported here, so the training loop imports everything batching-related from this module:

    groups = partition_balanced([sequence_work(n) for n in lengths], dp_size)  # same on all ranks
    mine = groups[dp_rank]                                  # global indices, ascending
    mbs = micro_batches_by_token_budget(mine, [lengths[i] for i in mine], max_tokens,
                                        min_count=agreed_count)
    row = pack_sequences([samples[i] for i in mbs[0]], pad_multiple=2 * cp)

Indices are always positions in the global batch.
Agreeing on the micro-batch count across DP (all-reduce max of `len(mbs)` computed with
`min_count=1`, then calling again with `min_count=` that maximum) is the caller's job.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from engine.training.partition import (imbalance, partition_balanced, partition_contiguous,
                              partition_sorted_round_robin, sequence_work)

__all__ = [
    "sequence_work", "partition_balanced", "partition_contiguous",
    "partition_sorted_round_robin", "imbalance", "micro_batches_by_count",
    "micro_batches_by_token_budget", "PackedRow",
    "pack_sequences", "pad_batch", "padding_fraction",
]

Sample = tuple[Sequence[int], Sequence[int], Sequence[float]]  # (tokens, labels, loss_mask)


def micro_batches_by_count(indices: Sequence[int], num_micro_batches: int) -> list[list[int]]:
    """Contiguous near-equal split of `indices` into `num_micro_batches` non-empty lists; the
    first `len(indices) % num_micro_batches` lists get one extra item. Order is kept.

    Raises ValueError if `num_micro_batches < 1` or `> len(indices)` (a micro-batch may never be
    empty).
    """
    n = len(indices)
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
    if num_micro_batches > n:
        raise ValueError(f"cannot split {n} sequences into {num_micro_batches} non-empty "
                         f"micro-batches")
    base, extra = divmod(n, num_micro_batches)
    out, start = [], 0
    for m in range(num_micro_batches):
        size = base + (1 if m < extra else 0)
        out.append(list(indices[start:start + size]))
        start += size
    return out


def _split_bin(bin_: list[int], length_of: dict[int, int]) -> tuple[list[int], list[int]]:
    """Split a bin of >= 2 items into two non-empty halves of near-equal tokens (longest first,
    each to the lighter half; ties by index)."""
    halves: tuple[list[int], list[int]] = ([], [])
    loads = [0, 0]
    for i in sorted(bin_, key=lambda i: (-length_of[i], i)):
        h = 0 if loads[0] <= loads[1] else 1
        halves[h].append(i)
        loads[h] += length_of[i]
    return sorted(halves[0]), sorted(halves[1])


def micro_batches_by_token_budget(indices: Sequence[int], lengths: Sequence[int],
                                  max_tokens: int, min_count: int = 1) -> list[list[int]]:
    """Group `indices` into micro-batches whose total tokens (sum of their lengths, the packed
    row length) is at most `max_tokens`, by first-fit decreasing.

    `lengths[j]` is the length of sequence `indices[j]` (parallel lists; pass padded lengths if
    rows are padded, e.g. to a multiple of 2*cp). A single sequence longer than `max_tokens` cannot
    be split here: it gets a micro-batch of its own (over budget), so no sequence is ever dropped.

    At least `min_count` micro-batches are returned (DP ranks must run the same count): while there
    are fewer, the bin with the most tokens (ties: first) among those with >= 2 items is split in
    two; splitting never breaks the budget. Every micro-batch is non-empty and holds values of
    `indices`, ascending; micro-batches are ordered by creation (the longest sequence's first).
    Deterministic.

    Raises ValueError if the lists differ in length, indices repeat, `max_tokens < 1`,
    `min_count < 0`, or `min_count > len(indices)`.
    """
    if len(lengths) != len(indices):
        raise ValueError(f"lengths ({len(lengths)}) must be parallel to indices ({len(indices)})")
    length_of = dict(zip(indices, lengths))
    if len(length_of) != len(indices):
        raise ValueError("indices must not repeat")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if min_count < 0:
        raise ValueError(f"min_count must be >= 0, got {min_count}")
    if min_count > len(indices):
        raise ValueError(f"min_count={min_count} micro-batches requested but this rank holds only "
                         f"{len(indices)} sequences; a micro-batch may never be empty (use fewer "
                         f"micro-batches or more sequences per DP rank)")
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(indices, key=lambda i: (-length_of[i], i)):
        for b, load in enumerate(loads):
            if load + length_of[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += length_of[i]
                break
        else:
            bins.append([i])
            loads.append(length_of[i])
    bins = [sorted(b) for b in bins]
    while len(bins) < min_count:
        splittable = [b for b in range(len(bins)) if len(bins[b]) >= 2]
        target = max(splittable,
                     key=lambda b: (sum(length_of[i] for i in bins[b]), -b))
        first, second = _split_bin(bins[target], length_of)
        bins[target] = first
        bins.insert(target + 1, second)
    return bins


@dataclass
class PackedRow:
    """Several sequences in one row ("thd" format), back to back; each sequence is followed only
    by its own end padding (up to a multiple of `pad_multiple`).

    tokens, labels: [T] long; loss_mask: [T] float (0 on padding); position_ids: [T] long,
    restarting at 0 for every sequence (continuing through its padding); cu_seqlens: [n+1] int32
    boundaries of the padded sequences (cu_seqlens[-1] == T); seq_lengths: padded length of each
    sequence; num_padding: number of padding tokens in the row.
    """
    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_lengths: list[int]
    num_padding: int


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _check_sample(s: int, sample: Sample) -> int:
    tokens, labels, mask = sample
    if not len(tokens) == len(labels) == len(mask):
        raise ValueError(f"sequence {s}: tokens, labels and loss_mask lengths differ "
                         f"({len(tokens)}, {len(labels)}, {len(mask)})")
    if len(tokens) == 0:
        raise ValueError(f"sequence {s} is empty")
    return len(tokens)


def pack_sequences(seqs: Sequence[Sample], pad_multiple: int = 1, pad_id: int = 0) -> PackedRow:
    """Pack `(tokens, labels, loss_mask)` sequences into one row; each is right-padded to a
    multiple of `pad_multiple` (2*cp for zigzag context parallelism) with token and label
    `pad_id` and loss mask 0."""
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
    if not seqs:
        raise ValueError("pack_sequences needs at least one sequence")
    tokens, labels, mask, positions, seq_lengths = [], [], [], [], []
    num_padding = 0
    for s, sample in enumerate(seqs):
        length = _check_sample(s, sample)
        padded = _round_up(length, pad_multiple)
        pad = padded - length
        tokens += list(sample[0]) + [pad_id] * pad
        labels += list(sample[1]) + [pad_id] * pad
        mask += [float(m) for m in sample[2]] + [0.0] * pad
        positions += range(padded)
        seq_lengths.append(padded)
        num_padding += pad
    cu = [0]
    for length in seq_lengths:
        cu.append(cu[-1] + length)
    return PackedRow(
        tokens=torch.tensor(tokens, dtype=torch.long),
        labels=torch.tensor(labels, dtype=torch.long),
        loss_mask=torch.tensor(mask, dtype=torch.float32),
        position_ids=torch.tensor(positions, dtype=torch.long),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        seq_lengths=seq_lengths,
        num_padding=num_padding,
    )


def pad_batch(seqs: Sequence[Sample], pad_multiple: int = 1, pad_id: int = 0,
              length: int | None = None) -> dict[str, torch.Tensor | int]:
    """Unpacked batch: `tokens`, `labels` [b, S] long, `loss_mask` [b, S] float, `position_ids`
    [b, S] long (0..S-1 on every row), right-padded with `pad_id` / mask 0 to S = the longest
    sequence rounded up to `pad_multiple`, or S = `length` when given (must be >= the longest
    sequence and a multiple of `pad_multiple`). Also `num_padding`: padding tokens, an int."""
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
    if not seqs:
        raise ValueError("pad_batch needs at least one sequence")
    lens = [_check_sample(s, sample) for s, sample in enumerate(seqs)]
    if length is None:
        width = _round_up(max(lens), pad_multiple)
    elif length < max(lens) or length % pad_multiple:
        raise ValueError(f"length={length} must be >= the longest sequence ({max(lens)}) and a "
                         f"multiple of pad_multiple={pad_multiple}")
    else:
        width = length
    b = len(seqs)
    tokens = torch.full((b, width), pad_id, dtype=torch.long)
    labels = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.float32)
    for r, (sample, n) in enumerate(zip(seqs, lens)):
        tokens[r, :n] = torch.as_tensor(list(sample[0]), dtype=torch.long)
        labels[r, :n] = torch.as_tensor(list(sample[1]), dtype=torch.long)
        mask[r, :n] = torch.as_tensor([float(m) for m in sample[2]], dtype=torch.float32)
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": mask,
        "position_ids": torch.arange(width, dtype=torch.long).expand(b, width).contiguous(),
        "num_padding": b * width - sum(lens),
    }


def padding_fraction(num_padding: int, num_tokens_total: int) -> float:
    """Padding tokens over all tokens processed (padding included); 0.0 for an empty batch."""
    if num_tokens_total < 0 or not 0 <= num_padding <= max(num_tokens_total, 0):
        raise ValueError(f"need 0 <= num_padding ({num_padding}) <= num_tokens_total "
                         f"({num_tokens_total})")
    return num_padding / num_tokens_total if num_tokens_total else 0.0
