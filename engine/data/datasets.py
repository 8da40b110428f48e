"""Training samples: rendering rows with the chat template, SFT datasets, the global-batch order.

Conventions:
- A row renders to ``ids`` (the full token sequence) and ``trained`` (1 where ids[t] is a token
  the model learns to produce: assistant turns, or response + eos); see engine.data.render.
- A rendered row of n ids becomes a Sample of length L = n - 1 by the next-token shift:
  ``tokens = ids[:-1]``, ``labels = ids[1:]``, ``loss_mask = trained[1:]``. Later stages
  (batching, CP sharding) never shift again.
- Rendering runs once per input, in worker processes, into the memory-mapped cache of
  engine.data.cache; every rank maps the same files (one copy per node in the page cache).
- The order of samples in optimizer step k depends only on (dataset size, global batch size,
  k, seed, shuffle), never on the parallel layout; see global_batch_indices.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from engine.data import cache
from engine.data.files import (DataError, RowUnit, read_rows, read_unit, resolve_data_files,
                               where as where_of)
from engine.data.render import (render_messages, render_prompt,
                                render_row_arrays, render_sft_row)
from engine.data.image_store import (ImagePartWriter, StoredImages, check_image_tokens,
                                     write_image_store)
from engine.data.images import ImageContext, render_with_images
from engine.data.prompt_rows import load_prompt_rows
from models.vision.inputs import SequenceVision

__all__ = ["DataError", "Sample", "SFTDataset", "read_rows", "render_sft_row", "render_messages",
           "render_prompt", "load_sft_dataset", "global_batch_indices", "load_prompt_rows",
           "TRUNCATION_CHOICES"]

TRUNCATION_CHOICES = ("right", "error")


@dataclass
class Sample:
    """One training sequence after the next-token shift; all three lists have length L."""

    tokens: list[int]     # model input ids
    labels: list[int]     # labels[t] = rendered_ids[t + 1]
    loss_mask: list[int]  # 1 where labels[t] is a trained token
    vision: SequenceVision | None = None   # images of a row with images (models.vision)

    def __post_init__(self) -> None:
        if not len(self.tokens) == len(self.labels) == len(self.loss_mask):
            raise ValueError(f"Sample lists differ in length: tokens {len(self.tokens)}, "
                             f"labels {len(self.labels)}, loss_mask {len(self.loss_mask)}")

    @property
    def num_loss_tokens(self) -> int:
        """Number of trained label positions (sum of loss_mask)."""
        return int(sum(self.loss_mask))


# ----------------------------------------------------------------------------- SFT dataset

class SFTDataset:
    """Rendered, shifted SFT samples held in flat (memory-mapped) arrays (load_sft_dataset).

    ``lengths[i]`` (sample length L) and ``loss_tokens[i]`` (trained positions) are numpy int64
    arrays, so any rank can get the shape and counts of a whole global batch without building
    Samples. ``stats``: rows read, truncated, dropped_empty (rendered to fewer than 2 ids, no
    sample possible) and empty_loss (kept, but no trained token). ``seq_length`` and
    ``truncation``: the limits it was loaded with (None when not given), named by describe().
    ``cache_path``: the cache entry the arrays are mapped from (None when built in memory).
    """

    def __init__(self, ids: np.ndarray, trained: np.ndarray, offsets: np.ndarray,
                 stats: dict[str, int], seq_length: int | None = None,
                 truncation: str | None = None, lengths: np.ndarray | None = None,
                 loss_tokens: np.ndarray | None = None, cache_path: str | None = None):
        self._ids = ids
        self._trained = trained
        self._offsets = offsets
        self.stats = stats
        self.seq_length, self.truncation = seq_length, truncation
        self.cache_path = cache_path
        if lengths is None:
            lengths = (np.diff(offsets) - 1).astype(np.int64)
        if loss_tokens is None:
            cum = np.concatenate([[0], np.cumsum(trained, dtype=np.int64)])
            starts = offsets[:-1] + 1  # the first rendered id never is a label
            loss_tokens = cum[offsets[1:]] - cum[starts]
        self.lengths, self.loss_tokens = lengths, loss_tokens
        self.images: StoredImages | None = None   # set by load_sft_dataset for image rows

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def describe(self) -> str:
        """One line for the run log with every count of `stats`: samples kept, rows truncated
        (with the limit and data.truncation), dropped, and kept without a trained token."""
        s = self.stats
        limit = (f"longer than train.seq_length={self.seq_length} tokens, cut on the "
                 f"{self.truncation}" if self.seq_length else "cut to the length limit")
        return (f"{len(self)} samples from {s['rows']} rows; truncated: {s['truncated']} "
                f"({limit}); dropped: {s['dropped_empty']} (under 2 tokens); "
                f"no trained token: {s['empty_loss']} (kept)")

    def __getitem__(self, i: int) -> Sample:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample index {i} out of range for {len(self)} samples")
        i = i % len(self)
        a, b = int(self._offsets[i]), int(self._offsets[i + 1])
        ids = self._ids[a:b].tolist()
        vision = None if self.images is None else self.images.sequence(i, ids[:-1])
        return Sample(tokens=ids[:-1], labels=ids[1:],
                      loss_mask=self._trained[a + 1:b].astype(np.int64).tolist(), vision=vision)


_STATS = ("rows", "truncated", "dropped_empty", "empty_loss")


def _sft_unit(k: int, unit: RowUnit, tmp: str, max_ids: int, truncation: str,
              dtype: str, ctx: ImageContext | None = None) -> dict:
    """Worker: render the rows of `unit` into part files ``part-<k>.ids`` / ``.trained`` of
    `tmp` (and their images into ``.images`` / ``.grids``, engine.data.image_store, when
    `ctx`). Returns lengths (rendered ids per kept row), trained label counts, stats, the
    longest rendering, and the first DataError's text (the unit stops there)."""
    tokenizer = cache.worker_tokenizer()
    images = ImagePartWriter(os.path.join(tmp, f"part-{k:07d}")) if ctx else None
    stats = dict.fromkeys(_STATS, 0)
    lengths: list[int] = []
    losses: list[int] = []
    longest, error, done = 0, None, 0
    prefix = os.path.join(tmp, f"part-{k:07d}")
    with open(prefix + ".ids", "wb") as fi, open(prefix + ".trained", "wb") as ft:
        try:
            for path, line, row in read_unit(unit):
                loc = where_of(path, line)
                stats["rows"] += 1
                done += 1
                if done % 64 == 0:
                    cache.tick(64)
                ids, trained, row_images = render_with_images(
                    row, tokenizer, ctx, loc, os.path.dirname(os.path.abspath(path)))
                longest = max(longest, len(ids))
                check_image_tokens(ids, max_ids, row_images, ctx, loc)
                if len(ids) > max_ids:
                    if truncation == "error":
                        raise DataError(
                            f"{loc}: rendered row has {len(ids)} tokens, more than "
                            f"train.seq_length + 1 = {max_ids} (data.truncation=error); raise "
                            f"train.seq_length, shorten the row, or set data.truncation=right "
                            f"to cut long rows")
                    ids, trained = ids[:max_ids], trained[:max_ids]
                    stats["truncated"] += 1
                if len(ids) < 2:
                    stats["dropped_empty"] += 1
                    continue
                n_loss = int(trained[1:].sum())
                if n_loss == 0:
                    stats["empty_loss"] += 1
                fi.write(np.asarray(ids, dtype=dtype).tobytes())
                ft.write(np.ascontiguousarray(trained, dtype=np.uint8).tobytes())
                if images is not None:
                    images.add(row_images)
                lengths.append(len(ids))
                losses.append(n_loss)
        except DataError as e:
            error = str(e)
    cache.tick(done % 64)
    if images is not None:
        images.close()
    return {"stats": stats, "lengths": np.asarray(lengths, dtype=np.int64),
            "images": images.counts() if images is not None else None,
            "losses": np.asarray(losses, dtype=np.int64), "longest": longest, "error": error,
            "parts": (prefix + ".ids", prefix + ".trained")}


def _build_sft(tmp: str, paths: list[str], tokenizer, max_ids: int, truncation: str,
               num_workers: int | None, key: dict, ctx: ImageContext | None = None) -> None:
    dtype = cache.token_dtype(len(tokenizer))
    units = cache.units_for(paths)
    t0 = time.perf_counter()
    results = cache.run_units(units, _sft_unit, (tmp, max_ids, truncation, dtype.name, ctx),
                              tokenizer, num_workers, "rendering SFT rows")
    stats = dict.fromkeys(_STATS, 0)
    longest = 0
    for r in results:  # the first error in file order, as a sequential pass would raise it
        for name in _STATS:
            stats[name] += r["stats"][name]
        longest = max(longest, r["longest"])
        if r["error"] is not None:
            raise DataError(r["error"])
    cache.concat_parts(tmp, [r["parts"][0] for r in results], "ids.bin")
    cache.concat_parts(tmp, [r["parts"][1] for r in results], "trained.bin")
    if ctx is not None:
        write_image_store(tmp, [r["parts"][0][:-len(".ids")] for r in results],
                          [r["images"] for r in results], ctx.processor)
    lengths = np.concatenate([r["lengths"] for r in results] or [np.zeros(0, np.int64)])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    np.save(os.path.join(tmp, "offsets.npy"), offsets)
    np.save(os.path.join(tmp, "lengths.npy"), lengths - 1)
    np.save(os.path.join(tmp, "loss_tokens.npy"),
            np.concatenate([r["losses"] for r in results] or [np.zeros(0, np.int64)]))
    seconds = time.perf_counter() - t0
    cache.write_meta(tmp, {"key": key, "dtype": dtype.name, "stats": stats, "longest": longest,
                           "num_samples": int(len(lengths)), "num_ids": int(offsets[-1]),
                           "build_seconds": seconds})
    cache.log(f"rendered {stats['rows']} rows ({int(offsets[-1])} ids) in {seconds:.1f} s "
              f"({stats['rows'] / max(seconds, 1e-9):.0f} rows/s) into {os.path.dirname(tmp)}")


def load_sft_dataset(files: str | Sequence[str], tokenizer, seq_length: int,
                     truncation: str = "right", *, cache_dir: str | None = None,
                     num_workers: int | None = None,
                     images: ImageContext | None = None) -> SFTDataset:
    """Every row of `files` rendered (once per input, shared by all ranks) into an SFTDataset.

    `files`: files, globs and directories (engine.data.files.resolve_data_files).
    A rendered row may have at most seq_length + 1 ids (a Sample of at most seq_length tokens).
    Longer rows: truncation="right" keeps the first seq_length + 1 ids (stats["truncated"]);
    truncation="error" raises DataError with file:line and both lengths. Rows that end up with
    no trained token are kept and counted in stats["empty_loss"]. Raises DataError (naming the
    files and what to change) when no sample is left, or no sample has a trained token.
    Messages name the config keys train.seq_length and data.truncation.

    `cache_dir` (default engine.data.cache.default_cache_dir()): where the rendered arrays are
    kept; the first process to need them builds them with `num_workers` worker processes
    (default: the usable cores; 0: in this process), every other process waits and maps them.
    `images` (engine.data.images.image_context; a model with a vision tower): rows may hold
    images, stored once in the cache beside the ids (engine.data.image_store; the processor
    runs on them when a batch is built); a row
    whose truncation would cut an image raises DataError. None: rows with images are refused.
    """
    if truncation not in TRUNCATION_CHOICES:
        raise ValueError(f"truncation={truncation!r} is not one of {', '.join(TRUNCATION_CHOICES)}")
    if int(seq_length) < 1:
        raise ValueError(f"seq_length must be >= 1, got {seq_length}")
    paths = resolve_data_files(files)
    max_ids = int(seq_length) + 1
    params = {"seq_length": int(seq_length), "truncation": truncation}
    if images is not None:
        params["images"] = images.fingerprint()
    key = cache.cache_key("sft", paths, tokenizer, params)
    entry = cache.ensure_entry(cache_dir or cache.default_cache_dir(), key, lambda tmp: _build_sft(
        tmp, paths, tokenizer, max_ids, truncation, num_workers, key, images))
    meta = cache.read_meta(entry)
    stats = {k: int(v) for k, v in meta["stats"].items()}
    _check_not_empty(paths, stats, int(seq_length), int(meta["longest"]))
    dtype = np.dtype(meta["dtype"])
    dataset = SFTDataset(cache.open_array(entry, "ids.bin", dtype),
                      cache.open_array(entry, "trained.bin", np.uint8),
                      cache.open_array(entry, "offsets.npy", np.int64), stats,
                      seq_length=int(seq_length), truncation=truncation,
                      lengths=cache.open_array(entry, "lengths.npy", np.int64),
                      loss_tokens=cache.open_array(entry, "loss_tokens.npy", np.int64),
                      cache_path=entry)
    if images is not None:
        dataset.images = StoredImages.open(entry, images.spec)
    return dataset


