"""The CPU demo scripts that pass their arguments on to the engine (recipes/cpu_demo.sh,
dpo_cpu_demo.sh, kto_cpu_demo.sh) print the folder the run really logged to: a
`logging.dir=...` given on the command line wins over the script's own, as it does for the
engine (hydra's last override). Run with a stand-in `megatron-sft-engine` on PATH that records
its arguments and does nothing else (no training: milliseconds)."""
from __future__ import annotations

import os
import subprocess

import pytest

from tests.pool import REPO_ROOT

STUB = """#!/usr/bin/env bash
printf '%s\\n' "$*" >> "$CALLS"
"""
DEMOS = {"cpu_demo.sh": "cpu_demo", "dpo_cpu_demo.sh": "dpo_cpu_demo",
         "kto_cpu_demo.sh": "kto_cpu_demo"}


def _run(tmp_path, script: str, *args: str) -> tuple[str, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stub = bin_dir / "megatron-sft-engine"
    stub.write_text(STUB)
    stub.chmod(0o755)
    calls = tmp_path / "calls.txt"
    calls.write_text("")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls),
           "OUT": str(tmp_path / "out")}
    proc = subprocess.run(["bash", str(REPO_ROOT / "recipes" / script), *args], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, calls.read_text().splitlines()


@pytest.mark.parametrize("script", sorted(DEMOS))
def test_demo_prints_the_logging_dir_it_was_given(script, tmp_path):
    default = tmp_path / "out" / DEMOS[script]
    out, calls = _run(tmp_path, script)
    assert f"metrics: {default}/metrics.jsonl  (tensorboard --logdir {default})" in out
    mine = tmp_path / "elsewhere" / "orpo"
    out, calls = _run(tmp_path, script, "dpo.beta=0.2", f"logging.dir={mine}")
    assert f"metrics: {mine}/metrics.jsonl  (tensorboard --logdir {mine})" in out, out
    assert str(default) + "/metrics" not in out
    [train] = [c for c in calls if "--nproc-per-node" in c]
    assert train.endswith(f"logging.dir={mine}")   # the engine gets it last: it wins there too
