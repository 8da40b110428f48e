"""Secrets never leave the process (engine.config.redaction; docs/metrics.md, "Secrets"): an RL
configuration holding an agent API key, a token in a free-form dict, credentials in the MLflow
tracking URI (userinfo and a `?token=`) and in the judge's base URL runs the real run loop
in-process (RunLoop.prepare/run: the trackers, metrics.jsonl, TensorBoard, the checkpoint's
config.yaml) with W&B and MLflow faked at the import boundary tests/test_trackers.py's real runs
go through (`import wandb`, `from mlflow.tracking import MlflowClient`); no secret string may
reach W&B's config or the command line it records, MLflow's params, any file the run wrote, or
the run's printed lines (a tracker failing with the URI in its message included). The values
the program runs with keep every secret. The secrets come in each shape issue 82 found leaking:
a camelCase key (`accessToken`), header-style keys in a dict-valued override (`X-Api-Key`,
`Authorization: 'Bearer ...'`, which W&B's recorded command line holds whole), a `Bearer` token
inside a plain string, `{api_key: ...}` as a dict-valued override, and a URI password holding
`@` and `/`; non-secret keys beside them (`tokenizer`, `maxNewTokens`) stay in clear."""
from __future__ import annotations

import json
import sys
import types
from types import SimpleNamespace

import pytest
import yaml

from engine.config.logging_settings import tracker_problems
from engine.config.schema import load_config
from engine.rl.config import RLConfig
from engine.rl.judge.checks import judge_problems
from engine.run import run_loop as run_loop_module
from engine.run.run_loop import RunLoop
from engine.run.trackers import TrackerStartError, close_trackers, open_trackers

MASK = "***"   # engine.config.redaction.MASK (imported by the rule's test only, so that the
#               run tests also run, and fail, on a tree without the module)
SECRETS = {"agent": "sk-agent-7Qx2", "kwargs": "hf_kwTok9Zp", "user": "ml-user-Jd4",
           "password": "ml-pass-Vb8", "token": "ml-tok-Hq3", "judge": "judge-pw-Rt6",
           "camel": "tok-camel-Ly7", "x_api_key": "xk-Tn8Wq", "header": "sk-hdr-Gd5",
           "bearer": "sk-line-Hb2", "dict": "sk-live-999999", "at": "at-Pz5",
           "slash": "sl-Wm3"}
# the judge's password holds '@' and '/': "judge-pw-Rt6@at-Pz5/sl-Wm3"
JUDGE = (f"https://judge:{SECRETS['judge']}@{SECRETS['at']}/{SECRETS['slash']}"
         "@judge.example/v1")
HEADERS = f"{{X-Api-Key: {SECRETS['x_api_key']}, Authorization: 'Bearer {SECRETS['header']}'}}"
URI = (f"https://{SECRETS['user']}:{SECRETS['password']}@mlflow.example:5000/"
       f"?token={SECRETS['token']}&region=eu")


def _overrides(tmp_path) -> list[str]:
    return [f"env.agent_api_key={SECRETS['agent']}", f"env.kwargs.hf_token={SECRETS['kwargs']}",
            f"logging.mlflow.tracking_uri='{URI}'", "logging.mlflow.experiment=rl",
            f"reward.judge.base_url='{JUDGE}'", f"env.kwargs.accessToken={SECRETS['camel']}",
            f"env.kwargs.headers={HEADERS}", f"env.kwargs.extra={{api_key: {SECRETS['dict']}, n: 2}}",
            f"env.kwargs.header_line='Authorization: Bearer {SECRETS['bearer']}'",
            "env.kwargs.tokenizer=qwen-tok", "env.kwargs.maxNewTokens=64",
            "logging.wandb.project=demo", "logging.wandb.mode=offline",
            f"logging.dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'run/ckpt'}",
            "checkpoint.save_interval=1", "train.max_steps=2", "logging.progress_bar=false"]


