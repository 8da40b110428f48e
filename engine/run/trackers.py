"""Experiment trackers (`logging.wandb.*`, `logging.mlflow.*`; docs/metrics.md, "Experiment
trackers"): rank 0 logs to them exactly what it writes to metrics.jsonl.

`open_trackers(cfg, start, tag)` is called by RunLoop.prepare on every rank of the run, after
the resume point `start` is known and before any step. With no tracker on it does nothing.
Otherwise rank 0 starts each tracker that is on (engine.run.tracker_clients) and makes them the
process's `active()` set; MetricsLogger.log hands every step it writes to metrics.jsonl (same
names, same floats, same step number: the run loop's steps and RL's step-0 validation) to that
set. Starting is agreed on by every rank (one all-reduce when the world has several ranks): a
tracker that cannot start (a refused tracking URI, an unreachable server, a bad API key) ends
the run on every rank with `TrackerStartError` naming the tracker's key, before any step.
`close_trackers(failed)` ends the tracker runs (RunLoop.run, when the loop ends).

Resume: rank 0 keeps the tracker run ids in `logging.dir/trackers.json`. A run that resumes
from a checkpoint (`start` > 0) logs to the runs stored there, when they were made for the same
W&B project or MLflow tracking URI (W&B `id=..., resume="allow"`; MLflow the same run id,
reopened); a run from step 0 starts new tracker runs and stores their ids. The steps a resumed
run repeats (those after its checkpoint that an interrupted run had logged) are logged again:
MLflow keeps both values of such a step, W&B keeps the first (it drops steps not above the
last one it has), while metrics.jsonl is rewound to the checkpoint.

A tracker whose logging fails during the run (its server gone) is reported once on rank 0 and
dropped; training and metrics.jsonl go on.

Secrets (engine.config.redaction): the params are redacted (tracker_clients.flat_config),
trackers.json keeps the tracking URI redacted (a resumed run matches it redacted), and every
message here (the URI a start error names, a library's exception text) has the config's
secrets and any URI credentials masked.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

import torch
import torch.distributed as dist

from engine.config.logging_settings import mlflow_on, wandb_on
from engine.config.redaction import redact_text, scrub, secret_values
from engine.errors import RunError
from engine.run.tracker_clients import MlflowTracker, WandbTracker
from parallel.cpu_runtime import device

__all__ = ["TrackerStartError", "TrackerSet", "open_trackers", "close_trackers", "active",
           "resume_id", "stored_ids", "TRACKER_FILE"]

TRACKER_FILE = "trackers.json"
_ACTIVE: list["TrackerSet"] = []   # the set rank 0 of this process logs to (at most one)


class TrackerStartError(RunError):
    """A configured tracker did not start (raised on every rank, before the first step)."""


class TrackerSet:
    """The started trackers of one run (rank 0): `log` hands a step to each, `close` ends
    them. A tracker whose `log` raises is reported and dropped (module docstring); `secrets`
    (redaction.secret_values) are masked in what is printed."""

    def __init__(self, trackers: list, secrets: tuple[str, ...] = ()) -> None:
        self.trackers, self.secrets = list(trackers), tuple(secrets)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for tracker in list(self.trackers):
            try:
                tracker.log(step, values)
            except Exception as e:  # a tracker's outage must not stop training
                self.trackers.remove(tracker)
                print(f"[trackers] {tracker.name} stopped logging at step {step} ({tracker.key}"
                      f"): {type(e).__name__}: {scrub(str(e), self.secrets)}; metrics.jsonl "
                      "keeps every step", flush=True)

    def close(self, failed: bool) -> None:
        for tracker in self.trackers:
            try:
                tracker.close(failed)
            except Exception as e:  # closing is best effort; the metrics were logged
                print(f"[trackers] {tracker.name} did not close cleanly: "
                      f"{scrub(str(e), self.secrets)}", flush=True)
        self.trackers = []


def active() -> TrackerSet | None:
    """The tracker set this process logs to (rank 0 between open_trackers and
    close_trackers), else None."""
    return _ACTIVE[0] if _ACTIVE else None


def stored_ids(log_dir: str) -> dict:
    """The tracker run ids kept in `log_dir`/trackers.json ({} when there are none)."""
    try:
        with open(os.path.join(log_dir, TRACKER_FILE), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _store_ids(log_dir: str, ids: dict) -> None:
    os.makedirs(log_dir, exist_ok=True)
    path = os.path.join(log_dir, TRACKER_FILE)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(ids, f, indent=1)
    os.replace(path + ".tmp", path)


def resume_id(stored: dict, start: int, match: dict, id_key: str) -> str | None:
    """The stored run id when resuming (start > 0) and the stored `match` fields agree."""
    if start <= 0 or not stored.get(id_key):
        return None
    return stored[id_key] if all(stored.get(k) == v for k, v in match.items()) else None


def start_trackers(cfg: Any, start: int, tag: str) -> TrackerSet:
    """Rank 0: start (or, resuming, reopen) every tracker that is on and store their ids.
    Raises TrackerStartError naming the key of the first that fails (those already started
    are closed as failed)."""
    stored = stored_ids(cfg.logging.dir)
    wanted = []
    if wandb_on(cfg):
        wb = cfg.logging.wandb
        wanted.append((WandbTracker, "wandb", resume_id(
            stored.get("wandb", {}), start, {"project": wb.project, "entity": wb.entity}, "id")))
    if mlflow_on(cfg):
        wanted.append((MlflowTracker, "mlflow", resume_id(
            stored.get("mlflow", {}), start,
            {"tracking_uri": redact_text(cfg.logging.mlflow.tracking_uri)}, "run_id")))
    secrets = tuple(secret_values(cfg))
    started = TrackerSet([], secrets)
    for cls, name, run_id in wanted:
        try:
            tracker = cls(cfg, run_id, tag)
        except Exception as e:
            started.close(failed=True)
            value = getattr(cfg.logging, name)
            value = value.project if name == "wandb" else value.tracking_uri
            raise TrackerStartError(f"{cls.key}={redact_text(value)}: {cls.name} could not "
                                    f"start: {type(e).__name__}: {scrub(str(e), secrets)}"
                                    ) from None
        started.trackers.append(tracker)
        stored[name] = tracker.ids()
        how = "resumed" if run_id else "new"
        print(f"[{tag}] {cls.name}: logging to {how} run {tracker.run_id}", flush=True)
        for key in getattr(tracker, "changed", ()):
            print(f"[{tag}] MLflow params cannot change: {key} keeps its first value",
                  flush=True)
    _store_ids(cfg.logging.dir, stored)
    return started


def open_trackers(cfg: Any, start: int, tag: str) -> None:
    """Collective (module docstring): start the trackers on rank 0 and make them active;
    TrackerStartError on every rank when one cannot start. Nothing when none is on."""
    if not (wandb_on(cfg) or mlflow_on(cfg)):
        return
    close_trackers(failed=True)   # one left by a run that ended before its loop (same process)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    error = None
    if rank0:
        try:
            _ACTIVE.append(start_trackers(cfg, start, tag))
        except Exception as e:  # every rank must learn of it, or the others would wait
            error = e if isinstance(e, TrackerStartError) else TrackerStartError(
                f"experiment trackers (logging.dir={cfg.logging.dir}): {type(e).__name__}: "
                f"{scrub(str(e), secret_values(cfg))}")
    failed = error is not None
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([int(failed)], dtype=torch.int32, device=device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        failed = bool(flag.item())
    if failed:
        close_trackers(failed=True)
        raise error or TrackerStartError("an experiment tracker did not start on rank 0 "
                                         "(rank 0 says which and why)")


def close_trackers(failed: bool) -> None:
    """End the active tracker runs (failed: W&B exit code 1, MLflow status FAILED)."""
    while _ACTIVE:
        _ACTIVE.pop().close(failed)
