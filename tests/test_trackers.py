"""Experiment trackers (`logging.wandb.*`, `logging.mlflow.*`; engine.run.trackers): a CPU demo
SFT run through the command line logs to W&B in offline mode and to an MLflow file store, and
what each tracker holds, read back with its own reader (W&B: the records of the offline run
file, decoded with wandb's protobuf classes; MLflow: MlflowClient.get_metric_history on the
store), is metrics.jsonl: every name, every step, the same floats. The resolved config is the
runs' parameters, a resumed run logs to the same tracker runs, and a tracker that cannot start
fails before any step naming its key."""
from __future__ import annotations

import contextlib
import json
import struct
from importlib.util import find_spec
from pathlib import Path

import pytest
import yaml

from engine.config.logging_settings import tracker_problems, tracker_start_problems
from engine.config.schema import SFTConfig, load_config
from engine.run.tracker_clients import MLFLOW_PARAM_CHARS, param_text
from engine.run.trackers import TrackerSet, resume_id

# the test extra installs both (setup.py); looked up, not imported (mlflow's import is ~1 s)
pytestmark = pytest.mark.skipif(not (find_spec("wandb") and find_spec("mlflow")),
                                reason="needs the wandb and mlflow packages (pip install -e .[test])")


def _sft_args(assets, log_dir, *extra):
    return ["-m", "engine.sft", f"model.hf_path={assets / 'model'}",
            f"data.train_files=[{assets / 'sft_train.jsonl'}]", "train.global_batch_size=4",
            "train.micro_batch_size=4", "train.seq_length=64", "train.max_steps=4",
            "train.exit_interval=2", "optim.lr=1e-3", "logging.progress_bar=false",
            f"logging.dir={log_dir}", f"checkpoint.dir={log_dir / 'ckpt'}", *extra]


def wandb_records(path: Path):
    """The protobuf Records of a W&B run file (`run-<id>.wandb`): wandb's LevelDB-style log,
    a 7-byte header (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of chunks, each with
    a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:          # a block's tail too short for a header: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _wandb_runs(wandb_dir: Path) -> list[dict]:
    """Per offline run folder (oldest first): its run id, config keys and {step: metrics}."""
    runs = []
    for folder in sorted((wandb_dir / "wandb").glob("offline-run-*")):
        run = {"history": {}}
        for record in wandb_records(next(folder.glob("run-*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"], run["project"] = record.run.run_id, record.run.project
                run["config"] = {i.key: json.loads(i.value_json) for i in record.run.config.update}
            elif kind == "history":
                items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json)
                         for i in record.history.item}
                run["history"][record.history.step.num] = {
                    k: v for k, v in items.items() if not k.startswith("_")}
        runs.append(run)
    return runs


def test_sft_logs_the_same_numbers_to_wandb_offline_and_mlflow_and_resumes(
        pools, demo_assets, tmp_path):
    store, wandb_dir = tmp_path / "mlruns", tmp_path / "wandb_dir"
    wandb_dir.mkdir()
    args = _sft_args(demo_assets, tmp_path, "logging.wandb.project=demo",
                     "logging.wandb.mode=offline", "logging.wandb.tags=[cpu,test]",
                     f"logging.mlflow.tracking_uri=file://{store}",
                     "logging.mlflow.experiment=trackers", "logging.mlflow.run_name=tiny")
    env = {"WANDB_DIR": str(wandb_dir), "MLFLOW_ALLOW_FILE_STORE": "true"}
    first = pools.script(1, *args, env=env, timeout=300)
    assert "stopping after step 2" in first.stdout
    ids = json.loads((tmp_path / "trackers.json").read_text())
    # from the checkpoint at step 2, with a changed value: MLflow keeps a param's first value
    resumed = pools.script(1, *args, "optim.clip_grad=2.0", env=env, timeout=300)
    assert f"MLflow: logging to resumed run {ids['mlflow']['run_id']}" in resumed.stdout
    assert "MLflow params cannot change: optim.clip_grad keeps its first value" in resumed.stdout
    assert json.loads((tmp_path / "trackers.json").read_text()) == ids
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    expected = {r["step"]: {k: v for k, v in r.items() if k != "step"} for r in rows}
    config = _flat(yaml.safe_load((tmp_path / "ckpt/iter_0000002/config.yaml").read_text()))
    assert config["model.lora.alpha"] == 16.0      # resolved by the config check, as run

    runs = _wandb_runs(wandb_dir)             # offline: one folder per launch, one run id
    assert [r["id"] for r in runs] == [ids["wandb"]["id"]] * 2
    assert [sorted(r["history"]) for r in runs] == [[1, 2], [3, 4]]
    assert {**runs[0]["history"], **runs[1]["history"]} == expected   # exact floats
    assert {k: v for k, v in runs[0]["config"].items() if k != "_wandb"} == config

    # read back on the rank that logged (mlflow is imported there already)
    run, params, logged = pools.run(1, "tests.test_trackers:mlflow_run", f"file://{store}",
                                    ids["mlflow"]["run_id"])[0]
    assert run == {"status": "FINISHED", "run_name": "tiny", "experiment": "trackers",
                   "runs_in_experiment": 1}
    texts = {k: v if isinstance(v, str) else json.dumps(v) for k, v in config.items()}
    assert max(map(len, texts.values())) < MLFLOW_PARAM_CHARS
    assert params == texts
    assert params["optim.clip_grad"] == "1.0" and params["logging.wandb.tags"] == '["cpu", "test"]'
    assert runs[1]["config"]["optim.clip_grad"] == 2.0     # W&B: the resumed launch's config
    assert logged == expected


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def mlflow_run(uri: str, run_id: str):
    """What MLflow's own client reads back from the store: the run's status, name, experiment
    and its experiment's run count; its params; {step: {metric: value}} of every metric."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    run = client.get_run(run_id)
    experiment = client.get_experiment(run.info.experiment_id)
    logged: dict[int, dict] = {}
    for name in run.data.metrics:
        for m in client.get_metric_history(run_id, name):
            logged.setdefault(m.step, {})[name] = m.value
    info = {"status": run.info.status, "run_name": run.info.run_name,
            "experiment": experiment.name,
            "runs_in_experiment": len(client.search_runs([experiment.experiment_id]))}
    return info, dict(run.data.params), logged


