"""Preference data (DPO, reward models): pairs of samples that share a prompt.

Rows: TRL's preference formats (engine.data.preference_rows); rendering and the refusals:
engine.data.preference_render. A pair's sides are Samples as SFT makes them
(engine.data.datasets: ``tokens = ids[:-1]``, ``labels = ids[1:]``, ``loss_mask =
trained[1:]``); loss_mask = 1 exactly on the side's completion: its assistant message(s) as SFT
trains them. Rendered once per input into the per-node cache (engine.data.cache, kind
"preference"), read memory-mapped by every rank. No row is ever dropped: a row is kept, cut on
the right (counted), or refused with a DataError naming its file and line.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from engine.data import cache
from engine.data.datasets import Sample, SFTDataset
from engine.data.files import DataError, RowUnit, read_unit
from engine.data.files import where as where_of
from engine.data.preference_render import fit_pair, render_preference_row
from engine.data.preference_rows import FORM_NAMES
from engine.data.sequence_cache import build_sequences, open_sequences

__all__ = ["PreferencePair", "PreferenceDataset", "load_preference_dataset"]

PREFERENCE_VERSION = 2   # bump when a preference row renders differently (part of the cache key)
STATS = ("rows", "pairs", "truncated", "truncated_chosen", "truncated_rejected", "with_margin",
         *FORM_NAMES)


@dataclass
class PreferencePair:
    """One preference row: two Samples on the same prompt, and the row's margin (TRL
    RewardTrainer's optional per-row number; None when the row has none)."""

    chosen: Sample
    rejected: Sample
    margin: float | None


class PreferenceDataset:
    """Rendered preference pairs in flat (memory-mapped) arrays (load_preference_dataset).

    ``len(ds)``: pairs; ``ds[i]``: a PreferencePair. numpy int64 arrays of length len(ds), so any
    rank can plan a global batch without building Samples: ``chosen_lengths`` /
    ``rejected_lengths`` (Sample lengths L = rendered ids - 1), ``chosen_loss_tokens`` /
    ``rejected_loss_tokens`` (trained label positions), ``prompt_lengths`` (tokens before the
    first completion token, the same on both sides). ``margins``: float64, NaN where a row has
    no margin. ``stats``: rows, pairs (equal: nothing is dropped), truncated (pairs with a side
    cut), truncated_chosen, truncated_rejected, with_margin, and the rows of each format
    (explicit, implicit, text). ``cache_path``: the cache entry the arrays are mapped from.
    """

    def __init__(self, sequences: SFTDataset, prompt_lengths: np.ndarray, margins: np.ndarray,
                 stats: dict[str, int], seq_length: int, truncation: str,
                 cache_path: str | None = None):
        if len(sequences) != 2 * len(margins):
            raise ValueError(f"{len(sequences)} sequences for {len(margins)} pairs")
        self._sequences = sequences     # sequence 2i: pair i's chosen side, 2i + 1: rejected
        self.chosen_lengths = np.asarray(sequences.lengths[0::2], dtype=np.int64)
        self.rejected_lengths = np.asarray(sequences.lengths[1::2], dtype=np.int64)
        self.chosen_loss_tokens = np.asarray(sequences.loss_tokens[0::2], dtype=np.int64)
        self.rejected_loss_tokens = np.asarray(sequences.loss_tokens[1::2], dtype=np.int64)
        self.prompt_lengths, self.margins = prompt_lengths, margins
        self.stats, self.seq_length, self.truncation = stats, seq_length, truncation
        self.cache_path = cache_path

    def __len__(self) -> int:
        return len(self.margins)

    def __getitem__(self, i: int) -> PreferencePair:
        if not -len(self) <= i < len(self):
            raise IndexError(f"pair index {i} out of range for {len(self)} pairs")
        i = i % len(self)
        margin = float(self.margins[i])
        return PreferencePair(self._sequences[2 * i], self._sequences[2 * i + 1],
                              None if math.isnan(margin) else margin)

    def describe(self, limit: str | None = None) -> str:
        """One line for the run log: pairs, rows per format, truncated sides, margins. `limit`
        names the side length the sides were fitted to (default "train.seq_length=<seq_length>
        tokens"; a reward model, which reads one id more, names its own)."""
        s = self.stats
        forms = ", ".join(f"{name} {s[name]}" for name in FORM_NAMES)
        limit = limit or f"train.seq_length={self.seq_length} tokens"
        return (f"{len(self)} preference pairs from {s['rows']} rows ({forms}); truncated: "
                f"{s['truncated']} pairs (chosen {s['truncated_chosen']}, rejected "
                f"{s['truncated_rejected']}; sides longer than {limit} cut on the "
                f"{self.truncation}, prompts kept); with margin: {s['with_margin']}; dropped: 0")