class _Libraries:
    """Fake `wandb` and `mlflow` modules: what each was handed, as the real clients get it."""

    def __init__(self, fail_metrics_at: int | None = None, fail_start: bool = False) -> None:
        self.wandb_init: list[dict] = []
        self.mlflow: dict = {"uri": [], "params": [], "metrics": [], "runs": {}}
        self.fail_metrics_at, self.fail_start = fail_metrics_at, fail_start

    def modules(self) -> dict[str, types.ModuleType]:
        libs = self

        def init(**kwargs):
            libs.wandb_init.append({**kwargs, "argv": list(sys.argv)})   # wandb records argv
            return SimpleNamespace(id="wb1", log=lambda values, step: None,
                                   finish=lambda exit_code: None)

        class MlflowClient:
            def __init__(self, tracking_uri):
                self.uri = tracking_uri
                libs.mlflow["uri"].append(tracking_uri)
                if libs.fail_start:   # as requests words it: the URL it could not reach
                    raise ConnectionError(f"API request to {tracking_uri}/api/2.0/mlflow/"
                                          "experiments/get-by-name failed")

            def get_experiment_by_name(self, name):
                return None

            def create_experiment(self, name):
                return "1"

            def create_run(self, experiment_id, run_name=None, tags=None):
                run_id = f"run{len(libs.mlflow['runs'])}"
                run = SimpleNamespace(info=SimpleNamespace(run_id=run_id),
                                      data=SimpleNamespace(params={}))
                libs.mlflow["runs"][run.info.run_id] = run
                return run

            def get_run(self, run_id):
                return libs.mlflow["runs"][run_id]

            def update_run(self, run_id, status):
                pass

            def log_batch(self, run_id, params=(), metrics=()):
                libs.mlflow["params"] += [(p.key, p.value) for p in params]
                if metrics and metrics[0].step == libs.fail_metrics_at:
                    raise ConnectionError(f"API request to {self.uri}/api/2.0/mlflow/runs/"
                                          "log-batch failed")
                libs.mlflow["metrics"] += [(m.key, m.value, m.step) for m in metrics]

            def set_terminated(self, run_id, status):
                pass

        wandb = types.ModuleType("wandb")
        wandb.init = init
        mlflow, tracking, entities = (types.ModuleType(n) for n in
                                      ("mlflow", "mlflow.tracking", "mlflow.entities"))
        tracking.MlflowClient = MlflowClient
        entities.Param = lambda key, value: SimpleNamespace(key=key, value=value)
        entities.Metric = lambda key, value, timestamp, step: SimpleNamespace(
            key=key, value=value, timestamp=timestamp, step=step)
        mlflow.tracking, mlflow.entities = tracking, entities
        return {"wandb": wandb, "mlflow": mlflow, "mlflow.tracking": tracking,
                "mlflow.entities": entities}


def _install(monkeypatch, libs: _Libraries) -> None:
    for name, module in libs.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delenv("WANDB_DIR", raising=False)


def _leaks(text: str) -> list[str]:
    return [name for name, secret in SECRETS.items() if secret in text]


