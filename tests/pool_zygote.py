"""Rank processes forked from one process that has imported the heavy modules already.

Starting a rank process costs an interpreter start and the import of torch, megatron-core and
transformers: about 6 CPU-seconds each on a 2-core host, paid by every rank of every pool start
(1, 2, 3, 4 and 8 ranks, again after each failed case). A `Zygote` is one process that imports
`tests.pool.PRELOAD` once and forks each rank from itself; a forked rank then runs
`tests.pool._worker_main` exactly as a started one does (its own session, its torchrun
environment, its log file as stdout and stderr, fresh seeds for random, numpy and torch, as a
new interpreter would draw).

Fork safety: the zygote imports modules only; it starts no thread, opens no process group and
touches no device (the imports start none: checked with one thread in /proc/self/task). Its
environment is the pool's base environment; a rank's own variables (RANK, MASTER_PORT, ...) are
set after the fork, so only what a module reads at import time is the zygote's, and the zygote
is restarted when the base environment changes (pytest's name of the current test aside:
PER_TEST_KEYS).

    python -m tests.pool_zygote     (stdin: one JSON request per line; stdout: one pid per line)
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def rank_keys() -> set[str]:
    """The rank-specific variables (tests.pool.torchrun_env and the pool socket), set in each
    forked rank; OMP_NUM_THREADS is the same for every rank and is read when torch loads, so
    it stays the zygote's own."""
    from tests.pool import torchrun_env

    return (set(torchrun_env(0, 1, "0")) - {"OMP_NUM_THREADS"}) | {"RANK_POOL_SOCKET",
                                                                   "RANK_POOL_KEY"}


# Variables that change from test to test and that no module reads at import time: left out
# of the environment the zygote is compared on (a forked rank gets them with its own
# environment all the same). PYTEST_CURRENT_TEST differs in every test and in each test's
# setup and call: compared, it restarted the zygote (5-6 s of imports) at every pool start.
PER_TEST_KEYS = frozenset({"PYTEST_CURRENT_TEST"})


class ForkedRank:
    """A rank process forked by the zygote, with the part of subprocess.Popen's interface the
    pool uses (pid, poll, wait). Its exit code comes from the file the zygote writes when it
    reaps the process (-1 if that file is missing)."""

    def __init__(self, pid: int, exit_file: str) -> None:
        self.pid, self.exit_file, self.returncode = pid, exit_file, None

    def poll(self):
        if self.returncode is None and not _alive(self.pid):
            for _ in range(200):  # the zygote writes the code right after reaping (a busy
                # host may delay its SIGCHLD handler: up to 2 s)
                if os.path.exists(self.exit_file):
                    break
                time.sleep(0.01)
            try:
                self.returncode = int(Path(self.exit_file).read_text())
            except (OSError, ValueError):
                self.returncode = -1
        return self.returncode

    def wait(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked rank {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Zygote:
    """The manager's handle on the zygote process (started on first use, one per session)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir, self.proc, self.env = log_dir, None, None
        self.lock = threading.Lock()
        self.forks = 0

    def _start(self, env: dict[str, str]) -> None:
        self.close()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / "zygote.log", "a")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.pool_zygote"], cwd=REPO_ROOT,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=log, text=True, start_new_session=True)
        log.close()
        if self.proc.stdout.readline().strip() != "ready":
            self.close()
            raise RuntimeError(f"the rank zygote did not start (see {self.log_dir}/zygote.log)")
        self.env = env

    def fork(self, rank_env: dict[str, str], log_path: Path) -> ForkedRank:
        """A rank process with environment `rank_env` (the base environment plus the rank's
        own variables), stdout and stderr to `log_path`."""
        own = rank_keys() | PER_TEST_KEYS
        base = {k: v for k, v in rank_env.items() if k not in own}
        with self.lock:
            if self.proc is None or self.proc.poll() is not None or base != self.env:
                self._start(base)
            self.forks += 1
            exit_file = str(self.log_dir / f"exit{self.forks}")
            self.proc.stdin.write(json.dumps({"env": rank_env, "log": str(log_path),
                                              "exit_file": exit_file}) + "\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline().strip()
        if not answer.isdigit():
            raise RuntimeError(f"the rank zygote did not fork a rank ({answer!r})")
        return ForkedRank(int(answer), exit_file)

    def close(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(OSError, ValueError):
                self.proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


def _reap(exit_files: dict[int, str]):
    """SIGCHLD handler of the zygote: reap every finished rank, write its exit code."""
    def handler(signum, frame):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            path = exit_files.pop(pid, None)
            if path is not None:
                with contextlib.suppress(OSError):
                    Path(path).write_text(str(os.waitstatus_to_exitcode(status)))
    return handler


def _run_forked(request: dict) -> None:
    """In the forked child: become a fresh rank process, then run the pool's worker."""
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(devnull)
    os.close(log)
    sys.stdin = open(os.devnull)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(request["env"])
    import random

    import numpy as np
    import torch

    random.seed()
    np.random.seed()
    torch.seed()
    from tests.pool import _worker_main

    _worker_main()


def main() -> None:
    sys.path.insert(0, str(REPO_ROOT))
    import parallel  # noqa: F401  (megatron's jit fuser off before megatron loads)
    from tests.pool import freeze_heap, preload

    preload()  # a failed import is tried again (and reported) by the rank itself
    freeze_heap()   # inherited by every rank: shared pages, collections skip the imports
    exit_files: dict[int, str] = {}
    signal.signal(signal.SIGCHLD, _reap(exit_files))
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])  # no reap before it is filed
        pid = os.fork()
        if pid == 0:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
            code = 1
            try:
                _run_forked(request)
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:  # noqa: BLE001
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        exit_files[pid] = request["exit_file"]
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
        print(pid, flush=True)
    gc.unfreeze()   # an ordinary exit: nanobind reports objects still alive at exit as leaks


if __name__ == "__main__":
    main()
