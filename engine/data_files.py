"""Reading training data files row by row (JSON lines and Parquet), with errors that say where.

Every row comes back with its file and its 1-based line (JSON lines) or row (Parquet) number,
so any later error about a row can name the exact place to fix: ``"data/train.jsonl:3"``.
"""
from __future__ import annotations

import json
import os
from typing import Iterator, Sequence

SUPPORTED_EXTENSIONS = (".jsonl", ".parquet")


class DataError(ValueError):
    """A problem with the training data. When it comes from a row, the message starts with
    ``"<file>:<line>: "`` (1-based line for JSON lines, 1-based row for Parquet)."""


def as_file_list(files: str | Sequence[str]) -> list[str]:
    """`files` as a list of paths; a single string is one file (not a sequence of characters)."""
    if isinstance(files, (str, os.PathLike)):
        return [os.fspath(files)]
    return [os.fspath(f) for f in files]


def where(file: str, line: int) -> str:
    """The location string used in every row-level error message: ``"file:line"``."""
    return f"{file}:{line}"


def read_rows(files: str | Sequence[str]) -> Iterator[tuple[str, int, dict]]:
    """Yield ``(file, line_or_row_number, row)`` for every row of every file, in order.

    `.jsonl`: one JSON object per line; blank lines are skipped but still counted, so the number
    is the line an editor shows. `.parquet`: one row per table row, numbered from 1.
    Raises DataError for a missing file, an unsupported extension (listing the supported ones),
    a line that is not valid JSON, or a row that is not a JSON object (``file:line`` named).
    """
    paths = as_file_list(files)
    if not paths:
        raise DataError("no data files given")
    for path in paths:
        ext = os.path.splitext(path)[1].lower()
        if ext not in SUPPORTED_EXTENSIONS:
            raise DataError(f"{path}: unsupported data file extension {ext!r}; supported: "
                            f"{', '.join(SUPPORTED_EXTENSIONS)}")
        if not os.path.isfile(path):
            raise DataError(f"{path}: data file not found")
        if ext == ".jsonl":
            yield from _read_jsonl(path)
        else:
            yield from _read_parquet(path)


def _read_jsonl(path: str) -> Iterator[tuple[str, int, dict]]:
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                raise DataError(f"{where(path, line_no)}: invalid JSON ({e.msg} at column "
                                f"{e.colno}); each line must hold one complete JSON object"
                                ) from None
            if not isinstance(row, dict):
                raise DataError(f"{where(path, line_no)}: expected a JSON object, got "
                                f"{type(row).__name__}")
            yield path, line_no, row


def _read_parquet(path: str) -> Iterator[tuple[str, int, dict]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a corrupt or non-parquet file
        raise DataError(f"{path}: cannot read as Parquet ({e})") from None
    row_no = 0
    for batch in pf.iter_batches():
        for row in batch.to_pylist():
            row_no += 1
            yield path, row_no, row