def test_no_secret_reaches_trackers_files_or_log_lines(monkeypatch, tmp_path, capsys):
    argv = ["engine/rl/__main__.py", *_overrides(tmp_path)]
    cfg = load_config(RLConfig, argv[1:])[0]
    libs = _Libraries(fail_metrics_at=2)
    _install(monkeypatch, libs)
    monkeypatch.setattr(sys, "argv", argv)       # the command line as the entry point got it
    saved = []

    def save(engine, root, position, hf_config, tokenizer_dir, keep_last, config_yaml,
             extra=None, save_hf=False, hf_extras=None):
        """save_training_checkpoint's rank-0 write of the run's config (the rest needs a
        process group and a model): `config_yaml` verbatim into <iteration>/config.yaml."""
        path = tmp_path / "run/ckpt" / f"iter_{position:07d}"
        path.mkdir(parents=True)
        (path / "config.yaml").write_text(config_yaml)
        saved.append(path)
        return path

    monkeypatch.setattr(run_loop_module, "save_training_checkpoint", save)
    engine = SimpleNamespace(guard=SimpleNamespace(raise_if_diverged=lambda: None), mtp=None)
    loop = RunLoop("rl", cfg, engine, {}, position=lambda done: done)
    assert loop.prepare(0)
    loop.run(0, lambda step: {"loss": 1.0 / (step + 1), "reward/mean": 0.5})
    out = capsys.readouterr()

    # the trackers got the run: W&B's config and recorded argv, MLflow's params and step 1
    (init,) = libs.wandb_init
    assert init["config"]["env.agent_api_key"] == MASK
    assert init["config"]["env.kwargs.hf_token"] == MASK
    assert init["config"]["logging.mlflow.tracking_uri"] == (
        f"https://{MASK}@mlflow.example:5000/?token={MASK}&region=eu")
    assert init["config"]["reward.judge.base_url"] == f"https://{MASK}@judge.example/v1"
    assert init["config"]["train.max_steps"] == 2                  # the rest as resolved
    kwargs = {k[len("env.kwargs."):]: v for k, v in init["config"].items()
              if k.startswith("env.kwargs.")}
    assert kwargs == {"hf_token": MASK, "accessToken": MASK, "headers.X-Api-Key": MASK,
                      "headers.Authorization": MASK, "extra.api_key": MASK, "extra.n": 2,
                      "header_line": f"Authorization: Bearer {MASK}",
                      "tokenizer": "qwen-tok", "maxNewTokens": 64}   # the last two in clear
    assert f"env.agent_api_key={MASK}" in init["argv"]
    assert f"env.kwargs.extra={{api_key: {MASK}, n: 2}}" in init["argv"]
    assert f"env.kwargs.headers={{X-Api-Key: {MASK}, Authorization: '{MASK}'}}" in init["argv"]
    params = dict(libs.mlflow["params"])
    assert params["env.agent_api_key"] == MASK and params["train.max_steps"] == "2"
    assert libs.mlflow["metrics"] == [("loss", 1.0, 1), ("reward/mean", 0.5, 1)]
    assert "[trackers] MLflow stopped logging at step 2" in out.out   # its message scrubbed
    assert f"https://{MASK}@mlflow.example:5000/?token={MASK}" in out.out
    written = {p.relative_to(tmp_path).as_posix(): p.read_bytes().decode("latin-1")
               for p in tmp_path.rglob("*") if p.is_file()}
    assert {"run/metrics.jsonl", "run/trackers.json", "run/ckpt/iter_0000001/config.yaml",
            "run/ckpt/iter_0000002/config.yaml"} <= set(written)
    dumped = yaml.safe_load(written["run/ckpt/iter_0000002/config.yaml"])
    assert dumped["env"]["agent_api_key"] == MASK and dumped["train"]["max_steps"] == 2

    # not one secret anywhere it went
    assert _leaks(json.dumps(init)) == [] and _leaks(json.dumps(libs.mlflow["params"])) == []
    assert {name: _leaks(text) for name, text in written.items() if _leaks(text)} == {}
    assert _leaks(out.out + out.err) == []
    # the program's own values are untouched: the endpoint, the judge and the client get them
    assert cfg.env.agent_api_key == SECRETS["agent"] and cfg.logging.mlflow.tracking_uri == URI
    assert libs.mlflow["uri"] == [URI] and sys.argv == argv
    assert cfg.reward.judge.base_url == JUDGE and cfg.env.kwargs["headers"]["Authorization"] \
        == f"Bearer {SECRETS['header']}" and cfg.env.kwargs["accessToken"] == SECRETS["camel"]

    # a resumed run finds its MLflow run by the redacted URI trackers.json keeps
    open_trackers(cfg, 1, "rl")
    close_trackers(failed=False)
    assert "MLflow: logging to resumed run run0" in capsys.readouterr().out


