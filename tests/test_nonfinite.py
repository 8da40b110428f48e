"""Non-finite loss or gradient: the step is skipped without a trace, counted, and a run that
keeps diverging stops with a clear message (engine.training.nonfinite). Multi-rank runs on the
session's rank pool (tests/pool.py): the harness script and the command lines as torchrun runs
them (a run's exit code is the workers' own, every rank's stderr joined)."""
import json
import math
import re
from pathlib import Path

import pytest

from engine.training.nonfinite import NonFiniteGuard, TrainingDiverged
from tests.launch import result_lines
from tools.tiny_models import build_tiny_model


def test_guard_counts_streaks_and_raises_at_the_limit():
    guard = NonFiniteGuard(limit=3, skipped=2)
    guard.record(5, False, float("nan"), float("nan"))
    guard.record(6, False, 1.0, float("inf"))
    guard.record(7, True, 1.0, 0.5)            # a good step ends the streak
    guard.record(8, False, float("nan"), 1.0)
    guard.record(9, False, float("nan"), 1.0)
    assert guard.skipped == 6 and not guard.diverged
    guard.raise_if_diverged()
    guard.record(10, False, float("inf"), float("nan"))
    assert guard.diverged
    with pytest.raises(TrainingDiverged) as err:
        guard.raise_if_diverged()
    msg = str(err.value)
    assert msg.startswith("3 optimizer steps in a row had a non-finite loss or gradient")
    assert "step 8: loss nan" in msg and "step 10: loss inf, grad_norm nan" in msg
    assert "weights are those before step 8" in msg
    assert "train.max_consecutive_nonfinite_steps=3" in msg and "optim.lr" in msg


def test_long_streaks_are_abbreviated():
    guard = NonFiniteGuard(limit=6)
    for step in range(1, 7):
        guard.record(step, False, float("nan"), float("nan"))
    msg = str(pytest.raises(TrainingDiverged, guard.raise_if_diverged).value)
    assert "step 1:" in msg and "step 2:" in msg and "..." in msg and "step 6:" in msg
    assert "step 4:" not in msg


def test_skipped_step_leaves_no_trace_in_every_layout(pools, tmp_path):
    """DP2 (distributed optimizer), TP2, PP2, DP2 with both overlaps on: a NaN step is
    skipped on every rank and the run
    then ends bitwise equal to one that never saw that batch; megatron's plain step (the
    negative control) writes NaN into the weights."""
    model = build_tiny_model(str(tmp_path / "model"), "qwen3", vocab_size=200,
                             initializer_range=0.1)
    proc = pools.script(2, "tests/multirank/nonfinite_guard.py", model, timeout=600)
    assert proc.returncode == 0
    results = {r["layout"]: r for r in result_lines(proc.stdout)}
    assert sorted(results) == ["dp2", "dp2_ov", "pp2", "tp2"]
    for name, r in results.items():
        assert r["skipped"] == [0.0, 1.0, 0.0], name
        assert r["skipped_steps"] == [0.0, 1.0, 1.0] and r["guard_skipped"] == 1, name
        assert math.isnan(r["poisoned_grad_norm"]), name
        assert r["scheduler_steps"] == [2, 2], name
        assert r["max_abs_diff"] == 0.0, name
        assert r["control_nonfinite"], name


@pytest.fixture(scope="module")
def assets(demo_assets):
    return demo_assets


def test_cli_blow_up_is_skipped_counted_and_stops(pools, assets, tmp_path):
    """optim.lr=1e30: step 1 is finite, the weights it writes overflow every later step. Steps
    2-3 are skipped and logged, then the run stops (limit 2) with the message, exit code 1."""
    run = pools.script(
        2, "-m", "engine.sft", f"model.hf_path={assets / 'model'}",
        f"data.train_files=[{assets / 'sft_train.jsonl'}]", "train.global_batch_size=8",
        "train.micro_batch_size=4", "train.seq_length=64", "train.max_steps=10",
        "train.max_consecutive_nonfinite_steps=2", "optim.lr=1e30", "optim.schedule=constant",
        "logging.progress_bar=false", f"logging.dir={tmp_path}", timeout=300, check=False)
    proc = run.merged()
    assert proc.returncode != 0
    assert [r.exit_code for r in run.ranks] == [1, 1]   # every worker exits 1
    assert ("error: 2 optimizer steps in a row had a non-finite loss or gradient (step 2: "
            in proc.stderr)
    assert proc.stderr.count("optimizer steps in a row") == 1  # rank 0 only
    assert not re.search(r'File ".*/(engine|models|parallel)/', proc.stderr)
    rows = [json.loads(line) for line in Path(tmp_path, "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["train/update_skipped"] for r in rows] == [0.0, 1.0, 1.0]
    assert [r["train/skipped_steps"] for r in rows] == [0.0, 1.0, 2.0]
    assert math.isfinite(rows[0]["grad_norm"]) and not math.isfinite(rows[1]["grad_norm"])


def test_rl_cli_blow_up_stops_after_logging_the_step(pools, assets, tmp_path):
    """GRPO with 3 optimizer steps per RL step and optim.lr=1e30: the first update overflows
    the weights, the next two are skipped; the RL step is logged, then the run stops (exit 1)."""
    run = pools.script(
        2, "-m", "engine.rl", f"model.hf_path={assets / 'model'}",
        f"data.train_files=[{assets / 'rl_prompts.jsonl'}]", "rollout.n=2",
        "rollout.max_new_tokens=4", "train.prompts_per_step=3", "train.mini_batches_per_step=3",
        "train.seq_length=64", "train.max_steps=3", "train.max_consecutive_nonfinite_steps=2",
        "kl.beta=0", "reward.fn=tests.test_rl_loop:digit_reward", "rollout.temperature=2.0",
        "optim.lr=1e30", "optim.schedule=constant", "logging.progress_bar=false",
        f"logging.dir={tmp_path}", timeout=300, check=False)
    proc = run.merged()
    assert proc.returncode != 0 and [r.exit_code for r in run.ranks] == [1, 1]
    assert "error: 2 optimizer steps in a row had a non-finite loss or gradient (step 2: " \
        in proc.stderr
    assert not re.search(r'File ".*/(engine|models|parallel)/', proc.stderr)
    rows = [json.loads(line) for line in Path(tmp_path, "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["train/skipped_steps"] == 2.0
    assert rows[0]["train/update_skipped"] == pytest.approx(2 / 3)