def _cfg(*overrides):
    return load_config(SFTConfig, list(overrides))[0]


def test_values_are_checked_naming_the_key():
    assert tracker_problems(_cfg()) == []
    problems = tracker_problems(_cfg("logging.wandb.project=p", "logging.wandb.mode=shared",
                                     "logging.mlflow.tracking_uri=ftp://host/x",
                                     "logging.dir=null"))
    assert problems[0] == ("logging.wandb.mode='shared' is not valid; choose one of online, "
                           "offline, disabled")
    assert problems[1].startswith("logging.mlflow.tracking_uri='ftp://host/x': scheme 'ftp' is "
                                  "not valid; choose one of file, http, https")
    assert problems[2].startswith("logging.wandb.project needs logging.dir")
    assert tracker_problems(_cfg("logging.mlflow.tracking_uri=/tmp/x")) == []   # a path
    assert "logging.wandb.project is not" in tracker_problems(_cfg("logging.wandb.group=g"))[0]
    # disabled: off, nothing needed (no package, no key, no logging.dir)
    assert tracker_problems(_cfg("logging.wandb.project=p", "logging.wandb.mode=disabled",
                                 "logging.dir=null")) == []


def test_missing_package_and_missing_api_key_are_refused(monkeypatch, tmp_path):
    netrc = tmp_path / "netrc"
    netrc.write_text("machine example.com login user password x\n")
    monkeypatch.setenv("NETRC", str(netrc))
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    online = _cfg("logging.wandb.project=p")
    assert tracker_start_problems(online) == [
        "logging.wandb.project=p with logging.wandb.mode=online needs a W&B API key: set "
        "WANDB_API_KEY or run `wandb login`, or use logging.wandb.mode=offline (`wandb sync` "
        "later)"]
    netrc.write_text("machine api.wandb.ai login user password k\n")   # `wandb login`
    assert tracker_start_problems(online) == []                      # negative control
    monkeypatch.setenv("WANDB_MODE", "offline")                      # mode null: $WANDB_MODE
    netrc.write_text("")
    assert tracker_start_problems(online) == []
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("wandb", "mlflow") else real(name, *a))
    assert tracker_start_problems(_cfg("logging.wandb.project=p",
                                       "logging.mlflow.tracking_uri=http://h:5000")) == [
        "logging.wandb.project is set but the wandb package is not installed: pip install "
        "'megatron-sft-engine[wandb]' (or unset logging.wandb.project)",
        "logging.mlflow.tracking_uri is set but the mlflow package is not installed: pip "
        "install 'megatron-sft-engine[mlflow]' (or unset logging.mlflow.tracking_uri)"]


