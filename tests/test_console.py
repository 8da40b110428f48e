"""The `megatron-sft-engine` console command (tools/cli.py) as `pip install -e .` installs it,
and the package boundary: nothing outside tests/ imports tests or pytest, so the demos and tools
run in an environment without the test extra. (A default run's output has no library warning:
tests/test_checkpointing.py's resume launch.)"""
from __future__ import annotations

import ast
import os
import re
import shutil
import sys
import sysconfig
from pathlib import Path

import pytest

from engine.config.help import version
from tests.launch import _run
from tools import cli

REPO = Path(__file__).resolve().parents[1]


def installed_script(name: str = "megatron-sft-engine") -> str | None:
    """The console script pip installed for this interpreter: beside it, in its scheme's or
    the user scheme's scripts folder (`pip install --user`), else on PATH."""
    folders = [Path(sys.executable).parent, Path(sysconfig.get_path("scripts")),
               Path(sysconfig.get_path("scripts", f"{os.name}_user"))]
    for folder in folders:
        if (folder / name).is_file():
            return str(folder / name)
    return shutil.which(name)


def _console(*args: str, env: dict | None = None, timeout: int = 300):
    exe = installed_script()
    assert exe, "megatron-sft-engine is not installed: `pip install -e .` installs it (setup.py)"
    return _run([exe, *args], timeout, env)


def test_installed_command_answers_version_and_help():
    """The installed script itself: --version, the overview (exit 2 without a subcommand, as
    a usage error), and `sft --help` with the schema's keys."""
    proc = _console("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"megatron-sft-engine {version()}"
    assert version() == "0.2.0"
    proc = _console()
    assert proc.returncode == 2 and "subcommands:" in proc.stdout
    proc = _console("sft", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: megatron-sft-engine sft [--nproc-per-node N]")
    assert "  train.max_steps" in proc.stdout and "error" not in proc.stderr


@pytest.mark.parametrize("sub, expect", [
    ("rl", "  rollout.backend"), ("dpo", "  dpo.loss_type"),
    ("validate", "usage: megatron-sft-engine validate {sft,rl,dpo,rm,kto}"),
    ("convert", "{hf-to-mcore,mcore-to-hf,verify}"), ("bench", "overhead,balance,rollout"),
    ("rm", "  rm.center_rewards_coefficient"), ("kto", "  kto.undesirable_weight"),
    ("demo", "assets,model,addition-data,rm-data,tools-data,counting-data,"
             "counting-evaluate,evaluate"),
    ("serve", "--model DIR")])
def test_every_subcommand_has_help(sub, expect, capsys, monkeypatch):
    """`SUBCOMMAND --help` of each, in this process (tools.cli.main): exit 0 and its text."""
    monkeypatch.setattr(sys, "argv", ["megatron-sft-engine"])
    try:
        code = cli.main([sub, "--help"])
    except SystemExit as e:  # argparse's --help
        code = e.code
    out = capsys.readouterr().out
    assert code == 0 and expect in out, out[:400]
    assert f"megatron-sft-engine {sub}" in out


def _help(argv: list[str], capsys, monkeypatch) -> str:
    monkeypatch.setattr(sys, "argv", ["megatron-sft-engine"])
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's --help
        code = e.code
    assert code == 0, argv
    return capsys.readouterr().out


def test_each_help_describes_its_own_options(capsys, monkeypatch):
    """The new-user walk's help findings (each fails on the previous code): `validate sft
    --help` prints validate's flags, not sft's keys; `convert --help` shows the console
    command in its examples (the script's own --help keeps `python tools/convert.py`); every
    option of every `demo` subcommand (`demo evaluate`'s among them) has a meaning; `serve
    --help` names the n bound (--max-n) and each of vLLM's sampling fields it takes."""
    from engine.api.sampling_fields import FIELDS
    from tools.convert import main as convert_main
    from tools.demo import build_parser

    for argv in (["validate", "sft", "--help"], ["validate", "--help"]):
        out = _help(argv, capsys, monkeypatch)
        assert out.startswith("usage: megatron-sft-engine validate {sft,rl,dpo,rm,kto}")
        assert "  --world-size N" in out and "  --gpus-per-node G" in out and "  --json" in out
        assert "train.max_steps" not in out
    out = _help(["convert", "--help"], capsys, monkeypatch)
    assert "megatron-sft-engine convert hf-to-mcore --hf-dir H --out C" in out
    assert "megatron-sft-engine convert --nproc-per-node T*P*D verify" in out
    assert "tools/convert.py" not in out.replace("tools/convert_reward.py", "")
    with pytest.raises(SystemExit):
        convert_main(["--help"])
    assert "python tools/convert.py mcore-to-hf" in capsys.readouterr().out
    subparsers = build_parser()._subparsers._group_actions[0].choices
    silent = [f"{name} {action.dest}" for name, sub in subparsers.items()
              for action in sub._actions if action.dest != "help" and not action.help]
    assert silent == [] and len(subparsers) == 8
    out = _help(["demo", "evaluate", "--help"], capsys, monkeypatch)
    assert "tokens of each greedy reply, per turn" in out
    out = " ".join(_help(["serve", "--help"], capsys, monkeypatch).split())
    assert "--max-n N" in out and "n (at most --max-n)" in out
    assert [f for f in FIELDS if f not in out] == [] and len(FIELDS) == 9


def test_unknown_subcommand_and_bad_nproc_are_refused(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["megatron-sft-engine"])
    assert cli.main(["train"]) == 2
    assert "unknown subcommand 'train'; valid: sft, rl, dpo, rm, kto, validate, convert, bench, " \
        "demo, serve" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.pop_nproc(["--nproc-per-node", "0", "x=1"])
    assert e.value.code == 2
    argv = ["a=1", "--nproc-per-node=4", "b=2"]
    assert cli.pop_nproc(argv) == 4 and argv == ["a=1", "b=2"]
    assert cli.main(["validate", "x"]) == 2


def _imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_nothing_outside_tests_imports_tests_or_pytest():
    """engine/, models/, parallel/, tools/ and the recipes' scripts import neither `tests` nor
    `pytest` (a demo then runs without the test extra). Negative control: this file is caught."""
    offenders = [str(p.relative_to(REPO)) for d in ("engine", "models", "parallel", "tools")
                 for p in sorted((REPO / d).rglob("*.py"))
                 if _imported_roots(p) & {"tests", "pytest"}]
    offenders += [str(p.relative_to(REPO)) for p in sorted((REPO / "recipes").rglob("*.sh"))
                  if re.search(r"\bfrom tests\b|\bimport tests\b|\btests\.", p.read_text())]
    assert offenders == []
    assert {"tests", "pytest"} <= _imported_roots(Path(__file__))
