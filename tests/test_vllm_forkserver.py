"""The suite's server of vLLM worker processes (tests/vllm_forkserver.py): a child it forks runs
with its owner's environment and standard output at `start()` (negative control:
multiprocessing's own forkserver child keeps the server's environment), its exit code comes
back, and vLLM's executor takes the server's context only for a spawn start while
TESTS_VLLM_FORKSERVER names a socket."""
from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver as forkserver
import os
import sys

from engine.generation.vllm.process import WORKER_START
from tests.vllm_forkserver import CONTEXT, ENV, VLLM_FILES, install_client

PROBE = "VLLM_FORKSERVER_PROBE"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_server_files_exist():
    """A renamed vLLM file would silently lose the server (its engines spawned again)."""
    assert [f for f in VLLM_FILES if not os.path.isfile(os.path.join(REPO, f))] == []


def report(path: str, code: int) -> None:
    """A child's target: its PROBE variable and parent pid into `path`, a line to stdout."""
    with open(path, "w") as f:
        f.write(f"{os.environ.get(PROBE)} {os.getppid()}")
    print("a line on the owner's stdout", flush=True)
    sys.exit(code)


def _start(context, path, code: int, stdout_file) -> int:
    saved = os.dup(1)
    os.dup2(stdout_file.fileno(), 1)
    try:
        child = context.Process(target=report, args=(str(path), code))
        child.start()
        child.join(120)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    return child.exitcode


def test_a_child_runs_with_its_owners_environment_and_output(vllm_worker_server, tmp_path,
                                                              monkeypatch):
    assert vllm_worker_server   # the session started it (this file is in VLLM_FILES)
    monkeypatch.setenv(PROBE, "set after the server started")
    with open(tmp_path / "stdout", "w") as out:
        assert _start(CONTEXT, tmp_path / "env", 3, out) == 3
    value, parent = (tmp_path / "env").read_text().rsplit(" ", 1)
    assert value == "set after the server started"
    assert int(parent) == forkserver._forkserver._forkserver_pid   # forked by the server
    assert (tmp_path / "stdout").read_text() == "a line on the owner's stdout\n"
    # negative control: multiprocessing's own forkserver child has the server's environment
    with open(tmp_path / "stdout_plain", "w") as out:
        assert _start(multiprocessing.get_context("forkserver"), tmp_path / "plain", 0, out) == 0
    assert (tmp_path / "plain").read_text().split()[0] == "None"
    assert (tmp_path / "stdout_plain").read_text() == ""


def test_vllms_executor_takes_the_servers_context_only_while_the_variable_names_it(
        vllm_worker_server, monkeypatch):
    install_client()
    from vllm.v1.executor import multiproc_executor

    monkeypatch.setenv(WORKER_START, "spawn")   # as engine_process_env sets it
    assert multiproc_executor.get_mp_context() is CONTEXT
    monkeypatch.setenv(ENV, "0")
    assert multiproc_executor.get_mp_context().get_start_method() == "spawn"
    monkeypatch.delenv(ENV)
    assert multiproc_executor.get_mp_context().get_start_method() == "spawn"
    monkeypatch.setenv(ENV, vllm_worker_server)
    monkeypatch.setenv(WORKER_START, "fork")   # a method other than spawn is left alone
    assert multiproc_executor.get_mp_context().get_start_method() == "fork"
