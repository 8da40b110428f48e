"""Preemption and crashes through the command line: SIGTERM / SIGINT during training save a
checkpoint that resumes, and a rank killed in the middle of a save leaves the run resumable
from the previous complete checkpoint (the torn save is never published). Real launches
(torchrun or python: signals, a killed rank, a resume across launches); the last resume, which
only has to finish the run, and the uninterrupted reference run use the session's rank pool
(tests/pool.py: each a case that starts as a fresh launch would, reading the checkpoint from
disk)."""
from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest

from engine.checkpoint.io import (checkpoint_problems, iteration_dir, read_latest,
                                  staging_dir)
from tests.launch import run_torchrun, start, torchrun_cmd, wait


@pytest.fixture(scope="module")
def assets(demo_assets):
    return demo_assets


def _args(assets, run_dir: Path, max_steps: int, *extra) -> list[str]:
    return ["-m", "engine.sft", f"model.hf_path={assets / 'model'}",
            f"data.train_files=[{assets / 'sft_train.jsonl'}]", "train.global_batch_size=8",
            "train.micro_batch_size=4", "train.seq_length=64", f"train.max_steps={max_steps}",
            "optim.lr=1e-3", "optim.schedule=constant", "optim.eps=1e-4",
            "logging.progress_bar=false", f"logging.dir={run_dir}",
            f"checkpoint.dir={run_dir / 'ckpt'}", *extra]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _signal_after_steps(cmd: list[str], run_dir: Path, sig: int, steps: int = 3):
    """Start `cmd`, send `sig` to it once metrics.jsonl holds `steps` rows, wait for it."""
    proc = start(cmd)
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            break
        time.sleep(0.02)
    proc.send_signal(sig)
    return wait(proc, 240)


def _assert_saved_on_signal(proc, run_dir: Path, name: str) -> int:
    """The run stopped after step N on the signal with a complete checkpoint of N; returns N."""
    assert f"[stop] {name} received: finishing the current step" in proc.stdout
    done = int(proc.stdout.split("stopping after step ")[1].split(":")[0])
    assert f"stopping after step {done}: exit signal received" in proc.stdout
    ckpt = run_dir / "ckpt"
    assert read_latest(ckpt) == done and checkpoint_problems(iteration_dir(ckpt, done)) == []
    assert [r["step"] for r in _rows(run_dir)] == list(range(1, done + 1))
    return done


STEPS = 10   # every launch's train.max_steps (the uninterrupted run's too); saves every 2


def test_sigterm_saves_a_checkpoint_that_resumes_and_a_rank_killed_during_save_does_not_tear_it(
        pools, assets, tmp_path):
    """One run through three torchrun launches (2 ranks), against an uninterrupted run.
    1. torchrun gets SIGTERM once step 3 is logged (after the save of step 2: every launch
       saves every 2 steps), as from a cluster scheduler: it forwards the signal, the workers
       finish the step N, save and exit 0 (torchrun itself then exits 1, reporting the signal
       it received).
    2. The next launch resumes from N, and rank 1
       is SIGKILLed inside the save of the next interval step K
       (engine.checkpoint.fault_injection): the job fails, iter K stays an unpublished
       staging directory, `latest` still names N.
    3. The relaunch (on the rank pool, saving a third torchrun start) resumes from N again
       and finishes: steps N+1..STEPS equal those of an uninterrupted run, and the staging
       directory is gone."""
    run_dir, straight = tmp_path / "run", tmp_path / "straight"
    extra = ["checkpoint.save_interval=2"]
    # a save (step 2) before the signal: it starts the checkpoint writer's queue server, a
    # process of the job's group that the forwarded SIGTERM also reaches; before
    # engine.checkpoint.writer made it ignore the signal, the save on the signal failed
    # with BrokenPipeError
    proc = _signal_after_steps(torchrun_cmd(2, *_args(assets, run_dir, STEPS, *extra)), run_dir,
                               signal.SIGTERM)
    assert "got signal: 15" in proc.stderr       # torchrun's own report; no worker failed
    assert "exitcode" not in proc.stderr
    done = _assert_saved_on_signal(proc, run_dir, "SIGTERM")
    assert done < STEPS, done   # the signal came before the last step
    killed_at = done + 2 - done % 2   # the next save_interval step after `done`
    ckpt = run_dir / "ckpt"
    proc = run_torchrun(2, *_args(assets, run_dir, STEPS, *extra), timeout=300,
                        env={"ENGINE_FAULT_INJECT": f"save@1:{killed_at}"})
    assert proc.returncode != 0
    assert f"resumed from {iteration_dir(ckpt, done)}: {done} steps done" in proc.stdout
    assert f"[fault-injection] killing rank 1 at save, step {killed_at}" in proc.stdout
    assert read_latest(ckpt) == done and checkpoint_problems(iteration_dir(ckpt, done)) == []
    assert staging_dir(ckpt, killed_at).is_dir() and not iteration_dir(ckpt, killed_at).exists()

    resumed = pools.script(2, *_args(assets, run_dir, STEPS, *extra), timeout=300)
    assert resumed.returncode == 0
    assert f"resumed from {iteration_dir(ckpt, done)}: {done} steps done" in resumed.stdout
    assert pools.script(2, *_args(assets, straight, STEPS, *extra), timeout=300).returncode == 0
    got, want = _rows(run_dir), _rows(straight)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(got[done:], want[done:], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), a["step"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6), a["step"]
    assert read_latest(ckpt) == STEPS and not staging_dir(ckpt, killed_at).exists()


def test_sigint_single_process_saves_and_exits_0(assets, tmp_path):
    """Ctrl-C on `python -m engine.sft` (no launcher): exit code 0 and a complete checkpoint."""
    run_dir = tmp_path / "run"
    proc = _signal_after_steps([sys.executable, *_args(assets, run_dir, 100000)], run_dir,
                               signal.SIGINT)
    assert proc.returncode == 0
    _assert_saved_on_signal(proc, run_dir, "SIGINT")