def _check_not_empty(paths: list[str], stats: dict[str, int], seq_length: int,
                     longest: int) -> None:
    """Raise DataError when load_sft_dataset kept no sample, or no sample with a trained
    token (a run that would train nothing), saying why and what to change. `longest`: the
    most ids a row rendered to."""
    files = ", ".join(paths)
    kept = stats["rows"] - stats["dropped_empty"]
    if stats["rows"] == 0:
        raise DataError(f"no training samples in {files}: the files hold no rows")
    if kept == 0:
        raise DataError(f"no training samples in {files}: all {stats['rows']} rows were "
                        "dropped (they render to fewer than 2 tokens)")
    if stats["empty_loss"] == kept:
        cause = (f"{stats['truncated']} rows were cut to train.seq_length={seq_length} tokens "
                 f"(the longest needs {longest - 1}); raise train.seq_length"
                 if stats["truncated"] else "rows need an assistant message or a response")
        raise DataError(f"no training samples with a trained token in {files}: none of the "
                        f"{kept} samples has an assistant/response token left; {cause}")


def global_batch_indices(num_samples: int, global_batch_size: int, step: int, seed: int,
                         shuffle: bool) -> list[int]:
    """Dataset indices of optimizer step `step` (0-based), in order.

    The index stream is epoch 0, epoch 1, ... concatenated; epoch e is
    ``np.random.default_rng([seed, e]).permutation(num_samples)`` (``range(num_samples)`` when
    shuffle is False). Step k takes stream[k * gbs : (k + 1) * gbs], so a batch may span an epoch
    boundary, and resuming at step k needs nothing but k.
    """
    if num_samples < 1 or global_batch_size < 1 or step < 0 or seed < 0:
        raise ValueError(f"need num_samples >= 1, global_batch_size >= 1, step >= 0, seed >= 0; "
                         f"got {num_samples}, {global_batch_size}, {step}, {seed}")
    start, stop = step * global_batch_size, (step + 1) * global_batch_size
    out: list[int] = []
    for epoch in range(start // num_samples, (stop - 1) // num_samples + 1):
        order = (np.random.default_rng([seed, epoch]).permutation(num_samples) if shuffle
                 else np.arange(num_samples))
        lo = max(start - epoch * num_samples, 0)
        hi = min(stop - epoch * num_samples, num_samples)
        out.extend(int(x) for x in order[lo:hi])
    return out
