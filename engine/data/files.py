"""Reading training data files row by row, with errors that say where.

Accepted `data.*_files` entries (resolve_data_files):
- a file: ``.jsonl`` (one JSON object per line), ``.parquet``, ``.arrow`` (Arrow IPC stream or
  file, as written by ``datasets``);
- a glob (``data/shard-*.parquet``, ``data/**/*.jsonl``): its matches, sorted;
- a directory: a folder written by ``datasets.Dataset.save_to_disk`` (``state.json`` +
  ``data-*.arrow``, read in the order state.json lists), or else every supported file below it,
  sorted by path.

Every row comes back with its file and its 1-based line (JSON lines) or row (Parquet, Arrow)
number, so any later error about a row can name the exact place to fix: ``"data/train.jsonl:3"``.
Rows are also readable in independent units (row_units / read_unit) so worker processes can
each read their own part of the input.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Iterator, Sequence

SUPPORTED_EXTENSIONS = (".jsonl", ".parquet", ".arrow")
_GLOB_CHARS = set("*?[")


class DataError(ValueError):
    """A problem with the training data. When it comes from a row, the message starts with
    ``"<file>:<line>: "`` (1-based line for JSON lines, 1-based row for Parquet and Arrow)."""


def as_file_list(files: str | Sequence[str]) -> list[str]:
    """`files` as a list of paths; a single string is one file (not a sequence of characters)."""
    if isinstance(files, (str, os.PathLike)):
        return [os.fspath(files)]
    return [os.fspath(f) for f in files]


def where(file: str, line: int) -> str:
    """The location string used in every row-level error message: ``"file:line"``."""
    return f"{file}:{line}"


# ----------------------------------------------------------------------------- resolving

def _ext(path: str) -> str:
    return os.path.splitext(path)[1].lower()


def _saved_dataset_files(folder: str) -> list[str] | None:
    """The Arrow files of a ``datasets`` save_to_disk folder in their order, or None when
    `folder` is not one. Raises DataError for a DatasetDict folder (naming its splits)."""
    if os.path.isfile(os.path.join(folder, "dataset_dict.json")):
        try:
            with open(os.path.join(folder, "dataset_dict.json"), encoding="utf-8") as f:
                splits = json.load(f).get("splits", [])
        except (OSError, ValueError):
            splits = []
        raise DataError(f"{folder}: a datasets DatasetDict folder (splits: "
                        f"{', '.join(splits) or 'unknown'}); give one split's folder, e.g. "
                        f"{os.path.join(folder, splits[0] if splits else 'train')}")
    state = os.path.join(folder, "state.json")
    if not os.path.isfile(state):
        return None
    try:
        with open(state, encoding="utf-8") as f:
            names = [d["filename"] for d in json.load(f)["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{state}: cannot read the datasets save_to_disk state ({e})") from None
    return [os.path.join(folder, n) for n in names]


def _files_of(spec: str) -> list[str]:
    if os.path.isdir(spec):
        saved = _saved_dataset_files(spec)
        if saved is not None:
            return saved
        found = sorted(os.path.join(root, n) for root, _, names in os.walk(spec)
                       for n in names if _ext(n) in SUPPORTED_EXTENSIONS)
        if not found:
            raise DataError(f"{spec}: directory holds no data files (supported: "
                            f"{', '.join(SUPPORTED_EXTENSIONS)})")
        return found
    return [spec]


def resolve_data_files(files: str | Sequence[str]) -> list[str]:
    """Every data file named by `files` (files, globs, directories; see the module docstring),
    in order. Raises DataError for an empty list, a glob without match, a missing file, or an
    unsupported extension (listing the supported ones)."""
    specs = as_file_list(files)
    if not specs:
        raise DataError("no data files given")
    out: list[str] = []
    for spec in specs:
        if _GLOB_CHARS & set(spec) and not os.path.exists(spec):
            matches = sorted(glob.glob(spec, recursive=True))
            if not matches:
                raise DataError(f"{spec}: no file matches this pattern")
            for m in matches:
                out += _files_of(m) if os.path.isdir(m) else [m]
        else:
            out += _files_of(spec)
    for path in out:
        ext = _ext(path)
        if ext not in SUPPORTED_EXTENSIONS:
            raise DataError(f"{path}: unsupported data file extension {ext!r}; supported: "
                            f"{', '.join(SUPPORTED_EXTENSIONS)}")
        if not os.path.isfile(path):
            raise DataError(f"{path}: data file not found")
    return out


def data_spec_problem(spec: str) -> str | None:
    """What is wrong with one `data.*_files` entry (None when it resolves to data files); the
    text of resolve_data_files' DataError without raising."""
    try:
        resolve_data_files([spec])
    except DataError as e:
        return str(e)
    return None


def file_fingerprint(paths: Sequence[str]) -> list[list]:
    """[absolute path, size, mtime_ns] of every file: a change of any of them is a new input."""
    out = []
    for p in paths:
        st = os.stat(p)
        out.append([os.path.abspath(p), st.st_size, st.st_mtime_ns])
    return out


# ----------------------------------------------------------------------------- units

@dataclass(frozen=True)
class RowUnit:
    """A contiguous part of one file: JSON lines bytes [start, stop) whose first line has number
    `first` (1-based), or Parquet/Arrow rows [start, stop) (0-based; numbered start + 1 ...).
    `rows`: the (estimated, for JSON lines) number of rows, for progress bars."""

    path: str
    start: int
    stop: int
    first: int
    rows: int


