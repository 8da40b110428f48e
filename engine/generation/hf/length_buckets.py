"""Shape buckets and length groups of the HF backend's static decode (engine.generation
.hf.static_decode): pure arithmetic on row counts and prompt lengths, no torch.

A compiled decode step is specialised to one (batch, cache length) shape, so both are rounded
up to a few sizes and every generate call of an RL run reuses the same few graphs:
- cache length (`cache_bucket`): at most 64 rounds to 64; above, to a multiple of a quarter of
  the power of two below it (65 -> 80, 266 -> 320, 1000 -> 1024): at most 25 % of the static
  cache is beyond the longest row, four sizes per doubling;
- batch (`batch_bucket`): at most 8 rows round to the next power of two; above, the same
  quarter-octave rounding (96 -> 96, 100 -> 112, 129 -> 160); the extra rows are filler;
- compaction (`compact_size`): once at most a quarter of a batch's rows are still decoding, the
  batch shrinks to the power of two holding them (at least MIN_COMPACT), so a run of finished
  rows stops costing compute, and a batch of 128 meets at most 3 shapes (128, 32, 8): every
  new shape is one more compilation (and CUDA graph), seconds each.

Length groups (`length_groups`): rows sorted by prompt length (stable), cut into consecutive
groups where a row's required cache length (prompt + max_new_tokens) would exceed `max_ratio`
times that of the group's shortest row; each group is prefilled and decoded on its own, left-
padded only to its own longest prompt. With RL's usual max_new_tokens >> prompt-length spread
there is one group (one decode loop, the fewest steps); mixed short and long prompts split so
left padding does not dominate.
"""
from __future__ import annotations

MAX_RATIO = 1.5
SMALL_CACHE = 64
SMALL_BATCH = 8
COMPACT_FACTOR = 4   # compact once running rows <= batch / COMPACT_FACTOR
MIN_COMPACT = 8      # never compact to fewer rows (a decode step of 8 rows costs ~ one of 1)


def _quarter_octave(n: int) -> int:
    """n rounded up to a multiple of 2**(floor(log2 n) - 2) (n >= 8)."""
    step = 1 << max(0, n.bit_length() - 3)
    return -(-n // step) * step


def cache_bucket(n: int) -> int:
    """The static cache length for rows that need `n` >= 1 positions (module docstring)."""
    if n < 1:
        raise ValueError(f"cache length {n} must be >= 1")
    return SMALL_CACHE if n <= SMALL_CACHE else _quarter_octave(n)


def batch_bucket(n: int) -> int:
    """The compiled batch size for `n` >= 1 rows (module docstring)."""
    if n < 1:
        raise ValueError(f"batch {n} must be >= 1")
    return 1 << (n - 1).bit_length() if n <= SMALL_BATCH else _quarter_octave(n)


def compact_size(active: int, batch: int) -> int | None:
    """The batch to compact to when `active` of `batch` rows still decode: the power of two
    holding them, at least MIN_COMPACT, once active <= batch / COMPACT_FACTOR and that is
    smaller than `batch`; else None (keep the batch)."""
    if active < 1 or COMPACT_FACTOR * active > batch:
        return None
    size = max(MIN_COMPACT, 1 << (active - 1).bit_length())
    return size if size < batch else None


def length_groups(lengths: list[int], max_new_tokens: int,
                  max_ratio: float = MAX_RATIO) -> list[list[int]]:
    """Row indices of `lengths` (prompt lengths) in groups (module docstring): each group
    sorted by length, shortest first, and every row in exactly one group."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for i in order:
        need = lengths[i] + max_new_tokens
        if groups and need <= max_ratio * (lengths[groups[-1][0]] + max_new_tokens):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups
