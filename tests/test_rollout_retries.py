"""Rollout backend failures: retried a bounded number of times (same result as a first-time
success: sampling is seeded per generation batch), then reported clearly on every rank."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from engine.config.schema import ConfigError, load_config
from engine.rl.checks import validate_rl
from engine.rl.collect.collector import RolloutCollector
from engine.rl.config import RLConfig
from engine.generation.pool import RolloutFailed
from tests.flaky_rollout import BrokenHFEngine, FlakyHFEngine
from tools.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("retry_model") / "qwen3"), "qwen3",
                            initializer_range=0.2)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("retry_data") / "add.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"what is {i % 10} plus {i % 7} ?",
                                        "answer": i % 10 + i % 7}) + "\n" for i in range(16)))
    return str(path)


def _collector(engine_cls, model_dir, *argv):
    from transformers import AutoTokenizer

    from engine.rl.rewards import load_reward_fn

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [{"prompt": f"what is {a} plus {b} ?", "answer": str(a + b)} for a, b in
            [(1, 2), (3, 4), (2, 2), (5, 1)]]
    cfg, _ = load_config(RLConfig, ["rollout.n=2", "train.prompts_per_step=2",
                                    "rollout.max_new_tokens=4", "train.seq_length=64",
                                    "rollout.retry_wait_s=0", *argv])
    return RolloutCollector(engine_cls(model_dir), rows, tokenizer, load_reward_fn("math"), cfg)


def test_transient_failures_are_retried_and_give_the_same_batch(model_dir, capsys,
                                                                monkeypatch):
    from engine.generation.hf.backend import HFRolloutEngine

    reference = _collector(HFRolloutEngine, model_dir).collect()
    monkeypatch.setenv("FLAKY_ROLLOUT_FAILURES", "2")
    batch = _collector(FlakyHFEngine, model_dir).collect()
    assert batch.response_ids == reference.response_ids
    assert batch.rollout_logprobs == reference.rollout_logprobs
    assert batch.metrics["rollout/retries"] == 2 and reference.metrics["rollout/retries"] == 0
    assert batch.metrics["rollout/generate_calls"] == 3
    out = capsys.readouterr().out
    assert out.count("[rollout] warning: generate failed on generation batch 0") == 2
    assert "(attempt 1 of 3): ConnectionError: simulated" in out


def test_too_many_failures_raise_a_clear_error(model_dir, monkeypatch):
    monkeypatch.setenv("FLAKY_ROLLOUT_FAILURES", "2")
    with pytest.raises(RolloutFailed) as err:
        _collector(FlakyHFEngine, model_dir, "rollout.max_retries=1").collect()
    msg = str(err.value)
    assert "failed 2 times in a row on generation batch 0 (rollout.max_retries=1)" in msg
    assert "last error: ConnectionError: simulated" in msg
    with pytest.raises(RolloutFailed, match="failed 1 times .* RuntimeError: simulated: CUDA"):
        _collector(BrokenHFEngine, model_dir, "rollout.max_retries=0").collect()


def test_backend_class_errors_are_config_errors(model_dir, prompts_file):
    base = [f"model.hf_path={model_dir}", f"data.train_files=[{prompts_file}]"]
    for backend, needle in [("trtllm", "choose one of hf, vllm, sglang or give your own"),
                            ("no_such_pkg.mod:Engine", "cannot be loaded"),
                            ("tests.flaky_rollout:os", "not a subclass of")]:
        cfg, _ = load_config(RLConfig, [*base, f"rollout.backend={backend}"])
        with pytest.raises(ConfigError, match=re.escape(needle)):
            validate_rl(cfg, 1)
    cfg, _ = load_config(RLConfig, [*base, "rollout.max_retries=-1"])
    with pytest.raises(ConfigError, match="rollout.max_retries=-1 must be an integer >= 0"):
        validate_rl(cfg, 1)


def _cli(pools, model_dir, prompts_file, log_dir, backend):
    """`torchrun --nproc_per_node 2 -m engine.rl ...` on the session's rank pool; every
    rank's output joined, `exit_codes` the workers' own."""
    run = pools.script(
        2, "-m", "engine.rl", f"model.hf_path={model_dir}", f"data.train_files=[{prompts_file}]",
        f"rollout.backend=tests.flaky_rollout:{backend}", "rollout.retry_wait_s=0.1",
        "rollout.n=2", "rollout.max_new_tokens=4", "train.prompts_per_step=2",
        "train.max_steps=2", "train.seq_length=64", "kl.beta=0", f"logging.dir={log_dir}",
        "logging.progress_bar=false", timeout=300, check=False)
    proc = run.merged()
    proc.exit_codes = [r.exit_code for r in run.ranks]
    return proc


def test_cli_retries_then_trains_and_reports_a_dead_backend(pools, model_dir, prompts_file,
                                                            tmp_path):
    ok = _cli(pools, model_dir, prompts_file, tmp_path / "flaky", "FlakyHFEngine")
    assert ok.returncode == 0
    rows = [json.loads(line) for line in
            Path(tmp_path / "flaky" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/retries"] for r in rows] == [2.0, 0.0]
    assert ok.stdout.count("retrying in") == 2 and "retrying in 0.2 s" in ok.stdout

    dead = _cli(pools, model_dir, prompts_file, tmp_path / "dead", "BrokenHFEngine")
    assert dead.returncode != 0 and dead.exit_codes == [1, 1]
    assert dead.stderr.count("error: rollout backend 'tests.flaky_rollout:BrokenHFEngine' "
                             "failed 3 times in a row") == 1
    assert "illegal memory access" in dead.stderr
    assert not re.search(r'File ".*/(engine|models|parallel)/', dead.stderr)
