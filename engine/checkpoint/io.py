"""The on-disk layout of a run's training checkpoints, and its atomic-save protocol.

No torch.distributed here: every function is plain file-system work, called by one rank (global
rank 0) or by a test. Layout of a run directory `root` (`checkpoint.dir`)::

    root/iter_0000010/                      one complete checkpoint (optimizer steps done = 10)
        metadata.json, *.distcp, common.pt  Megatron distributed checkpoint (dist_checkpointing)
        hf_source/, bridge.json             the source's HF config + tokenizer, bridge metadata
                                            (an older checkpoint: hf/; models.bridge.checkpoint
                                            .source_dir reads either)
        hf/                                 checkpoint.save_hf: the HF folder convert writes
        config.yaml                         the run's resolved configuration (for humans)
        complete.json                       the completeness marker, written last (see below)
    root/iter_0000020.tmp/                  a save in progress (or torn by a crash): never read
    root/latest_checkpointed_iteration.txt  "20": the newest published iteration, written last

Save protocol (atomic): all ranks write into `iter_NNNNNNN.tmp/`; after a barrier, rank 0 checks
that `metadata.json` exists, writes `complete.json` (every file of the checkpoint with its size
in bytes), renames the directory to `iter_NNNNNNN` and only then rewrites the latest file
(write to a temporary file + `os.replace`). A crash at any point leaves either a `.tmp`
directory (ignored) or a complete iteration. On resume, every candidate is verified against its
marker (`checkpoint_problems`); a torn or damaged newest checkpoint is skipped with a warning in
favour of the previous complete one. `rewind_jsonl` trims a run's JSON-lines logs
(metrics.jsonl, samples.jsonl) back to the step a resumed run continues from.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

from models.bridge.errors import CheckpointError

__all__ = ["CheckpointError", "LATEST_FILE", "COMPLETE_MARKER", "iteration_dir", "staging_dir",
           "list_iterations", "read_latest", "atomic_write_text", "write_complete_marker",
           "checkpoint_problems", "publish", "newest_complete", "resolve_resume", "prune",
           "iteration_of", "rewind_jsonl"]

LATEST_FILE = "latest_checkpointed_iteration.txt"
COMPLETE_MARKER = "complete.json"
STAGING_SUFFIX = ".tmp"
_ITER_RE = re.compile(r"^iter_(\d{7})$")

Warn = Callable[[str], None]


def iteration_dir(root: str | os.PathLike, iteration: int) -> Path:
    """`root/iter_%07d`: the published checkpoint of `iteration` optimizer steps."""
    return Path(root) / f"iter_{int(iteration):07d}"


def staging_dir(root: str | os.PathLike, iteration: int) -> Path:
    """`root/iter_%07d.tmp`: where a save of `iteration` is written before it is published."""
    return Path(root) / f"iter_{int(iteration):07d}{STAGING_SUFFIX}"


def iteration_of(ckpt_dir: str | os.PathLike) -> Optional[int]:
    """The iteration encoded in a published checkpoint's directory name, else None."""
    m = _ITER_RE.match(Path(ckpt_dir).name)
    return int(m.group(1)) if m else None


def list_iterations(root: str | os.PathLike) -> list[int]:
    """Iterations of the published (`iter_%07d`, not `.tmp`) directories under `root`,
    ascending; complete or not."""
    path = Path(root)
    if not path.is_dir():
        return []
    out = [iteration_of(p) for p in path.iterdir() if p.is_dir()]
    return sorted(i for i in out if i is not None)


