"""The rendered-data cache: built once per node (or once per job on a shared file system) by
worker processes, read memory-mapped by every rank.

Layout: ``<cache_dir>/<kind>-<key>/`` holding flat arrays (``ids.bin`` in the narrowest
unsigned dtype that holds the vocabulary, ``trained.bin`` uint8, ``offsets.npy`` int64, plus
per-kind extras) and ``meta.json`` (key parts, dtype, stats). `key` hashes everything a rendered
row depends on: the files (absolute path, size, mtime), the tokenizer (its serialized model and
special tokens), the chat template, the kind's parameters (seq_length, truncation),
RENDERER_VERSION and the transformers/tokenizers versions. A changed input is a new key.

Coordination needs no process group: every process takes ``<entry>.lock`` (fcntl.flock); the
first builds into ``<entry>.tmp-*`` (files fsynced), then renames it to ``<entry>`` (atomic),
the others wait on the lock (one log line) and then map the finished entry. A killed build
leaves only a temp folder, never an entry; the next builder deletes it. A DataError during the
build is written to ``<entry>.error`` so the waiting ranks of the same job raise the same error
instead of rebuilding.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from importlib.metadata import version
from typing import Any, Callable, Sequence

import numpy as np
from tqdm import tqdm

from engine.data.files import DataError, RowUnit, file_fingerprint, row_units
from engine.data.render import RENDERER_VERSION, chat_template_text

CACHE_FORMAT = 1
ENV_CACHE_DIR = "MEGATRON_SFT_DATA_CACHE"
IN_PROCESS_ROWS = 2000   # below this many rows, rendering in worker processes costs more
BAR_ROWS = 1000          # builds of fewer rows show no progress bar
ROWS_PER_UNIT = 256      # rows one worker task renders (units are handed out in file order)


def default_cache_dir() -> str:
    """``$MEGATRON_SFT_DATA_CACHE``, else
    ``${XDG_CACHE_HOME:-~/.cache}/megatron_sft_engine/data``."""
    if os.environ.get(ENV_CACHE_DIR):
        return os.environ[ENV_CACHE_DIR]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megatron_sft_engine", "data")


def default_num_workers() -> int:
    """Worker processes for a build: the cores this process may run on (the other ranks of the
    node wait on the lock meanwhile), at most 32."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(cores, 32))


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype holding ids 0 .. vocab_size - 1."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dt).max + 1:
            return np.dtype(dt)
    return np.dtype(np.int64)