def test_a_tracker_that_cannot_start_names_the_key_without_its_secrets(monkeypatch, tmp_path):
    cfg = load_config(RLConfig, _overrides(tmp_path))[0]
    _install(monkeypatch, _Libraries(fail_start=True))
    with pytest.raises(TrackerStartError) as failed:
        open_trackers(cfg, 0, "rl")
    message = str(failed.value)
    assert message.startswith(f"logging.mlflow.tracking_uri=https://{MASK}@mlflow.example:5000/"
                              f"?token={MASK}&region=eu: MLflow could not start: "
                              f"ConnectionError: API request to https://{MASK}@")
    assert _leaks(message) == []
    # the config checks' messages (a password holding '@' and '/': the old rule kept its tail)
    password = f"{SECRETS['password']}@{SECRETS['at']}/{SECRETS['slash']}"
    bad = load_config(RLConfig, [f"logging.mlflow.tracking_uri='ftp://u:{password}@h/x'",
                                 f"reward.judge.base_url='ftp://judge:{password}@h/v1'"])[0]
    assert tracker_problems(bad)[0].startswith(
        f"logging.mlflow.tracking_uri='ftp://{MASK}@h/x': scheme 'ftp' is not valid")
    judge = [p for p in judge_problems(bad) if p.startswith("reward.judge.base_url=")]
    assert judge == [f"reward.judge.base_url='ftp://{MASK}@h/v1' must be an http:// or "
                     "https:// URL ending in /v1 (e.g. megatron-sft-engine serve's), or null "
                     "(no judge)"]


def test_the_rule_names_secret_keys_and_uri_credentials():
    from engine.config import redaction
    from engine.config.redaction import (is_secret_key, redact_argv, redact_text,
                                         redacted_container, scrub, secret_values)

    assert redaction.MASK == MASK
    secret = ["env.agent_api_key", "hf_token", "env.kwargs.password", "client_secret", "apikey",
              "X-Amz-Signature", "x.credentials", "db_passwd", "sig"]
    plain = ["reward.judge.api_key_env", "rollout.max_tokens", "moe.token_dispatcher",
             "tokenizer", "author", "max_new_tokens", "keys", "signature_size"]
    assert [k for k in secret if not is_secret_key(k)] == []
    assert [k for k in plain if is_secret_key(k)] == []
    assert redact_text("see http://u:p@h:1/a?x=1&access_token=t#f and s3://k@b/o") == (
        f"see http://{MASK}@h:1/a?x=1&access_token={MASK}#f and s3://{MASK}@b/o")
    assert redact_text("user@example.com http://h/p@x") == "user@example.com http://h/p@x"
    assert redact_argv(["-m", "engine.rl", "env.agent_api_key=k", "+env.kwargs.hf_token=t",
                        "--api-key", "K", "--api-key=K", "--config", "r.yaml", "x=http://a:b@h"]
                       ) == ["-m", "engine.rl", f"env.agent_api_key={MASK}",
                             f"+env.kwargs.hf_token={MASK}", "--api-key", MASK,
                             f"--api-key={MASK}", "--config", "r.yaml", f"x=http://{MASK}@h"]
    cfg = load_config(RLConfig, ["env.agent_api_key=abcdef", "env.kwargs.token=xy",
                                 "logging.mlflow.tracking_uri='https://bob:pw1234@h'"])[0]
    assert secret_values(cfg) == ["bob:pw1234", "abcdef", "pw1234"]   # "xy": too short
    assert scrub("denied for bob:pw1234 (pw1234), key abcdef", secret_values(cfg)) == (
        f"denied for {MASK} ({MASK}), key {MASK}")
    tree = redacted_container(cfg)
    assert tree["env"]["kwargs"] == {"token": MASK} and tree["env"]["agent_api_key"] == MASK
    assert tree["reward"]["judge"]["api_key_env"] is None        # null stays null


