"""The `logging.*` keys: where rank 0 writes the metrics (`logging.dir`: metrics.jsonl and
TensorBoard), the progress bar, and the experiment trackers `logging.wandb.*` and
`logging.mlflow.*` (docs/metrics.md, "Experiment trackers").

A tracker is on when its key is set: Weights & Biases when `logging.wandb.project` is set (and
its mode, resolved by `wandb_mode`, is not disabled), MLflow when `logging.mlflow.tracking_uri`
is set. Rank 0 logs to them exactly what it writes to metrics.jsonl (engine.run.trackers).

`tracker_problems(cfg)` checks the values (no file system, no imports); `tracker_start_problems
(cfg)` what a tracker needs to start on this host: its package importable (looked up, not
imported), an API key for W&B online (WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE or a netrc entry
for the W&B host) and an MLflow store this installation opens (`mlflow_store_problems`: a file
store refused by MLflow >= 3.13 without MLFLOW_ALLOW_FILE_STORE=true; a database store without
SQLAlchemy, which the `[mlflow]` extra's mlflow-skinny lacks). Both run on every rank before
any process group exists, so nothing (no W&B folder, no MLflow run) is made before them, and
name the key (a URI's credentials masked, engine.config.redaction); what only starting the
tracker can tell (an unreachable server, a refused login) is checked by engine.run.trackers
before the first step.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import netrc
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional
from urllib.parse import urlparse

from engine.config.redaction import redact_text

WANDB_MODES = ("online", "offline", "disabled")
# tracking URI schemes MLflow's tracking stores serve (a plain path is a local file store)
MLFLOW_SCHEMES = ("file", "http", "https", "databricks", "databricks-uc", "sqlite",
                  "postgresql", "mysql", "mssql")
WANDB_HOST = "https://api.wandb.ai"
MLFLOW_DB_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")  # SqlAlchemyStore (full mlflow)
MLFLOW_FILE_STORE_REFUSED = (3, 13)  # the first MLflow release refusing file stores by default


@dataclass
class WandbConfig:
    project: Optional[str] = None   # W&B project; set: log to W&B (rank 0)
    entity: Optional[str] = None    # team or user (null: the API key's default entity)
    name: Optional[str] = None      # the run's display name (null: W&B picks one)
    group: Optional[str] = None     # run group
    tags: list[str] = field(default_factory=list)  # run tags
    # online | offline (files under $WANDB_DIR, else logging.dir; `wandb sync` uploads them) |
    # disabled (nothing logged); null: $WANDB_MODE, else online
    mode: Optional[str] = None


@dataclass
class MlflowConfig:
    # MLflow tracking URI (http(s)://server, databricks, sqlite:///f.db, file:///dir); set: log
    # to MLflow (rank 0)
    tracking_uri: Optional[str] = None
    experiment: Optional[str] = None  # experiment name, created if missing (null: Default)
    run_name: Optional[str] = None    # the run's name (null: MLflow picks one)


@dataclass
class LoggingConfig:
    dir: Optional[str] = "runs/sft"   # metrics.jsonl and TensorBoard events (rank 0); null: none
    progress_bar: bool = True         # a tqdm bar of the steps on rank 0
    sample_ids: bool = False     # rank 0 appends {"step", "indices"} per step to samples.jsonl
    wandb: WandbConfig = field(default_factory=WandbConfig)     # Weights & Biases (rank 0)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)  # MLflow (rank 0)


def wandb_mode(cfg: Any) -> str:
    """logging.wandb.mode resolved: the key, else $WANDB_MODE, else "online"."""
    return cfg.logging.wandb.mode or os.environ.get("WANDB_MODE") or "online"


def wandb_on(cfg: Any) -> bool:
    """Whether W&B logs this run: logging.wandb.project set and the mode not disabled."""
    return bool(cfg.logging.wandb.project) and wandb_mode(cfg) != "disabled"


def mlflow_on(cfg: Any) -> bool:
    """Whether MLflow logs this run: logging.mlflow.tracking_uri set."""
    return bool(cfg.logging.mlflow.tracking_uri)


def tracker_problems(cfg: Any) -> list[str]:
    """Invalid logging.wandb.* / logging.mlflow.* values, each naming its key."""
    p: list[str] = []
    wb, ml = cfg.logging.wandb, cfg.logging.mlflow
    if wb.project and wandb_mode(cfg) not in WANDB_MODES:
        source = "logging.wandb.mode" if wb.mode else "$WANDB_MODE (logging.wandb.mode=null)"
        p.append(f"{source}={wandb_mode(cfg)!r} is not valid; choose one of "
                 f"{', '.join(WANDB_MODES)}")
    if not wb.project and (wb.entity or wb.name or wb.group or list(wb.tags)):
        p.append("logging.wandb.entity/name/group/tags are set but logging.wandb.project is "
                 "not: set logging.wandb.project to log to W&B")
    if not ml.tracking_uri and (ml.experiment or ml.run_name):
        p.append("logging.mlflow.experiment/run_name are set but logging.mlflow.tracking_uri "
                 "is not: set logging.mlflow.tracking_uri to log to MLflow")
    if ml.tracking_uri:
        scheme = urlparse(ml.tracking_uri).scheme
        if scheme and len(scheme) > 1 and scheme not in MLFLOW_SCHEMES:  # C:\... is a path
            p.append(f"logging.mlflow.tracking_uri={redact_text(ml.tracking_uri)!r}: scheme "
                     f"{scheme!r} is "
                     f"not valid; choose one of {', '.join(MLFLOW_SCHEMES)} (or a directory "
                     "path: a local file store)")
    if (wandb_on(cfg) or mlflow_on(cfg)) and not cfg.logging.dir:
        key = "logging.wandb.project" if wandb_on(cfg) else "logging.mlflow.tracking_uri"
        p.append(f"{key} needs logging.dir: the trackers log what metrics.jsonl holds, and the "
                 "tracker run ids a resumed run reuses are kept there (trackers.json)")
    return p


def wandb_api_key_found(base_url: str | None = None) -> bool:
    """Whether W&B online can authenticate: WANDB_API_KEY or WANDB_IDENTITY_TOKEN_FILE is set,
    or the netrc file ($NETRC, else ~/.netrc) has an entry for the W&B host ($WANDB_BASE_URL,
    else api.wandb.ai), where `wandb login` writes the key."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(base_url or os.environ.get("WANDB_BASE_URL") or WANDB_HOST).hostname
    path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        return netrc.netrc(path).authenticators(host or "") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _missing(package: str, key: str, extra: str) -> list[str]:
    if importlib.util.find_spec(package) is not None:
        return []
    return [f"{key} is set but the {package} package is not installed: pip install "
            f"'megatron-sft-engine[{extra}]' (or unset {key})"]


