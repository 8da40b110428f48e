"""`engine.sft` through the command line, as a user runs it (`-m engine.sft` on the ranks of the
session's rank pool, tests/pool.py, as torchrun runs it): metrics files, CP/packing/balancing
layouts matching the single-process run. Configuration and data errors:
tests/test_cli_errors.py; real torchrun launches of engine.sft: tests/test_preemption.py."""
import json
from pathlib import Path

import pytest

from tests.metrics_docs import undocumented


STEPS = 3
REQUIRED = ("step", "loss", "grad_norm", "lr", "num_tokens", "num_sequences", "time/step_s",
            "throughput/tokens_per_s", "batch/dp_imbalance", "batch/padding_fraction")


@pytest.fixture(scope="module")
def assets(demo_assets):
    return demo_assets


def _args(assets, log_dir, *extra):
    return ["-m", "engine.sft", f"model.hf_path={assets / 'model'}",
            f"data.train_files=[{assets / 'sft_train.jsonl'}]", "train.global_batch_size=16",
            "train.micro_batch_size=4", "train.seq_length=64", f"train.max_steps={STEPS}",
            "optim.lr=1e-3", "optim.schedule=constant", "optim.eps=1e-4",
            "logging.progress_bar=false", f"logging.dir={log_dir}", *extra]


def _metrics(log_dir):
    return [json.loads(line) for line in Path(log_dir, "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(pools, assets, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("ref_log")
    proc = pools.script(1, *_args(assets, log_dir), timeout=600)
    assert proc.returncode == 0
    return _metrics(log_dir), log_dir


def test_metrics_jsonl_and_tensorboard_written(reference):
    rows, log_dir = reference
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        for key in REQUIRED:
            assert key in r, key
        assert r["num_sequences"] == 16 and r["num_tokens"] > 0
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert any(p.name.startswith("events.out.tfevents") for p in Path(log_dir).iterdir())
    assert undocumented({k for r in rows for k in r}) == []   # docs/metrics.md names them all


@pytest.mark.parametrize("nproc,extra", [
    # CP8 runs in tests/test_sft_invariance.py's 8-rank launch (an 8-rank CLI run cost 41 s)
    (2, ["parallel.cp=2"]),
    # Megatron sequence parallelism (explicit; null would turn it on at tp 2 too) and full
    # activation recomputation, on top of Ulysses CP
    (4, ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
         "train.recompute=full"]),
    (4, ["parallel.cp=2", "train.packing=true", "train.max_tokens_per_micro_batch=96"]),
])
def test_cli_layouts_match_single_process(pools, assets, reference, tmp_path, nproc, extra):
    ref_rows, _ = reference
    proc = pools.script(nproc, *_args(assets, tmp_path, *extra), timeout=600)
    assert proc.returncode == 0
    if "train.recompute=full" in extra:  # the settings reached megatron's TransformerConfig
        assert ("[sft] model: sequence parallelism on, recompute full (uniform, 1 layer(s))"
                in proc.stdout)
    rows = _metrics(tmp_path)
    for a, b in zip(rows, ref_rows):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (extra, a["step"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (extra, a["step"])
    assert len(rows) == STEPS