def tokenizer_fingerprint(tokenizer) -> dict:
    """What a rendering depends on in the tokenizer: its serialized model, special tokens and
    chat template (hashed), and the library versions that tokenize and render (read from the
    installed packages' metadata: neither library is imported for a cache key)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = (backend.to_str() if backend is not None
             else json.dumps(sorted(tokenizer.get_vocab().items())))
    template = getattr(tokenizer, "chat_template", None)
    return {"class": type(tokenizer).__name__,
            "model": hashlib.sha256(model.encode()).hexdigest(),
            "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
            "vocab_size": len(tokenizer),
            "template": hashlib.sha256(chat_template_text(tokenizer).encode()).hexdigest()
            if template else None,
            "transformers": version("transformers"), "tokenizers": version("tokenizers")}


def cache_key(kind: str, paths: Sequence[str], tokenizer, params: dict) -> dict:
    """Every part of the cache key (see the module docstring)."""
    return {"kind": kind, "format": CACHE_FORMAT, "renderer": RENDERER_VERSION,
            "files": file_fingerprint(paths), "tokenizer": tokenizer_fingerprint(tokenizer),
            "params": params}


def entry_name(key: dict) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return f"{key['kind']}-{digest}"


# ----------------------------------------------------------------------------- logging

def _who() -> str:
    rank, local = os.environ.get("RANK"), os.environ.get("LOCAL_RANK")
    if rank is None:
        return f"pid {os.getpid()}"
    return f"rank {rank}" + (f" (local {local})" if local is not None else "")


def log(message: str) -> None:
    print(f"[data] {_who()}: {message}", file=sys.stderr, flush=True)


def _job_id() -> str | None:
    """Same for the ranks of one torchrun job on one node (None outside a launcher)."""
    if "MASTER_PORT" not in os.environ:
        return None
    return ":".join([os.environ.get("TORCHELASTIC_RUN_ID", ""),
                     os.environ.get("MASTER_ADDR", ""), os.environ["MASTER_PORT"],
                     str(os.getppid())])


# ----------------------------------------------------------------------------- building

def _fsync_tree(folder: str) -> None:
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    _fsync_dir(folder)


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_complete(entry: str) -> bool:
    return os.path.isfile(os.path.join(entry, "meta.json"))


def ensure_entry(cache_dir: str, key: dict, build: Callable[[str], None]) -> str:
    """The path of the finished cache entry for `key`, building it with ``build(tmp_dir)`` when
    absent (see the module docstring for the locking protocol). `build` writes its files into
    tmp_dir, meta.json last; raising DataError makes every waiting rank raise it too."""
    os.makedirs(cache_dir, exist_ok=True)
    name = entry_name(key)
    entry = os.path.join(cache_dir, name)
    if _is_complete(entry):
        return entry
    started = time.time()
    with open(entry + ".lock", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another process to build the data cache {entry}")
            fcntl.flock(lock, fcntl.LOCK_EX)
            log(f"the build finished after {time.time() - started:.1f} s of waiting")
        try:
            if _is_complete(entry):
                return entry
            _raise_recorded_error(entry + ".error", started)
            for stale in os.listdir(cache_dir):  # torn builds of this entry (we hold its lock)
                if stale.startswith(name + ".tmp-"):
                    shutil.rmtree(os.path.join(cache_dir, stale), ignore_errors=True)
            tmp = tempfile.mkdtemp(prefix=name + ".tmp-", dir=cache_dir)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would hide a shared cache
            try:
                build(tmp)
                _fsync_tree(tmp)
                os.rename(tmp, entry)
                _fsync_dir(cache_dir)
            except DataError as e:
                _record_error(entry + ".error", str(e))
                raise
            finally:
                if os.path.isdir(tmp):
                    shutil.rmtree(tmp, ignore_errors=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry + ".error")
            return entry
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _record_error(path: str, message: str) -> None:
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"job": _job_id(), "message": message}, f)
    os.replace(tmp, path)


def _raise_recorded_error(path: str, started: float) -> None:
    """Raise the DataError a builder of this job recorded (written after this process started
    waiting, or by the same torchrun job); an older one is stale and removed."""
    try:
        with open(path, encoding="utf-8") as f:
            recorded = json.load(f)
        mtime = os.stat(path).st_mtime
    except (OSError, ValueError):
        return
    job = _job_id()
    if mtime >= started - 0.01 or (job is not None and recorded.get("job") == job):
        raise DataError(recorded["message"])
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


# ----------------------------------------------------------------------------- worker pool

_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer, counter) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER["tokenizer"], _WORKER["counter"] = tokenizer, counter


def worker_tokenizer():
    """The tokenizer of this worker (or of the in-process build)."""
    return _WORKER["tokenizer"]


def tick(rows: int) -> None:
    """Count `rows` more rows done for the progress bar."""
    counter = _WORKER.get("counter")
    if counter is not None:
        with counter.get_lock():
            counter.value += rows


def run_units(units: list[RowUnit], fn: Callable, args: tuple, tokenizer,
              num_workers: int | None, desc: str) -> list[Any]:
    """``[fn(k, unit, *args) for k, unit in enumerate(units)]``, in worker processes (forked,
    each holding `tokenizer`) or in this process for small inputs / num_workers=0; a tqdm bar
    with rows/s runs while it works. `fn` must be a module-level function."""
    total = sum(u.rows for u in units)
    workers = default_num_workers() if num_workers is None else int(num_workers)
    if num_workers is None and total < IN_PROCESS_ROWS:
        workers = 0
    workers = min(workers, len(units))
    use_fork = workers > 0 and "fork" in mp.get_all_start_methods()
    ctx = mp.get_context("fork" if use_fork else "spawn")
    counter = ctx.Value("q", 0)
    bar = _progress(total, desc, workers) if total >= BAR_ROWS else None
    try:
        if workers == 0:
            saved = dict(_WORKER)
            _init_worker(tokenizer, counter)
            try:
                results = []
                for k, u in enumerate(units):
                    results.append(fn(k, u, *args))
                    _advance(bar, counter)
                return results
            finally:
                _WORKER.clear()
                _WORKER.update(saved)
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker,
                                 initargs=(tokenizer, counter)) as pool:
            futures = [pool.submit(fn, k, u, *args) for k, u in enumerate(units)]
            pending = set(futures)
            while pending:
                _, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                _advance(bar, counter)
            return [f.result() for f in futures]
    finally:
        if bar is not None:
            bar.close()


def _progress(total: int, desc: str, workers: int):
    return tqdm(total=total, desc=f"{desc} ({workers or 'no'} workers)", unit="rows",
                file=sys.stderr, mininterval=1.0, dynamic_ncols=True)


def _advance(bar, counter) -> None:
    if bar is not None:
        bar.update(counter.value - bar.n)


def open_array(entry: str, name: str, dtype, mmap: bool = True) -> np.ndarray:
    """A flat array file of the entry, memory-mapped read-only (a zero-length file: empty)."""
    path = os.path.join(entry, name)
    if name.endswith(".npy"):
        return np.load(path, mmap_mode="r" if mmap else None)
    if os.path.getsize(path) == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def concat_parts(tmp: str, parts: list[str], out_name: str) -> None:
    """Append the part files (in order) into one file `out_name`, deleting the parts."""
    with open(os.path.join(tmp, out_name), "wb") as out:
        for p in parts:
            with open(p, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 24)
            os.unlink(p)


def write_meta(tmp: str, meta: dict) -> None:
    with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1, sort_keys=True)


def read_meta(entry: str) -> dict:
    with open(os.path.join(entry, "meta.json"), encoding="utf-8") as f:
        return json.load(f)


def units_for(paths: Sequence[str]) -> list[RowUnit]:
    """The files split into worker tasks of ROWS_PER_UNIT rows."""
    return row_units(paths, ROWS_PER_UNIT)
