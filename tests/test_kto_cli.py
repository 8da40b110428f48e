"""`engine.kto` through the command line, as a user runs it (`-m engine.kto` on the ranks of the
session's rank pool, as torchrun runs it): the CPU demo's unpaired files (tools/demo.py,
recipes/kto_cpu_demo.sh) at DP2, metrics under TRL's names, held-out metrics that move the
right way, a resume, a bad row refused by file and line before any step, `--validate` of the H100
recipe. The layouts and the math: tests/test_dpo.py (KTO section)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch import run_cli

REQUIRED = ("step", "loss", "grad_norm", "lr", "kl", "rewards/chosen", "rewards/rejected",
            "rewards/margins", "logps/chosen", "logps/rejected", "logits/chosen",
            "logits/rejected", "entropy", "num_examples", "num_desirable", "time/reference_s",
            "data/consumed_examples")


def _args(assets, log_dir, steps, *extra):
    return ["-m", "engine.kto", f"model.hf_path={assets / 'model'}",
            f"data.train_files=[{assets / 'kto_train.jsonl'}]",
            f"data.eval_files=[{assets / 'kto_eval.jsonl'}]", "train.eval_interval=4",
            "train.global_batch_size=16", "train.micro_batch_size=4", "train.seq_length=64",
            f"train.max_steps={steps}", "optim.lr=2e-4", "optim.schedule=constant",
            "logging.progress_bar=false", f"logging.dir={log_dir}",
            f"checkpoint.dir={log_dir / 'ckpt'}", "checkpoint.save_interval=8", *extra]


def _metrics(log_dir) -> list[dict]:
    return [json.loads(line) for line in Path(log_dir, "metrics.jsonl").read_text().splitlines()]


def test_demo_trains_held_out_margins_grow_and_resumes(pools, demo_assets, tmp_path):
    """Step 1: the policy is its own reference, so every log-ratio and the reference point are
    0 and the loss is 1 - sigmoid(0) = 0.5 exactly. The held-out rows (prompts never trained
    on, text rows) then move the right way: the desirable completions' implied reward rises
    above 0, the undesirable ones' falls below, their margin and the eval loss improve from
    step 4 to step 8. A resume from step 8's checkpoint continues the data stream."""
    proc = pools.script(2, *_args(demo_assets, tmp_path, 8), timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "[kto] beta 0.1, desirable_weight 1.0" in proc.stdout
    assert "160 unpaired examples (80 desirable, 80 undesirable" in proc.stdout
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 9))
    for r in rows:
        for key in REQUIRED:
            assert key in r, key
        assert r["num_examples"] == 16 and r["kl"] >= 0
    assert rows[0]["loss"] == pytest.approx(0.5, abs=1e-6)
    assert rows[0]["kl"] == 0 and rows[0]["rewards/margins"] == pytest.approx(0, abs=1e-6)
    first, last = rows[3], rows[7]
    assert last["eval/rewards/margins"] > first["eval/rewards/margins"] > 0, (first, last)
    assert last["eval/loss"] < first["eval/loss"] < 0.5, (first, last)
    assert last["eval/rewards/chosen"] > 0 > last["eval/rewards/rejected"], last
    assert last["loss"] < rows[0]["loss"]
    resumed = pools.script(2, *_args(demo_assets, tmp_path, 9), timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 10))
    assert rows[8]["data/consumed_examples"] == 144 and rows[8]["kl"] >= 0


def test_bad_row_is_refused_by_file_and_line_before_any_step(pools, demo_assets, tmp_path):
    bad = tmp_path / "bad.jsonl"
    good = (demo_assets / "kto_train.jsonl").read_text().splitlines()[0]
    bad.write_text(good + "\n" + json.dumps({"prompt": "what is 1 + 1 ?", "completion": "2",
                                             "label": "yes"}) + "\n")
    args = _args(demo_assets, tmp_path, 2)
    args[3] = f"data.train_files=[{bad}]"
    proc = pools.script(1, *args, timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr
    assert f"{bad}:2: field 'label' must be a boolean" in proc.stderr, proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_h100_recipe_validates_and_refusals_name_the_key():
    proc = run_cli("engine.kto", "--config", "recipes/kto/qwen3_8b_kto_h100.yaml", "--validate")
    assert proc.returncode == 0, proc.stderr
    assert "examples: 64 per step, 2 per micro-batch" in proc.stdout
    assert "reference: 7.6 GiB per GPU (a frozen copy" in proc.stdout, proc.stdout
    proc = run_cli("engine.kto", "--config", "recipes/kto/qwen3_8b_kto_h100.yaml", "--validate",
                   "kto.undesirable_weight=0", "train.global_batch_size=1",
                   "train.micro_batch_size=1")
    assert proc.returncode == 2
    assert "kto.undesirable_weight=0.0 must be a number > 0" in proc.stderr, proc.stderr
    assert "train.global_batch_size=1: KTO's KL reference point" in proc.stderr, proc.stderr
