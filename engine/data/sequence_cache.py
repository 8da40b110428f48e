"""The cache of rendered sequences that preference pairs (engine.data.preference) and unpaired
examples (engine.data.preference_unpaired_dataset) share: rows rendered once per input by
parallel units (engine.data.cache.run_units) into ids.bin / trained.bin with offsets, lengths
and loss-token counts, plus the kind's own per-sequence columns; opened as an SFTDataset.

A unit function returns {"stats": {name: int}, "error": str | None, "parts": (ids file,
trained file), "lengths", "losses", and the kind's columns}; the first error in file order is
raised, as a sequential pass would raise it.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Sequence

import numpy as np

from engine.data import cache
from engine.data.datasets import TRUNCATION_CHOICES, SFTDataset
from engine.data.files import DataError, resolve_data_files


def column(results: list[dict], name: str, dtype) -> np.ndarray:
    """The units' `name` arrays, concatenated in file order."""
    return np.concatenate([r[name] for r in results] or [np.zeros(0, dtype)]).astype(dtype)


def build_sequences(tmp: str, paths: list[str], tokenizer, seq_length: int, truncation: str,
                    num_workers: int | None, key: dict, unit_fn: Callable, what: str,
                    stat_names: Sequence[str], columns: dict[str, tuple[str, type]],
                    meta: Callable[[dict], dict] = lambda stats: {}) -> None:
    """Render `paths` with `unit_fn` into `tmp` (module docstring); `columns`: file stem ->
    (the units' array name, dtype), saved as <stem>.npy; `meta(stats)`: extra meta keys;
    `what`: the rows' name in the progress and log lines."""
    dtype = cache.token_dtype(len(tokenizer))
    t0 = time.perf_counter()
    results = cache.run_units(cache.units_for(paths), unit_fn,
                              (tmp, seq_length, truncation, dtype.name), tokenizer, num_workers,
                              f"rendering {what} rows")
    stats = dict.fromkeys(stat_names, 0)
    for r in results:  # the first error in file order, as a sequential pass would raise it
        for name in stat_names:
            stats[name] += r["stats"][name]
        if r["error"] is not None:
            raise DataError(r["error"])
    cache.concat_parts(tmp, [r["parts"][0] for r in results], "ids.bin")
    cache.concat_parts(tmp, [r["parts"][1] for r in results], "trained.bin")
    lengths = column(results, "lengths", np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    np.save(os.path.join(tmp, "offsets.npy"), offsets)
    np.save(os.path.join(tmp, "lengths.npy"), lengths - 1)
    np.save(os.path.join(tmp, "loss_tokens.npy"), column(results, "losses", np.int64))
    for stem, (name, col_dtype) in columns.items():
        np.save(os.path.join(tmp, f"{stem}.npy"), column(results, name, col_dtype))
    seconds = time.perf_counter() - t0
    cache.write_meta(tmp, {"key": key, "dtype": dtype.name, "stats": stats, **meta(stats),
                           "num_ids": int(offsets[-1]), "build_seconds": seconds})
    cache.log(f"rendered {stats['rows']} {what} rows ({int(offsets[-1])} ids) in "
              f"{seconds:.1f} s into {os.path.dirname(tmp)}")


def open_sequences(kind: str, version: int, files, tokenizer, seq_length: int, truncation: str,
                   cache_dir: str | None, build: Callable, count: str, nothing: str
                   ) -> tuple[str, dict[str, int], SFTDataset]:
    """(cache entry, stats, the sequences) of `files` rendered once into the cache (key: `kind`,
    the files, the tokenizer, seq_length, truncation, `version`) by `build(tmp, paths,
    seq_length, key)`. ValueError for a bad truncation or seq_length; DataError `nothing`
    naming the files when stats[`count`] is 0."""
    if truncation not in TRUNCATION_CHOICES:
        raise ValueError(f"truncation={truncation!r} is not one of {', '.join(TRUNCATION_CHOICES)}")
    if int(seq_length) < 1:
        raise ValueError(f"seq_length must be >= 1, got {seq_length}")
    seq_length = int(seq_length)
    paths = resolve_data_files(files)
    params = {"seq_length": seq_length, "truncation": truncation, "version": version}
    key = cache.cache_key(kind, paths, tokenizer, params)
    entry = cache.ensure_entry(cache_dir or cache.default_cache_dir(), key,
                               lambda tmp: build(tmp, paths, seq_length, key))
    meta = cache.read_meta(entry)
    stats = {k: int(v) for k, v in meta["stats"].items()}
    if stats[count] == 0:
        raise DataError(f"{nothing} in {', '.join(paths)}: the files hold no rows")
    sequences = SFTDataset(cache.open_array(entry, "ids.bin", np.dtype(meta["dtype"])),
                           cache.open_array(entry, "trained.bin", np.uint8),
                           cache.open_array(entry, "offsets.npy", np.int64), {},
                           lengths=cache.open_array(entry, "lengths.npy", np.int64),
                           loss_tokens=cache.open_array(entry, "loss_tokens.npy", np.int64),
                           cache_path=entry)
    return entry, stats, sequences