def test_the_shapes_issue_82_found_leaking_are_masked_and_plain_keys_stay():
    """camelCase and header-style keys, a `Bearer` credential and secret `name: value` pairs in
    a string, secret keys inside a dict- or list-valued override, a URI password holding `@`,
    `/` or `?`. The rule before issue 82 left each in clear (all but `apiKey` and `X-Api-Key`,
    which lower-casing already caught). Controls: keys and texts with token-like words that
    name no secret stay as they are."""
    from engine.config.redaction import (is_secret_key, redact_argv, redact_text, redact_tree,
                                         scrub, secret_values)

    secret = ["env.kwargs.accessToken", "apiKey", "clientSecret", "X-Api-Key", "Authorization",
              "Proxy-Authorization", "HFToken", "myAPIKey", "secretAccessKey", "Cookie"]
    plain = ["num_tokens", "tokenizer", "max_new_tokens", "maxNewTokens", "token_budget",
             "tokenBudget", "apiKeyEnv", "authorName", "signatureSize", "oauth"]
    assert [k for k in secret if not is_secret_key(k)] == []
    assert [k for k in plain if is_secret_key(k)] == []
    texts = {
        "Authorization: Bearer sk-abc123": f"Authorization: Bearer {MASK}",
        "Bearer sk-abc123 was refused": f"Bearer {MASK} was refused",
        "curl -H 'X-Api-Key: xk-91' -H 'Authorization: Basic dXNlcjpw' https://h/v1":
            f"curl -H 'X-Api-Key: {MASK}' -H 'Authorization: Basic {MASK}' https://h/v1",
        '{"apiKey": "sk-1", "model": "m"}': f'{{"apiKey": "{MASK}", "model": "m"}}',
        "https://user:p@ss@host/path": f"https://{MASK}@host/path",
        "https://user:pa/ss@host/path": f"https://{MASK}@host/path",
        "https://u:p@ss/w0rd@host/x?y=1": f"https://{MASK}@host/x?y=1",
        "https://user:pa?ss@host/x": f"https://{MASK}@host/x",
        "max_tokens=5 num_tokens: 7 tokenizer=qwen maxNewTokens: 64": None,   # controls
        "Token budget: 5; {% if token == eos_token %}": None,
        "user@example.com http://h/p@x https://h/p?next=a@b.com": None}
    texts = {text: text if want is None else want for text, want in texts.items()}
    assert {text: redact_text(text) for text in texts} == texts
    assert [t for t in texts.values() if redact_text(t) != t] == []     # idempotent
    argv = ["env.kwargs={api_key: sk-live-999999}", "+env.kwargs.servers=[{token: t-1}, {n: x}]",
            "env.kwargs.accessToken=tok-2", "--clientSecret", "cs-3", "--header",
            "Authorization: Bearer sk-4", "data.sizes=[1,2]", "env.kwargs={tokenizer: q}"]
    assert redact_argv(argv) == [
        f"env.kwargs={{api_key: {MASK}}}", f"+env.kwargs.servers=[{{token: {MASK}}}, {{n: x}}]",
        f"env.kwargs.accessToken={MASK}", "--clientSecret", MASK, "--header",
        f"Authorization: Bearer {MASK}", "data.sizes=[1,2]", "env.kwargs={tokenizer: q}"]
    tree = {"accessToken": "a-5", "headers": {"Authorization": "Bearer sk-6", "X-Api-Key": "k"},
            "note": "Bearer sk-7", "maxNewTokens": 64, "tokenizer": "tok"}
    assert redact_tree({"kwargs": tree}, "env") == {"kwargs": {
        "accessToken": MASK, "headers": {"Authorization": MASK, "X-Api-Key": MASK},
        "note": f"Bearer {MASK}", "maxNewTokens": 64, "tokenizer": "tok"}}
    # a library message quoting the bare credential of a string value is scrubbed too
    cfg = load_config(RLConfig, ["env.kwargs.note='Authorization: Bearer sk-note-Kd2'",
                                 "env.kwargs.url='https://u:p@ss/wd@h'"])[0]
    assert secret_values(cfg) == ["sk-note-Kd2", "u:p@ss/wd", "p@ss/wd"]   # longest first
    assert scrub("401: key sk-note-Kd2 refused", secret_values(cfg)) == f"401: key {MASK} refused"


@pytest.mark.parametrize("override,secret", [
    ("env.agent_api_key=[sk-agent-1]", "sk-agent-1"),          # OmegaConf quotes the list
    ("env.kwargs={api_key: sk-live-999999", "sk-live-999999"),   # hydra quotes the bad text
])
def test_config_errors_quoting_an_override_are_scrubbed(override, secret):
    """Hydra's and OmegaConf's own errors quote the override's text: the ConfigError carries
    `***` in its place (engine.config.loading._override_secrets, redact_text), and still says
    where the bad value came from."""
    from engine.config.loading import load_config
    from engine.errors import ConfigError
    from engine.rl.config import RLConfig

    with pytest.raises(ConfigError) as info:
        load_config(RLConfig, [override])
    assert secret not in str(info.value) and "***" in str(info.value)
    assert "on the command line" in str(info.value)