def tracker_start_problems(cfg: Any) -> list[str]:
    """What keeps an enabled tracker from starting on this host (see the module docstring)."""
    p: list[str] = []
    if wandb_on(cfg):
        p += _missing("wandb", "logging.wandb.project", "wandb")
        if wandb_mode(cfg) == "online" and not wandb_api_key_found():
            p.append(f"logging.wandb.project={cfg.logging.wandb.project} with "
                     "logging.wandb.mode=online needs a W&B API key: set WANDB_API_KEY or run "
                     "`wandb login`, or use logging.wandb.mode=offline (`wandb sync` later)")
    if mlflow_on(cfg):
        p += (_missing("mlflow", "logging.mlflow.tracking_uri", "mlflow")
              or mlflow_store_problems(cfg.logging.mlflow.tracking_uri))
    return p


def _mlflow_version() -> tuple[int, int] | None:
    """(major, minor) of the installed mlflow or mlflow-skinny (package metadata, no import)."""
    for dist in ("mlflow", "mlflow-skinny"):
        try:
            found = re.match(r"(\d+)\.(\d+)", importlib.metadata.version(dist))
        except importlib.metadata.PackageNotFoundError:
            continue
        if found:
            return int(found.group(1)), int(found.group(2))
    return None


def mlflow_store_problems(uri: str) -> list[str]:
    """What keeps the installed MLflow from opening tracking URI `uri` (module docstring)."""
    scheme, key = urlparse(uri).scheme, f"logging.mlflow.tracking_uri={redact_text(uri)}"
    version = _mlflow_version()
    allowed = os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("true", "1")
    if (scheme == "file" or len(scheme) <= 1) and not allowed and version is not None \
            and version >= MLFLOW_FILE_STORE_REFUSED:
        return [f"{key} is a file store, which MLflow {version[0]}.{version[1]} refuses unless "
                "MLFLOW_ALLOW_FILE_STORE=true is set: set it, or log to a server (http://...) "
                "or a database (sqlite:///mlflow.db, with the full mlflow package)"]
    if scheme in MLFLOW_DB_SCHEMES and importlib.util.find_spec("sqlalchemy") is None:
        return [f"{key}: a {scheme} store needs the full mlflow package (SQLAlchemy); the "
                "[mlflow] extra installs mlflow-skinny: pip install mlflow"]
    return []
