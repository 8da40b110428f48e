"""Running model-written code contained (`reward.fn=code`; docs/rewards.md#the-sandbox).

Every run is engine.rl.rewards.code_runner (``python -I -S runner.py SPEC``) in a working
directory holding the run's files. Layers:

- ``workdir``: a fresh working directory with only the run's files, gone afterwards;
- ``empty-env``: the program's environment is empty;
- ``session``: a new session and process group, SIGKILLed at the run's deadline (without
  waiting for the kernel to end its processes: a thread reaps them);
- ``rlimits``: CPU seconds, address space, file size, open files and processes, set by the
  runner before any code of the row or the reply runs (no ``preexec_fn``);
- ``output-cap``: stdout and stderr read up to ``Limits.output_bytes`` each; past it the
  program is killed;
- ``bubblewrap``: the program runs in bwrap (engine.rl.rewards.bwrap): an empty read-only root
  with only the interpreter and the shared libraries, a private tmpfs /work, every namespace,
  uid 65534, no capability; RLIMIT_NPROC enforced per run; SIGKILLed with its scorer.

``reward.code_sandbox=strict`` refuses to start when a layer is missing (``missing_layers``);
``relaxed`` runs without bubblewrap (the program then runs as the trainer's uid in a host
temporary folder, sees the host's files and network, and a program may outlive a killed
scorer) and the run header says so.
"""
from __future__ import annotations

import functools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from engine.rl.rewards import bwrap

LAYERS = ("workdir", "empty-env", "session", "rlimits", "output-cap", "bubblewrap")
RUNNER = Path(__file__).with_name("code_runner.py")
PLAIN_DATA = Path(__file__).with_name("plain_data.py")
REAP_S = 60.0   # a killed bwrap not ended by then is SIGKILLed itself


@dataclass(frozen=True)
class Limits:
    """One program run's bounds (RLIMIT_AS etc.; output per stream)."""
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    open_files: int = 64
    processes: int = 64
    output_bytes: int = 1 << 20


@dataclass
class RunResult:
    """What a run gave: its exit status (None: killed by the sandbox), its capped output."""
    returncode: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    output_capped: bool = False


@functools.lru_cache(maxsize=None)
def missing_layers() -> dict[str, str]:
    """The layers this host cannot enforce, with the reason (probed once per process: a
    bwrap run of the interpreter)."""
    if shutil.which("bwrap") is None:
        return {"bubblewrap": f"bwrap is not installed: {bwrap.INSTALL_HINT}"}
    python = bwrap.interpreter()
    if python is None:
        return {"bubblewrap": f"no Python interpreter that uid {bwrap.RUN_UID} may run (tried "
                              f"{sys.executable}, /usr/bin/python3, /usr/local/bin/python3)"}
    try:
        done = subprocess.run(bwrap.command(python, {}, ["-I", "-S", "-c", "import json"]),
                              env={}, cwd="/", capture_output=True, timeout=60,
                              **bwrap.run_user())
    except (OSError, subprocess.SubprocessError) as e:
        return {"bubblewrap": f"bwrap cannot run here: {e}"}
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip()[:300]
        return {"bubblewrap": f"bwrap cannot run here ({why}); {bwrap.INSTALL_HINT}, and "
                              "allow unprivileged user namespaces"}
    return {}


def describe() -> str:
    """One line for the run header: the active layers and the missing ones."""
    missing = missing_layers()
    active = [name for name in LAYERS if name not in missing]
    text = f"code sandbox layers: {', '.join(active)}"
    if "bubblewrap" not in missing:
        python = bwrap.interpreter()
        text += f" (Python {python.version}, {python.executable})"
    return text + "".join(f"; missing: {k} ({v})" for k, v in missing.items())


def _spec(mode: str, cpu_s: float, limits: Limits, **extra) -> str:
    rlimits = {"RLIMIT_CPU": max(1, int(cpu_s + 0.999)), "RLIMIT_AS": limits.memory_bytes,
               "RLIMIT_FSIZE": limits.file_bytes, "RLIMIT_NOFILE": limits.open_files,
               "RLIMIT_NPROC": limits.processes, "RLIMIT_CORE": 0}
    return json.dumps({"mode": mode, "rlimits": rlimits, **extra})


