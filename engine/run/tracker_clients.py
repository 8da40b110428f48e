"""The two experiment-tracker clients rank 0 logs through (engine.run.trackers opens them):
`WandbTracker` (Weights & Biases, `logging.wandb.*`) and `MlflowTracker` (MLflow's tracking
client, `logging.mlflow.*`), and what they log as the run's parameters.

Both take the metrics of one step exactly as metrics.jsonl holds them (name -> Python float,
the step number of metrics.jsonl) and the resolved configuration as parameters:
`flat_config(cfg)` is every key of the run's config, nested keys joined by dots
(`train.max_steps`), values as resolved (lists kept), secrets redacted as in the checkpoint's
config.yaml (engine.config.redaction: a secret key's value and URI credentials read `***`).
W&B stores them as the run's config; MLflow's params are strings: `param_text` writes a
non-string value as JSON (`true`, `null`, `[1, 2]`) and cuts a value at `MLFLOW_PARAM_CHARS`
characters (the limit older MLflow servers enforce; newer ones allow 6000), ending it with
"..."; MLflow's client sends them 100 per request (its batch limit). MLflow's params cannot
change: a resumed run logs the keys its run lacks and reports (`MlflowTracker.changed`) the
ones whose value differs, keeping the first. MLflow's metric names allow letters, digits and
`_-. :/`; any other character is logged as `_` (RL's `val/pass@k` is MLflow's `val/pass_k`;
W&B takes every name as it is).

Each client's constructor starts or resumes its run (`resume_id`: the id a run of the same
logging.dir stored, engine.run.trackers) and raises whatever the library raises when it cannot;
`ids()` is what a resumed run needs to find it again (the tracking URI as redact_text writes
it: trackers.json is a file of the run folder); `close(failed)` ends the run (W&B exit code 1,
MLflow status FAILED when `failed`). W&B records the command line in its run metadata: the
process's argv is redacted (redact_argv) while wandb.init reads it, and restored after.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from typing import Any, Mapping

from engine.config.logging_settings import wandb_mode
from engine.config.redaction import redact_argv, redact_text, redacted_container

__all__ = ["WandbTracker", "MlflowTracker", "flat_config", "param_text", "MLFLOW_PARAM_CHARS"]

MLFLOW_PARAM_CHARS = 500
_BAD_METRIC_CHARS = re.compile(r"[^/\w.\- :]")


def flat_config(cfg: Any) -> dict[str, Any]:
    """The resolved configuration as {dotted key: value} (lists and scalars as resolved),
    redacted (module docstring)."""
    tree = redacted_container(cfg)
    out: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(f"{prefix}.{key}" if prefix else str(key), value)
        else:
            out[prefix] = node

    walk("", tree)
    return out


def param_text(value: Any) -> str:
    """An MLflow param value: strings as they are, anything else as JSON; cut at
    MLFLOW_PARAM_CHARS characters (the last three "...")."""
    text = value if isinstance(value, str) else json.dumps(value)
    if len(text) > MLFLOW_PARAM_CHARS:
        text = text[:MLFLOW_PARAM_CHARS - 3] + "..."
    return text


class WandbTracker:
    """A W&B run (wandb.init) with logging.wandb.*; offline runs write under $WANDB_DIR, else
    logging.dir (wandb's own `wandb/` folder there)."""

    name = "W&B"
    key = "logging.wandb.project"

    def __init__(self, cfg: Any, resume_id: str | None, tag: str) -> None:
        # an optional package (setup.py extra "wandb"): imported only when W&B is on
        import wandb

        wb = cfg.logging.wandb
        self.project, self.entity = wb.project, wb.entity
        folder = None if os.environ.get("WANDB_DIR") else cfg.logging.dir
        if folder:
            os.makedirs(folder, exist_ok=True)
        resume = {"id": resume_id, "resume": "allow"} if resume_id else {}
        argv, sys.argv = sys.argv, redact_argv(sys.argv)   # wandb stores it (docstring)
        try:
            self.run = wandb.init(project=wb.project, entity=wb.entity, name=wb.name,
                                  group=wb.group, tags=list(wb.tags) or None, job_type=tag,
                                  mode=wandb_mode(cfg), dir=folder, config=flat_config(cfg),
                                  **resume)
        finally:
            sys.argv = argv
        self.run_id = self.run.id

    def ids(self) -> dict:
        return {"id": self.run_id, "project": self.project, "entity": self.entity}

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MlflowTracker:
    """An MLflow run through MlflowClient (no fluent, process-wide active run): created in
    logging.mlflow.experiment (made when missing; null: Default), or reopened by run id."""

    name = "MLflow"
    key = "logging.mlflow.tracking_uri"

    def __init__(self, cfg: Any, resume_id: str | None, tag: str) -> None:
        # an optional package (setup.py extra "mlflow", mlflow-skinny): imported only when on
        from mlflow import entities, tracking

        self._entities = entities
        ml = cfg.logging.mlflow
        self.uri = ml.tracking_uri
        self.client = tracking.MlflowClient(tracking_uri=ml.tracking_uri)
        if resume_id:
            run = self.client.get_run(resume_id)
            self.client.update_run(resume_id, status="RUNNING")
        else:
            name = ml.experiment or "Default"
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(name))
            run = self.client.create_run(experiment_id, run_name=ml.run_name,
                                         tags={"engine.entry_point": tag})
        self.run_id = run.info.run_id
        self.changed = self._log_params(flat_config(cfg), dict(run.data.params))

    def _log_params(self, config: dict[str, Any], existing: dict[str, str]) -> list[str]:
        """Log the params the run lacks; return the keys whose logged value differs."""
        params = {key: param_text(value) for key, value in config.items()}
        new = [self._entities.Param(k, v) for k, v in params.items() if k not in existing]
        if new:
            self.client.log_batch(self.run_id, params=new)
        return sorted(k for k, v in params.items() if k in existing and existing[k] != v)

    def ids(self) -> dict:
        return {"run_id": self.run_id, "tracking_uri": redact_text(self.uri)}

    def log(self, step: int, values: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[
            self._entities.Metric(_BAD_METRIC_CHARS.sub("_", name), value, now, step)
            for name, value in values.items()])

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
