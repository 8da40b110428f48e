"""`engine.dpo` through the command line, as a user runs it (`-m engine.dpo` on the ranks of the
session's rank pool, as torchrun runs it): the demo's preference files (tools/demo.py), metrics
under TRL's names, evaluation on held-out pairs, a resume, a bad row refused by file and line
before any step, `--help`, `--validate` of the H100 recipes. The layouts and the math:
tests/test_dpo.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch import run_cli
from tests.metrics_docs import undocumented

REQUIRED = ("step", "loss", "grad_norm", "lr", "rewards/chosen", "rewards/rejected",
            "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected", "nll",
            "num_pairs", "time/reference_s", "data/consumed_pairs")


def _args(assets, log_dir, steps, *extra):
    return ["-m", "engine.dpo", f"model.hf_path={assets / 'model'}",
            f"data.train_files=[{assets / 'dpo_train.jsonl'}]",
            f"data.eval_files=[{assets / 'dpo_eval.jsonl'}]", "train.eval_interval=2",
            "train.global_batch_size=8", "train.micro_batch_size=2", "train.seq_length=64",
            f"train.max_steps={steps}", "optim.lr=1e-3", "optim.schedule=constant",
            "dpo.rpo_alpha=0.2", "logging.progress_bar=false", f"logging.dir={log_dir}",
            f"checkpoint.dir={log_dir / 'ckpt'}", "checkpoint.save_interval=2", *extra]


def _metrics(log_dir):
    return [json.loads(line) for line in Path(log_dir, "metrics.jsonl").read_text().splitlines()]


def test_run_logs_trl_metrics_evaluates_and_resumes(pools, demo_assets, tmp_path):
    proc = pools.script(2, *_args(demo_assets, tmp_path, 2), timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "[dpo] loss: sigmoid, beta 0.1; reference: a frozen copy" in proc.stdout
    assert "preference pairs from" in proc.stdout
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in REQUIRED:
            assert key in r, key
        assert r["num_pairs"] == 8 and 0 <= r["rewards/accuracies"] <= 1
    # step 1: the policy is the reference, every log-ratio 0: the sigmoid loss is log 2 plus
    # RPO's 0.2 x nll, and the rewards are 0
    assert rows[0]["loss"] == pytest.approx(0.6931471805599453 + 0.2 * rows[0]["nll"], rel=1e-5)
    assert rows[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert "eval/rewards/accuracies" in rows[1] and "eval/loss" in rows[1]
    assert undocumented({k for r in rows for k in r}) == []   # docs/metrics.md names them all
    resumed = pools.script(2, *_args(demo_assets, tmp_path, 3), timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["data/consumed_pairs"] == 24


def test_bad_row_is_refused_by_file_and_line_before_any_step(pools, demo_assets, tmp_path):
    bad = tmp_path / "bad.jsonl"
    good = (demo_assets / "dpo_train.jsonl").read_text().splitlines()[0]
    bad.write_text(good + "\n" + json.dumps({"prompt": "what is 1 + 1 ?", "chosen": "2"}) + "\n")
    args = _args(demo_assets, tmp_path, 2)
    args[3] = f"data.train_files=[{bad}]"
    proc = pools.script(1, *args, timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr
    assert f"{bad}:2" in proc.stderr and "rejected" in proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_help_lists_the_dpo_keys():
    proc = run_cli("engine.dpo", "--help")
    assert proc.returncode == 0
    for key in ("dpo.loss_type", "dpo.beta", "dpo.label_smoothing", "dpo.rpo_alpha",
                "dpo.simpo_gamma", "dpo.ref_path", "train.global_batch_size"):
        assert key in proc.stdout, key


@pytest.mark.parametrize("recipe,reference", [
    ("recipes/dpo/qwen3_8b_dpo_h100.yaml", "GiB per GPU (a frozen copy"),
    ("recipes/dpo/llama31_70b_lora_dpo_h100.yaml", "adapters off"),
])
def test_h100_recipes_validate(recipe, reference):
    proc = run_cli("engine.dpo", "--config", recipe, "--validate")
    assert proc.returncode == 0, proc.stderr
    assert "pairs: 64 per step (128 sequences), 1 per micro-batch" in proc.stdout
    assert f"reference: " in proc.stdout and reference in proc.stdout, proc.stdout