class _Started:
    """One started sandbox: its process (bwrap, or the runner without it) and the host
    folder to remove afterwards (None with bwrap: its files live in its tmpfs)."""

    def __init__(self, files: dict[str, str], spec: str, pass_fds: tuple[int, ...] = (),
                 **streams) -> None:
        files = {"runner.py": RUNNER.read_text(), "plain_data.py": PLAIN_DATA.read_text(),
                 **files}
        argv = ["-I", "-S", "runner.py", spec]
        self.workdir = None
        common = dict(env={}, start_new_session=True, **streams)
        if missing_layers():
            self.workdir = tempfile.mkdtemp(prefix="reward-code-")
            for name, text in files.items():
                Path(self.workdir, name).write_text(text)
            self.proc = subprocess.Popen([sys.executable, *argv], cwd=self.workdir,
                                         pass_fds=pass_fds, **common)
            return
        fds = {}
        try:
            for name, text in files.items():
                fds[name] = os.memfd_create(name)
                os.write(fds[name], text.encode())
                os.lseek(fds[name], 0, os.SEEK_SET)
            self.proc = subprocess.Popen(
                bwrap.command(bwrap.interpreter(), fds, argv), cwd="/",
                pass_fds=(*pass_fds, *fds.values()), **common, **bwrap.run_user())
        finally:
            for fd in fds.values():
                os.close(fd)

    def stop(self) -> int | None:
        """End it: its exit status when it has exited (then reaped, its folder removed), else
        None: every process of it is SIGKILLed now and reaped by a thread (the kernel's end of
        a busy PID namespace can take seconds on a loaded host, past the call's budget)."""
        code = self.proc.poll()
        if code is None:
            _kill(self.proc, bubblewrap=self.workdir is None)
            threading.Thread(target=self._reap, name="sandbox-reaper", daemon=True).start()
        else:
            self._reap()
        return code

    def _reap(self) -> None:
        try:
            self.proc.wait(timeout=REAP_S)
        except subprocess.TimeoutExpired:   # bwrap did not end with its namespace's init
            _kill_group(self.proc)
            self.proc.wait()
        if self.workdir is not None:   # without bubblewrap: anything of its group left
            _kill_group(self.proc)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


def run_program(files: dict[str, str], mode: str, stdin: bytes, timeout_s: float,
                limits: Limits = Limits()) -> RunResult:
    """Run code_runner in ``mode`` (its docstring) with ``files`` (name -> text) in its working
    directory and ``stdin``, inside every layer this host has; SIGKILLed ``timeout_s`` after
    the call (its start-up included)."""
    deadline = time.monotonic() + timeout_s   # the start-up counts
    run = _Started(files, _spec(mode, timeout_s, limits), stdin=subprocess.PIPE,
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        return _communicate(run.proc, stdin, deadline, limits.output_bytes)
    finally:
        run.stop()


def run_harness(solution: str, test_code: str, timeout_s: float,
                limits: Limits = Limits()) -> RunResult:
    """An assert script: the solution served (code_runner ``serve``) in one sandbox, the test
    code run by the harness (code_runner ``harness``) in another, connected only by two pipes;
    the result is the harness's run (its stdout carries the verdict)."""
    deadline = time.monotonic() + timeout_s   # the start-up counts
    to_solution = os.pipe()
    to_harness = os.pipe()
    runs = []
    try:
        runs.append(_Started({"solution.py": solution}, _spec("serve", timeout_s, limits),
                             stdin=to_solution[0], stdout=to_harness[1],
                             stderr=subprocess.DEVNULL))
        spec = _spec("harness", timeout_s, limits, requests=to_solution[1],
                     responses=to_harness[0], line_bytes=limits.output_bytes)
        runs.append(_Started({"test_code.py": test_code}, spec,
                             pass_fds=(to_solution[1], to_harness[0]),
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE))
        for fd in (*to_solution, *to_harness):
            os.close(fd)
        to_solution = to_harness = ()
        result = _communicate(runs[1].proc, b"", deadline, limits.output_bytes)
        try:   # the harness has ended: the solution reads EOF and exits by itself
            runs[0].proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        return result
    finally:
        for fd in (*to_solution, *to_harness):
            os.close(fd)
        for run in reversed(runs):
            run.stop()


def _communicate(proc: subprocess.Popen, stdin: bytes, deadline: float,
                 cap: int) -> RunResult:
    """Feed stdin, read both streams up to ``cap`` bytes each; stop at ``deadline``
    (time.monotonic) or when a stream passes the cap, else wait for the exit until then."""
    chunks = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    sel = selectors.DefaultSelector()
    for stream in (proc.stdout, proc.stderr):
        os.set_blocking(stream.fileno(), False)
        sel.register(stream.fileno(), selectors.EVENT_READ)
    if proc.stdin is not None:
        try:
            proc.stdin.write(stdin)
            proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
    timed_out = capped = False
    while sel.get_map():
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        for key, _ in sel.select(min(left, 1.0)):
            try:
                data = os.read(key.fd, 65536)
            except BlockingIOError:
                continue
            if not data:
                sel.unregister(key.fd)
                continue
            chunks[key.fd] += data
            if len(chunks[key.fd]) > cap:
                capped = True
        if capped:
            break
    sel.close()
    if not (timed_out or capped):   # the streams ended: let it exit by itself until the deadline
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    killed = timed_out or capped
    code = None if killed else proc.returncode
    out, err = (bytes(chunks[s.fileno()][:cap]) for s in (proc.stdout, proc.stderr))
    return RunResult(code, out, err, timed_out, capped)


def _kill(proc: subprocess.Popen, bubblewrap: bool) -> None:
    """SIGKILL a running sandbox without waiting. With bubblewrap, its PID namespace's init
    (bwrap's child), so that the kernel ends every process of the namespace and bwrap exits
    after it (SIGKILLing bwrap first would leave the init to the host's reaper); without it,
    the process group."""
    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    except OSError:
        children = []
    for child in children if bubblewrap else ():
        try:
            os.kill(int(child), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if not (bubblewrap and children):
        _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