def row_units(paths: Sequence[str], rows_per_unit: int = 2000) -> list[RowUnit]:
    """Split every file into units of about `rows_per_unit` rows, in file and row order."""
    units: list[RowUnit] = []
    for path in paths:
        if _ext(path) == ".jsonl":
            units += _jsonl_units(path, rows_per_unit)
        elif _ext(path) == ".parquet":
            units += _parquet_units(path, rows_per_unit)
        else:
            n = _table_rows(path)
            units += [RowUnit(path, a, min(a + rows_per_unit, n), a + 1, min(rows_per_unit, n - a))
                      for a in range(0, n, rows_per_unit)]
    return units


def _jsonl_units(path: str, rows_per_unit: int) -> list[RowUnit]:
    """Byte ranges ending at line ends, each holding `rows_per_unit` lines (the last fewer)."""
    units, start, line, pos, count, last = [], 0, 1, 0, 0, b"\n"
    with open(path, "rb") as f:
        while True:
            block = f.read(1 << 24)
            if not block:
                break
            last = block[-1:]
            i = 0
            while True:
                j = block.find(b"\n", i)
                if j < 0:
                    break
                count += 1
                i = j + 1
                if count == rows_per_unit:
                    end = pos + i
                    units.append(RowUnit(path, start, end, line, count))
                    start, line, count = end, line + count, 0
            pos += len(block)
    if pos > start:
        units.append(RowUnit(path, start, pos, line, count + (last != b"\n")))
    return units


def _parquet_units(path: str, rows_per_unit: int) -> list[RowUnit]:
    """Whole row groups per unit (a row group is decoded as a whole, so a unit never starts
    inside one), adding groups until a unit has rows_per_unit rows."""
    meta = _parquet_file(path).metadata
    units, start, row = [], 0, 0
    for g in range(meta.num_row_groups):
        row += meta.row_group(g).num_rows
        if row - start >= rows_per_unit or g == meta.num_row_groups - 1:
            if row > start:
                units.append(RowUnit(path, start, row, start + 1, row - start))
            start = row
    return units


def _parquet_file(path: str):
    import pyarrow.parquet as pq  # pyarrow loads only for .parquet data

    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a corrupt or non-parquet file
        raise DataError(f"{path}: cannot read as Parquet ({e})") from None


def _open_arrow(path: str):
    import pyarrow as pa  # pyarrow loads only for .arrow data

    source = pa.memory_map(path)
    try:
        return pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid:
        return pa.ipc.open_file(source).read_all()


def _table_rows(path: str) -> int:
    if _ext(path) == ".parquet":
        return _parquet_file(path).metadata.num_rows
    try:
        return _open_arrow(path).num_rows
    except Exception as e:  # noqa: BLE001 - any pyarrow failure: not an Arrow file
        raise DataError(f"{path}: cannot read as Arrow ({e})") from None


def read_unit(unit: RowUnit) -> Iterator[tuple[str, int, dict]]:
    """Yield ``(file, line_or_row_number, row)`` for every row of `unit` (see read_rows)."""
    if _ext(unit.path) == ".jsonl":
        yield from _read_jsonl(unit)
        return
    if _ext(unit.path) == ".parquet":
        pf = _parquet_file(unit.path)
        groups, row0 = [], 0
        for g in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if row0 < unit.stop and row0 + n > unit.start:
                groups.append(g)
            row0 += n
        row_no = 0
        for g in range(groups[0] if groups else 0):
            row_no += pf.metadata.row_group(g).num_rows
        batches = pf.iter_batches(batch_size=1024, row_groups=groups) if groups else []
    else:
        table = _open_arrow(unit.path).slice(unit.start, unit.stop - unit.start)
        row_no, batches = unit.start, table.to_batches(max_chunksize=1024)
    for batch in batches:
        for row in batch.to_pylist():
            row_no += 1
            if row_no > unit.stop:
                return
            if row_no > unit.start:
                yield unit.path, row_no, row


def _read_jsonl(unit: RowUnit) -> Iterator[tuple[str, int, dict]]:
    path, line_no = unit.path, unit.first - 1
    with open(path, "rb") as f:
        f.seek(unit.start)
        pos = unit.start
        while pos < unit.stop:
            raw = f.readline()
            if not raw:
                break
            pos += len(raw)
            line_no += 1
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where(path, line_no)}: not valid UTF-8 ({e.reason} at byte "
                                f"{e.start})") from None
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


def read_rows(files: str | Sequence[str]) -> Iterator[tuple[str, int, dict]]:
    """Yield ``(file, line_or_row_number, row)`` for every row of every file, in order.

    `.jsonl`: one JSON object per line; blank lines are skipped but still counted, so the number
    is the line an editor shows. `.parquet` / `.arrow`: one row per table row, numbered from 1.
    `files` may hold globs and directories (resolve_data_files). Raises DataError for a missing
    file, an unsupported extension (listing the supported ones), a line that is not valid JSON,
    or a row that is not a JSON object (``file:line`` named).
    """
    for path in resolve_data_files(files):
        if _ext(path) == ".jsonl":
            yield from _read_jsonl(RowUnit(path, 0, os.path.getsize(path), 1, 0))
        else:
            n = _table_rows(path)
            yield from read_unit(RowUnit(path, 0, n, 1, n))
