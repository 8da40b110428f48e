"""Unpaired preference data (KTO) loaded into the per-node cache (engine.data.cache, kind
"unpaired"): one Sample per row, as SFT makes it (``tokens = ids[:-1]``, ``labels = ids[1:]``,
``loss_mask = trained[1:]``, 1 exactly on the completion's trained tokens), its prompt length
and its boolean label. Rows: engine.data.preference_unpaired. No row is ever dropped: a row
is kept, cut on the right (counted), or refused with a DataError naming its file and line.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from engine.data import cache
from engine.data.datasets import Sample, SFTDataset
from engine.data.files import DataError, RowUnit, read_unit
from engine.data.files import where as where_of
from engine.data.preference_unpaired import UNPAIRED_FORMS, fit_example, render_unpaired_row
from engine.data.sequence_cache import build_sequences, open_sequences

__all__ = ["UnpairedExample", "UnpairedDataset", "load_unpaired_dataset"]

UNPAIRED_VERSION = 1   # bump when an unpaired row renders differently (part of the cache key)
STATS = ("rows", "desirable", "undesirable", "truncated", *UNPAIRED_FORMS)


@dataclass
class UnpairedExample:
    """One unpaired row: its Sample, its prompt length (rendered ids before the first
    completion token; the Sample's first trained label is at position prompt_length - 1) and
    its label (True: desirable)."""

    sample: Sample
    prompt_length: int
    label: bool


class UnpairedDataset:
    """Rendered unpaired examples in flat (memory-mapped) arrays. ``len(ds)``: examples;
    ``ds[i]``: an UnpairedExample; ``lengths``, ``loss_tokens``, ``prompt_lengths``,
    ``labels`` (0/1): numpy int64 arrays; ``stats``: rows, desirable, undesirable, truncated
    and the rows of each format."""

    def __init__(self, sequences: SFTDataset, prompt_lengths: np.ndarray, labels: np.ndarray,
                 stats: dict[str, int], seq_length: int, truncation: str):
        self._sequences = sequences
        self.lengths, self.loss_tokens = sequences.lengths, sequences.loss_tokens
        self.prompt_lengths, self.labels = prompt_lengths, labels
        self.stats, self.seq_length, self.truncation = stats, seq_length, truncation

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> UnpairedExample:
        if not -len(self) <= i < len(self):
            raise IndexError(f"example index {i} out of range for {len(self)} examples")
        i = i % len(self)
        return UnpairedExample(self._sequences[i], int(self.prompt_lengths[i]),
                               bool(self.labels[i]))

    def describe(self) -> str:
        s = self.stats
        forms = ", ".join(f"{name} {s[name]}" for name in UNPAIRED_FORMS)
        return (f"{len(self)} unpaired examples ({s['desirable']} desirable, "
                f"{s['undesirable']} undesirable; {forms}); truncated: {s['truncated']} "
                f"(longer than train.seq_length={self.seq_length} tokens, cut on the "
                f"{self.truncation}, prompts kept); dropped: 0")


def _unpaired_unit(k: int, unit: RowUnit, tmp: str, seq_length: int, truncation: str,
                   dtype: str) -> dict:
    """Worker: render the rows of `unit` into ``part-<k>.ids`` / ``.trained`` of `tmp`;
    returns lengths (rendered ids), trained label counts, prompt lengths, labels, stats and
    the first DataError's text (the unit stops there)."""
    tokenizer = cache.worker_tokenizer()
    stats = dict.fromkeys(STATS, 0)
    cols = {"lengths": [], "losses": [], "prompts": [], "labels": []}
    error, done = None, 0
    prefix = os.path.join(tmp, f"part-{k:07d}")
    with open(prefix + ".ids", "wb") as fi, open(prefix + ".trained", "wb") as ft:
        try:
            for path, line, row in read_unit(unit):
                loc = where_of(path, line)
                done += 1
                if done % 64 == 0:
                    cache.tick(64)
                ex = fit_example(render_unpaired_row(row, tokenizer, loc), seq_length,
                                 truncation, loc)
                fi.write(np.asarray(ex.side.ids, dtype=dtype).tobytes())
                ft.write(np.ascontiguousarray(ex.side.trained, dtype=np.uint8).tobytes())
                for name, value in (("lengths", len(ex.side.ids)),
                                    ("losses", int(ex.side.trained[1:].sum())),
                                    ("prompts", ex.prompt_length), ("labels", int(ex.label))):
                    cols[name].append(value)
                stats["rows"] += 1
                stats["desirable" if ex.label else "undesirable"] += 1
                stats["truncated"] += ex.side.truncated
                stats[ex.form] += 1
        except DataError as e:
            error = str(e)
    cache.tick(done % 64)
    return {"stats": stats, "error": error, "parts": (prefix + ".ids", prefix + ".trained"),
            **{name: np.asarray(v, dtype=np.int64) for name, v in cols.items()}}


def _build(tmp: str, paths: list[str], tokenizer, seq_length: int, truncation: str,
           num_workers: int | None, key: dict) -> None:
    build_sequences(tmp, paths, tokenizer, seq_length, truncation, num_workers, key,
                    _unpaired_unit, "unpaired", STATS,
                    {"prompt_lengths": ("prompts", np.int64), "labels": ("labels", np.int64)})


def load_unpaired_dataset(files: str | Sequence[str], tokenizer, seq_length: int,
                          truncation: str = "right", cache_dir: str | None = None,
                          num_workers: int | None = None) -> UnpairedDataset:
    """Every row of `files` (as SFT data: files, globs, directories, save_to_disk folders)
    rendered once per input into the cache, shared by all ranks. Each example may have at
    most seq_length + 1 rendered ids (engine.data.preference_unpaired.fit_example). Raises
    DataError for any refused row (the first in file order) and when the files hold none."""
    entry, stats, sequences = open_sequences(
        "unpaired", UNPAIRED_VERSION, files, tokenizer, seq_length, truncation, cache_dir,
        lambda tmp, paths, length, key: _build(tmp, paths, tokenizer, length, truncation,
                                               num_workers, key),
        "rows", "no unpaired examples")
    seq_length = int(seq_length)
    return UnpairedDataset(sequences, cache.open_array(entry, "prompt_lengths.npy", np.int64),
                           cache.open_array(entry, "labels.npy", np.int64), stats, seq_length,
                           truncation)