def _preference_unit(k: int, unit: RowUnit, tmp: str, seq_length: int, truncation: str,
                     dtype: str) -> dict:
    """Worker: render the rows of `unit` into ``part-<k>.ids`` / ``.trained`` of `tmp` (the
    chosen then the rejected side of each row). Returns per-side lengths (rendered ids) and
    trained label counts, prompt lengths, margins, stats, and the first DataError's text (the
    unit stops there)."""
    tokenizer = cache.worker_tokenizer()
    stats = dict.fromkeys(STATS, 0)
    lengths, losses, prompts, margins = [], [], [], []
    error, done = None, 0
    prefix = os.path.join(tmp, f"part-{k:07d}")
    with open(prefix + ".ids", "wb") as fi, open(prefix + ".trained", "wb") as ft:
        try:
            for path, line, row in read_unit(unit):
                loc = where_of(path, line)
                done += 1
                if done % 64 == 0:
                    cache.tick(64)
                pair = fit_pair(render_preference_row(row, tokenizer, loc), seq_length,
                                truncation, loc)
                for side in (pair.chosen, pair.rejected):
                    fi.write(np.asarray(side.ids, dtype=dtype).tobytes())
                    ft.write(np.ascontiguousarray(side.trained, dtype=np.uint8).tobytes())
                    lengths.append(len(side.ids))
                    losses.append(int(side.trained[1:].sum()))
                prompts.append(pair.prompt_length)
                margins.append(math.nan if pair.margin is None else pair.margin)
                _count(stats, pair)
        except DataError as e:
            error = str(e)
    cache.tick(done % 64)
    return {"stats": stats, "lengths": np.asarray(lengths, dtype=np.int64),
            "losses": np.asarray(losses, dtype=np.int64),
            "prompts": np.asarray(prompts, dtype=np.int64),
            "margins": np.asarray(margins, dtype=np.float64), "error": error,
            "parts": (prefix + ".ids", prefix + ".trained")}


def _count(stats: dict[str, int], pair) -> None:
    stats["rows"] += 1
    stats["pairs"] += 1
    stats[pair.form] += 1
    stats["with_margin"] += pair.margin is not None
    stats["truncated_chosen"] += pair.chosen.truncated
    stats["truncated_rejected"] += pair.rejected.truncated
    stats["truncated"] += pair.chosen.truncated or pair.rejected.truncated


def _build(tmp: str, paths: list[str], tokenizer, seq_length: int, truncation: str,
           num_workers: int | None, key: dict) -> None:
    build_sequences(tmp, paths, tokenizer, seq_length, truncation, num_workers, key,
                    _preference_unit, "preference", STATS,
                    {"prompt_lengths": ("prompts", np.int64), "margins": ("margins", np.float64)},
                    meta=lambda stats: {"num_pairs": stats["pairs"]})


def load_preference_dataset(files: str | Sequence[str], tokenizer, seq_length: int,
                            truncation: str = "right", cache_dir: str | None = None,
                            num_workers: int | None = None) -> PreferenceDataset:
    """Every row of `files` rendered (once per input, shared by all ranks) into pairs.

    `files`: files, globs, directories and datasets save_to_disk folders, as SFT data
    (engine.data.files.resolve_data_files). Each side may have at most seq_length + 1 rendered
    ids (a Sample of at most seq_length tokens); longer sides: truncation="right" cuts them on
    the right, keeping the prompt (stats truncated*); "error" raises DataError with file:line.
    A prompt longer than seq_length is always refused. `cache_dir` (default
    engine.data.cache.default_cache_dir()) and `num_workers` (default: the usable cores; 0: in
    this process) as load_sft_dataset. Raises DataError for any refused row (the first in file
    order) and when the files hold no row.
    """
    entry, stats, sequences = open_sequences(
        "preference", PREFERENCE_VERSION, files, tokenizer, seq_length, truncation, cache_dir,
        lambda tmp, paths, length, key: _build(tmp, paths, tokenizer, length, truncation,
                                               num_workers, key),
        "pairs", "no preference pairs")
    seq_length = int(seq_length)
    return PreferenceDataset(sequences, cache.open_array(entry, "prompt_lengths.npy", np.int64),
                             cache.open_array(entry, "margins.npy", np.float64), stats,
                             seq_length, truncation, cache_path=entry)
