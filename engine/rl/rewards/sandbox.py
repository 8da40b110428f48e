"""Running a model-written program contained (`reward.fn=code`; docs/rewards.md#the-sandbox).

Layers, every one on by default (``probe()`` says which this host can enforce):

- ``tempdir``: a fresh temporary working directory, removed afterwards;
- ``empty-env``: the program's environment is empty (no variable of the trainer reaches it);
- ``session``: a new session and process group, SIGKILLed at the run's timeout;
- ``rlimits``: CPU seconds, address space, file size, open files (RLIMIT_*);
- ``processes``: RLIMIT_NPROC, which the kernel enforces only for a non-root uid (so as root
  the program runs as one of RUN_UIDS);
- ``output-cap``: stdout and stderr read up to ``Limits.output_bytes`` each; past it the
  program is killed;
- ``netns``: a network namespace of its own (``unshare --net``: only a down loopback);
- ``pidns``: a PID namespace (``unshare --pid --fork --mount-proc``) whose init
  (engine.rl.rewards.sandbox_init) ends every process of the program when it exits;
- ``uid``: a uid of its own (RUN_UIDS, unused by any account; one per concurrent run) instead
  of the trainer's, so it can neither signal nor read the trainer's processes and files;
- ``private-tmp``: tmpfs (64 MiB each) over /tmp, /var/tmp and /dev/shm (a mount namespace);
  the program runs in /tmp/work, a copy of the working directory on that tmpfs, so whatever it
  writes is bounded and never reaches the host's disk.

``reward.code_sandbox=strict`` refuses to start when a layer is missing (``missing_layers``);
``relaxed`` runs with what the host has and says what is missing.
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SANDBOX_UID = 65534                       # "nobody": the interpreter probe's uid
# the uids programs run as: one per concurrent run (claimed with a lock file), since
# RLIMIT_NPROC counts every process of a uid, and a flood in one run must not starve another
RUN_UIDS = range(1_500_000_000, 1_500_000_256)
LOCK_DIR = Path(tempfile.gettempdir())
INIT = str(Path(__file__).with_name("sandbox_init.py"))
LAYERS = ("tempdir", "empty-env", "session", "rlimits", "processes", "output-cap", "netns",
          "pidns", "uid", "private-tmp")
ALWAYS = ("tempdir", "empty-env", "session", "rlimits", "output-cap")
UNSHARE_FLAGS = ["--net", "--pid", "--fork", "--kill-child", "--mount-proc"]
PR_SET_PDEATHSIG = 1


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
def probe() -> dict[str, str | None]:
    """Every layer of LAYERS -> None where this host enforces it, else why not (cached)."""
    out: dict[str, str | None] = {name: None for name in LAYERS}
    root = os.geteuid() == 0
    if not root:
        out["uid"] = "the trainer is not root, so it cannot switch the program to another uid"
        out["processes"] = ("RLIMIT_NPROC counts every process of the trainer's own uid; "
                            "enforced only with the uid layer")
    unshare = shutil.which("unshare")
    if unshare is None:
        reason = "unshare(1) (util-linux) is not installed"
        out.update(netns=reason, pidns=reason, **{"private-tmp": reason})
        return out
    if root and interpreter() is None:
        out["uid"] = out["processes"] = (f"no Python interpreter that uid {SANDBOX_UID} may "
                                         f"run (tried {sys.executable}, /usr/bin/python3)")
    flags = UNSHARE_FLAGS if root else ["--user", "--map-root-user"] + UNSHARE_FLAGS
    check = subprocess.run([unshare, *flags, "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /tmp && test -d /proc/1"],
                           capture_output=True, text=True, timeout=30)
    if check.returncode != 0:
        reason = f"`unshare {' '.join(flags)}` failed: {check.stderr.strip()[:200]}"
        out.update(netns=reason, pidns=reason, **{"private-tmp": reason})
    return out


@functools.lru_cache(maxsize=None)
def interpreter() -> str | None:
    """The Python that runs programs: this interpreter, else the first system python3 the
    sandbox uid can run (a trainer's interpreter under /root is out of its reach); None as
    root when no candidate runs as that uid (then the uid layer is missing)."""
    candidates = list(dict.fromkeys([sys.executable, "/usr/bin/python3",
                                     "/usr/local/bin/python3"]))
    if os.geteuid() != 0:
        return sys.executable
    for path in candidates:
        try:
            done = subprocess.run([path, "-I", "-c", "import json"], user=SANDBOX_UID,
                                  group=SANDBOX_UID, extra_groups=[], env={}, cwd="/",
                                  capture_output=True, timeout=30)
        except OSError:
            continue
        if done.returncode == 0:
            return path
    return None


def missing_layers() -> dict[str, str]:
    """The layers this host cannot enforce, with the reason."""
    return {name: why for name, why in probe().items() if why is not None}


def describe() -> str:
    """One line for the run header: the active layers and the missing ones."""
    missing = missing_layers()
    active = [name for name in LAYERS if name not in missing]
    text = f"code sandbox layers: {', '.join(active)}"
    return text + (f"; missing: {', '.join(missing)}" if missing else "")


def _rlimits(cpu_s: float, limits: Limits, with_nproc: bool) -> dict[str, int]:
    out = {"RLIMIT_CPU": max(1, int(cpu_s + 0.999)), "RLIMIT_AS": limits.memory_bytes,
           "RLIMIT_FSIZE": limits.file_bytes, "RLIMIT_NOFILE": limits.open_files,
           "RLIMIT_CORE": 0}
    if with_nproc:
        out["RLIMIT_NPROC"] = limits.processes
    return out


def _die_with_parent() -> None:   # in the child between fork and exec: SIGKILL if we die
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@contextlib.contextmanager
def claimed_uid():
    """A uid of RUN_UIDS no other run holds (a non-blocking flock on its lock file)."""
    for uid in RUN_UIDS:
        handle = open(LOCK_DIR / f".reward-sandbox-{uid}.lock", "a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        try:
            yield uid
        finally:
            handle.close()
        return
    raise RuntimeError(f"all {len(RUN_UIDS)} sandbox uids are in use")


def run_program(files: dict[str, str], argv: list[str], stdin: bytes, timeout_s: float,
                limits: Limits = Limits()) -> RunResult:
    """Write ``files`` (name -> text) into a fresh working directory and run ``argv`` (relative
    to it; ``argv[0]`` "python" is this interpreter, isolated: ``-I``) with ``stdin``, inside
    every layer ``probe()`` found (module docstring); SIGKILL at ``timeout_s`` seconds."""
    missing = missing_layers()
    switch_uid = "uid" not in missing
    workdir = tempfile.mkdtemp(prefix="reward-code-")
    try:
        with claimed_uid() if switch_uid else contextlib.nullcontext(None) as uid:
            for name, text in files.items():
                Path(workdir, name).write_text(text)
            if uid is not None:
                os.chmod(workdir, 0o700)
                for path in [workdir, *(str(Path(workdir, n)) for n in files)]:
                    os.chown(path, uid, uid)
            python = (interpreter() if switch_uid else None) or sys.executable
            program = [python, "-I", *argv[1:]] if argv[0] == "python" else list(argv)
            spec = {"argv": program, "rlimits": _rlimits(timeout_s, limits, switch_uid),
                    "uid": uid, "private_tmp": "private-tmp" not in missing}
            command = [sys.executable, "-I", "-S", INIT, json.dumps(spec)]
            if "pidns" not in missing:
                flags = UNSHARE_FLAGS if os.geteuid() == 0 else [
                    "--user", "--map-root-user"] + UNSHARE_FLAGS
                command = [shutil.which("unshare"), *flags] + command
            proc = subprocess.Popen(command, cwd=workdir, env={}, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True, preexec_fn=_die_with_parent)
            return _communicate(proc, stdin, timeout_s, limits.output_bytes)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _communicate(proc: subprocess.Popen, stdin: bytes, timeout_s: float,
                 cap: int) -> RunResult:
    """Feed stdin, read both streams up to ``cap`` bytes each, kill the process group at the
    deadline or when a stream passes the cap; always reaps and kills the group."""
    deadline = time.monotonic() + timeout_s
    chunks = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    sel = selectors.DefaultSelector()
    for stream in (proc.stdout, proc.stderr):
        os.set_blocking(stream.fileno(), False)
        sel.register(stream.fileno(), selectors.EVENT_READ)
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
    if proc.poll() is None:
        _kill(proc)
    code = proc.wait()
    _kill_group(proc)   # anything of its group left (without a PID namespace)
    out, err = (bytes(chunks[s.fileno()][:cap]) for s in (proc.stdout, proc.stderr))
    proc.stdout.close()
    proc.stderr.close()
    killed = timed_out or capped
    return RunResult(None if killed else code, out, err, timed_out, capped)


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL a running sandbox. With a PID namespace, its init (unshare's child) first, so
    unshare reaps it (killing unshare first would orphan the init to the host's reaper) and
    the kernel ends the namespace's other processes; then the process group."""
    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    except OSError:
        children = []
    for child in children:
        try:
            os.kill(int(child), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