def read_latest(root: str | os.PathLike) -> Optional[int]:
    """The iteration named by `root/latest_checkpointed_iteration.txt`, or None."""
    f = Path(root) / LATEST_FILE
    try:
        return int(f.read_text().strip())
    except (OSError, ValueError):
        return None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` so that readers see the old or the new content, never a part."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _files_with_sizes(ckpt_dir: Path) -> dict[str, int]:
    out = {}
    for p in sorted(ckpt_dir.rglob("*")):
        if p.is_file() and p.name != COMPLETE_MARKER:
            out[p.relative_to(ckpt_dir).as_posix()] = p.stat().st_size
    return out


def write_complete_marker(ckpt_dir: str | os.PathLike, iteration: int,
                          info: Optional[dict] = None) -> None:
    """Rank 0, after every rank finished writing `ckpt_dir`: record every file and its size in
    `complete.json` (plus `iteration` and `info`). Raises CheckpointError when the Megatron
    `metadata.json` is missing (the distributed save did not finish)."""
    path = Path(ckpt_dir)
    if not (path / "metadata.json").is_file():
        raise CheckpointError(f"{path}: metadata.json missing after the distributed save; "
                              "the checkpoint is not complete")
    marker = {"iteration": int(iteration), "time": time.time(),
              "files": _files_with_sizes(path), **(info or {})}
    atomic_write_text(path / COMPLETE_MARKER, json.dumps(marker, indent=1))


def checkpoint_problems(ckpt_dir: str | os.PathLike) -> list[str]:
    """Why `ckpt_dir` is not a complete checkpoint (empty list: complete). Checks the marker,
    Megatron's metadata.json and that every file the marker lists exists with its size."""
    path = Path(ckpt_dir)
    if not path.is_dir():
        return [f"{path} is not a directory"]
    try:
        marker = json.loads((path / COMPLETE_MARKER).read_text())
        files = dict(marker["files"])
    except FileNotFoundError:
        return [f"{path} has no {COMPLETE_MARKER} (the save did not finish)"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{path}/{COMPLETE_MARKER} is unreadable: {e}"]
    problems = []
    if "metadata.json" not in files:
        problems.append(f"{path}: {COMPLETE_MARKER} does not list metadata.json")
    for rel, size in files.items():
        f = path / rel
        if not f.is_file():
            problems.append(f"{path}: missing file {rel}")
        elif f.stat().st_size != size:
            problems.append(f"{path}: {rel} has {f.stat().st_size} bytes, expected {size}")
    return problems


def publish(root: str | os.PathLike, iteration: int) -> Path:
    """Rank 0: rename the verified staging directory of `iteration` to `iter_%07d` (replacing
    an older save of the same iteration) and then point the latest file at it."""
    src, dst = staging_dir(root, iteration), iteration_dir(root, iteration)
    problems = checkpoint_problems(src)
    if problems:
        raise CheckpointError("refusing to publish an incomplete checkpoint: "
                              + "; ".join(problems))
    if dst.exists():
        old = dst.with_name(dst.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)
    _fsync_dir(Path(root))
    atomic_write_text(Path(root) / LATEST_FILE, f"{int(iteration)}\n")
    return dst


def newest_complete(root: str | os.PathLike, warn: Warn) -> Optional[Path]:
    """The complete checkpoint with the most steps under `root`, or None. Every newer torn or
    damaged one is reported through `warn` and skipped."""
    latest = read_latest(root)
    for it in reversed(list_iterations(root)):
        path = iteration_dir(root, it)
        problems = checkpoint_problems(path)
        if not problems:
            if latest is not None and latest != it:
                warn(f"{Path(root) / LATEST_FILE} names iteration {latest}; resuming from the "
                     f"newest complete checkpoint {path.name}")
            return path
        warn(f"skipping torn checkpoint {path}: " + "; ".join(problems))
    return None


def resolve_resume(resume: str, root: Optional[str], warn: Warn) -> Optional[Path]:
    """The checkpoint to resume from for `checkpoint.resume`.

    - "never": None.
    - "auto": the newest complete checkpoint under `root` (`checkpoint.dir`), None when there is
      none (a fresh start).
    - a path: a checkpoint directory (must be complete) or a run directory (its newest complete
      checkpoint; one must exist). Raises CheckpointError otherwise.
    """
    if resume == "never":
        return None
    if resume == "auto":
        return newest_complete(root, warn) if root else None
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint.resume={resume}: no such directory")
    if iteration_of(path) is not None or (path / COMPLETE_MARKER).exists():
        problems = checkpoint_problems(path)
        if problems:
            raise CheckpointError(f"checkpoint.resume={resume} is not a complete checkpoint: "
                                  + "; ".join(problems))
        return path
    found = newest_complete(path, warn)
    if found is None:
        raise CheckpointError(f"checkpoint.resume={resume}: no complete iter_NNNNNNN "
                              "checkpoint in this directory")
    return found


def prune(root: str | os.PathLike, keep_last: Optional[int]) -> list[Path]:
    """Rank 0, after a successful save: delete every checkpoint older than the `keep_last`
    newest complete ones (torn ones among them too) and leftover staging directories of older
    iterations. `keep_last=None` keeps everything. Returns the removed paths."""
    if keep_last is None:
        return []
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    complete = [it for it in reversed(list_iterations(root))
                if not checkpoint_problems(iteration_dir(root, it))]
    if len(complete) <= keep_last:
        return []
    oldest_kept = complete[keep_last - 1]
    removed = []
    for p in Path(root).iterdir():
        name = p.name[:-len(STAGING_SUFFIX)] if p.name.endswith(STAGING_SUFFIX) else p.name
        it = iteration_of(name)
        if p.is_dir() and it is not None and it < oldest_kept:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return sorted(removed)


def rewind_jsonl(path: str | os.PathLike, last_step: int) -> int:
    """Drop the lines of a `{"step": k, ...}` JSON-lines log with k > last_step (steps that a
    resumed run repeats); returns how many were dropped. Rank 0 only; missing file: 0."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            step = json.loads(line).get("step", 0)
        except ValueError:
            dropped += 1  # a line torn by a crash
            continue
        if step > last_step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        tmp = path.with_name(path.name + ".rewind")
        tmp.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
        os.replace(tmp, path)
    return dropped