def test_bad_tracking_uri_fails_before_any_step(pools, demo_assets, tmp_path):
    """A scheme MLflow does not serve: exit 2 at the config check. A server nobody answers
    at: the run ends before step 1 when rank 0 starts the tracker, exit 1 on every rank (they
    agree), naming the key once; nothing is logged."""
    bad = pools.script(1, *_sft_args(demo_assets, tmp_path, "logging.mlflow.tracking_uri="
                                     "ftp://nowhere/x"), timeout=300, check=False)
    assert bad.returncode == 2
    assert "error: logging.mlflow.tracking_uri='ftp://nowhere/x': scheme 'ftp'" in bad.stderr
    # a file store this MLflow refuses (no MLFLOW_ALLOW_FILE_STORE=true): exit 2 at the same
    # check, before W&B (on too) made its folder or MLflow its store
    store = tmp_path / "mlruns"
    refused = pools.script(1, *_sft_args(demo_assets, tmp_path, "logging.wandb.project=demo",
                                         "logging.wandb.mode=offline",
                                         f"logging.mlflow.tracking_uri={store}"),
                           env={"MLFLOW_ALLOW_FILE_STORE": "false", "WANDB_DIR": ""},
                           timeout=300, check=False)
    assert refused.returncode == 2, refused.stderr
    assert (f"error: logging.mlflow.tracking_uri={store} is a file store, which MLflow 3."
            in refused.stderr) and "MLFLOW_ALLOW_FILE_STORE=true" in refused.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []    # no wandb/, mlruns/, ckpt/
    with _refusing_port() as port:
        gone = pools.script(2, *_sft_args(demo_assets, tmp_path, "logging.mlflow.tracking_uri="
                                          f"http://127.0.0.1:{port}"), timeout=300, check=False,
                            env={"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
                                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"})
    assert [r.exit_code for r in gone.ranks] == [1, 1], gone.merged().stderr  # rank 1 learns
    assert gone.merged().stderr.count("could not start") == 1                  # rank 0 says it
    assert (f"error: logging.mlflow.tracking_uri=http://127.0.0.1:{port}: MLflow could not "
            "start: MlflowException:") in gone.stderr
    assert "Connection refused" in gone.stderr and "[sft] MLflow: logging" not in gone.stdout
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_store_this_mlflow_cannot_open_is_refused_by_the_config_check(monkeypatch):
    """MLflow >= 3.13 refuses a file store (a path or file:) unless MLFLOW_ALLOW_FILE_STORE is
    true; a database store needs SQLAlchemy (full mlflow, not the extra's mlflow-skinny)."""
    import importlib.metadata
    import importlib.util

    from engine.config import logging_settings

    installed = logging_settings._mlflow_version()    # read from the package metadata
    assert installed == tuple(map(int, importlib.metadata.version("mlflow-skinny").split(".")[:2]))
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.setattr(logging_settings, "_mlflow_version", lambda: (3, 17))

    def problems(uri):
        return tracker_start_problems(_cfg(f"logging.mlflow.tracking_uri='{uri}'"))

    refused = ("logging.mlflow.tracking_uri={} is a file store, which MLflow 3.17 refuses "
               "unless MLFLOW_ALLOW_FILE_STORE=true is set: set it, or log to a server "
               "(http://...) or a database (sqlite:///mlflow.db, with the full mlflow package)")
    assert problems("/tmp/mlruns") == [refused.format("/tmp/mlruns")]
    assert problems("file:///tmp/mlruns") == [refused.format("file:///tmp/mlruns")]
    assert problems("http://h:5000") == []
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "True")
    assert problems("/tmp/mlruns") == []
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    monkeypatch.setattr(logging_settings, "_mlflow_version", lambda: (3, 12))   # before 3.13
    assert problems("/tmp/mlruns") == []
    real = importlib.util.find_spec
    for found in (False, True):
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
            real(name, *a) if name != "sqlalchemy" else (object() if found else None)))
        assert problems("sqlite:///x.db") == ([] if found else [
            "logging.mlflow.tracking_uri=sqlite:///x.db: a sqlite store needs the full mlflow "
            "package (SQLAlchemy); the [mlflow] extra installs mlflow-skinny: pip install "
            "mlflow"])


@contextlib.contextmanager
def _refusing_port():
    """A local TCP port that refuses every connection for as long as the block runs: bound and
    never listened on, so a connect gets RST ("Connection refused"). Held, not released: a
    released port can be taken at once by another process (a gloo pair's listener took one in
    CI, and MLflow then waited 120 s for an answer instead of being refused)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


class _Tracker:
    name, key = "fake", "logging.fake"

    def __init__(self, fail: bool) -> None:
        self.fail, self.steps = fail, []

    def log(self, step, values):
        if self.fail:
            raise ConnectionError("server gone")
        self.steps.append(step)


def test_a_tracker_failing_mid_run_is_reported_once_and_dropped(capsys):
    good, bad = _Tracker(False), _Tracker(True)
    trackers = TrackerSet([bad, good])
    trackers.log(1, {"loss": 1.0})
    trackers.log(2, {"loss": 0.5})
    assert good.steps == [1, 2] and trackers.trackers == [good]
    assert capsys.readouterr().out == ("[trackers] fake stopped logging at step 1 (logging.fake)"
                                       ": ConnectionError: server gone; metrics.jsonl keeps every"
                                       " step\n")


def test_stored_ids_are_reused_only_by_a_resumed_run_of_the_same_project():
    stored = {"id": "abc", "project": "p", "entity": None}
    assert resume_id(stored, 2, {"project": "p", "entity": None}, "id") == "abc"
    assert resume_id(stored, 0, {"project": "p", "entity": None}, "id") is None   # fresh run
    assert resume_id(stored, 2, {"project": "q", "entity": None}, "id") is None   # moved
    assert resume_id({}, 2, {"project": "p"}, "id") is None


def test_param_text_is_json_and_cut_at_the_limit():
    assert [param_text(v) for v in ("a b", 3, 0.5, True, None, ["x", 1])] == [
        "a b", "3", "0.5", "true", "null", '["x", 1]']
    long = param_text("y" * 600)
    assert len(long) == MLFLOW_PARAM_CHARS and long.endswith("...") and long[:10] == "y" * 10
    assert param_text("y" * MLFLOW_PARAM_CHARS) == "y" * MLFLOW_PARAM_CHARS
