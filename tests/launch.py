"""Run multi-process test scripts under torchrun (gloo on CPU) and plain CLI subprocesses.

`run_torchrun(nproc, script, *args)` launches `torchrun --nproc_per_node nproc --master_port
<free port> script args...` from the repository root (`run_two_nodes`: the same as two
torchrun "nodes" on localhost), waits at most `timeout` seconds and
returns the `subprocess.CompletedProcess` (text stdout/stderr, returncode). It never raises on
a non-zero exit; on failure or timeout it prints the (warning-filtered) output so pytest shows
it. `run_python(script, *args)` does the same for a single `python script args...` process.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# Lines of library noise (warnings and their source echo) dropped from printed output.
_NOISE = ("Warning", "warnings.warn", "warn(", "FutureWarning", "DeprecationWarning",
          "UserWarning")


_HANDED_OUT: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for port-0 binds and outgoing connections (Linux default)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now and that the kernel will not hand out by itself.

    A port taken by a port-0 bind is in the kernel's ephemeral range: until the caller binds it
    (a torchrun rendezvous seconds later, a pool's rejoin minutes later) any outgoing connection
    or port-0 listener may get it (CI saw EADDRINUSE that way). So the port is drawn at random
    below that range (from 20000 up, or above it if the range starts too low), checked bindable,
    and never handed out twice by one process; a kernel range that leaves no room either side
    gets the kernel's own choice."""
    lo, hi = _ephemeral_range()
    if lo - 20000 >= 2000:
        low, high = 20000, lo
    elif 65535 - hi >= 2000:
        low, high = hi + 1, 65536
    else:   # the kernel's range covers (nearly) every port: its own choice, as before
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(low, high)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free TCP port in [{low}, {high}) on 127.0.0.1 after 200 tries")


# A warning line as Python prints one ("UserWarning: ...", "FutureWarning(...") or its source
# line ("  warnings.warn(")
WARNING_LINE = re.compile(r"\b\w*Warning\b[:(]|^\s*warnings\.warn\(", re.MULTILINE)


def filter_noise(text: str) -> str:
    """`text` without warning lines (megatron and transformers are noisy on CPU)."""
    return "\n".join(line for line in text.splitlines()
                     if not any(marker in line for marker in _NOISE))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONWARNINGS", "ignore")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid`, its process group and every descendant (torchrun starts its workers in
    their own sessions, so killing the group alone leaves them running)."""
    import psutil

    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    for child in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


def _run(cmd: list[str], timeout: int, env: dict | None = None
         ) -> subprocess.CompletedProcess:
    """Run `cmd` in its own process group; on timeout kill it and all its descendants
    (torchrun workers included) and return returncode 124."""
    return wait(start(cmd, env), timeout)


def start(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    """Start `cmd` from the repository root in its own session, output captured (text);
    `env` adds variables to the test environment."""
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env={**_env(), **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _log_launch(cmd: list[str], seconds: float, rc: int) -> None:
    """With $LAUNCH_LOG set: append one JSON line per launch (test, seconds, exit code,
    command), to see where the suite's time goes."""
    path = os.environ.get("LAUNCH_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", ""),
                                "seconds": round(seconds, 2), "rc": rc,
                                "cmd": " ".join(map(str, cmd))[:400]}) + "\n")


def wait(proc: subprocess.Popen, timeout: int) -> subprocess.CompletedProcess:
    """Wait for a process from `start`, with `_run`'s timeout and printing contract."""
    cmd = proc.args
    started = time.perf_counter()
    try:
        out, err = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # an orphan outside the tree holds the pipes
            out, err = "", "(output lost: a process outside the launch still holds the pipes)"
        rc = 124
        print(f"TIMEOUT after {timeout}s: {' '.join(cmd)}")
    _log_launch(cmd, time.perf_counter() - started, rc)
    if rc != 0:
        print(f"exit code {rc}: {' '.join(cmd)}\n--- stdout ---\n{filter_noise(out)}\n"
              f"--- stderr ---\n{filter_noise(err)}")
    return subprocess.CompletedProcess(cmd, rc, out, err)


def torchrun_cmd(nproc: int, script: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script),
            *map(str, args)]


def run_torchrun(nproc: int, script: str, *args: str, timeout: int = 600,
                 env: dict | None = None) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node nproc --master_port <free> script *args` from the repo root.

    `script` is a path relative to the repository root (or absolute); `env` adds environment
    variables. Returns the completed process; returncode 124 means it was killed after
    `timeout` seconds."""
    return _run(torchrun_cmd(nproc, script, *args), timeout, env)


def run_two_nodes(nproc_per_node: int, script: str, *args: str, timeout: int = 600,
                  node_env: tuple[dict, dict] = ({}, {})) -> list[subprocess.CompletedProcess]:
    """Two torchrun "nodes" on localhost (`--nnodes 2 --node_rank 0|1`, static rendezvous on
    one free port), `nproc_per_node` ranks each: the multi-node rank numbering and
    LOCAL_WORLD_SIZE without a second machine. `node_env[k]` adds variables to node k only.
    Returns both completed processes (node 0 first)."""
    port = str(free_port())
    procs = [start([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                    "--node_rank", str(k), "--nproc_per_node", str(nproc_per_node),
                    "--master_addr", "127.0.0.1", "--master_port", port, str(script),
                    *map(str, args)], node_env[k]) for k in (0, 1)]
    return [wait(p, timeout) for p in procs]


def run_python(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python script *args` from the repo root, same contract as `run_torchrun`."""
    return _run([sys.executable, str(script), *map(str, args)], timeout)


def python_json(code: str, *args: str, env: dict | None = None, timeout: int = 600) -> dict:
    """`python -c code *args` in a fresh process from the repo root (the launches' environment,
    `env` added); the JSON object it printed on its last stdout line. A non-zero exit fails
    the test with the end of its stderr."""
    out = _run([sys.executable, "-c", code, *map(str, args)], timeout, env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def result_lines(stdout: str, prefix: str = "RESULT ") -> list[dict]:
    """The JSON objects of the `prefix {json}` lines a multi-rank script printed, in order."""
    return [json.loads(line[len(prefix):]) for line in stdout.splitlines()
            if line.startswith(prefix)]


def run_main(main, argv: list[str], env: dict | None = None,
             label: str = "") -> subprocess.CompletedProcess:
    """Call a command line's `main(argv)` in this process, for a refusal that comes before any
    process group exists: `env` set in os.environ for the call (e.g. RANK=0, WORLD_SIZE=N: rank
    0 of an N-rank job), stdout and stderr captured, the exit code taken from main's return
    value or its SystemExit (engine.cli.exit_process, which ends the process, is not called:
    it belongs to the `__main__` blocks). Returns a CompletedProcess like a launch's.

    The refusal must come before torch.distributed starts: a run that gets past it (the CPU
    host runtime installed, a process group started) fails here with AssertionError instead
    of training inside the test process. Any other exception propagates (a traceback)."""
    import io
    from unittest import mock

    def no_launch(*args, **kwargs):
        raise AssertionError(f"{label or argv}: expected a refusal before any process group "
                             "exists, but the run went on to start torch.distributed")

    out, err = io.StringIO(), io.StringIO()
    saved = dict(os.environ)
    os.environ.update({k: str(v) for k, v in (env or {}).items()})
    try:
        with mock.patch("parallel.cpu_runtime.install", no_launch), \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) or e.code is None else 1
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess([label or "main", *argv], code or 0, out.getvalue(),
                                       err.getvalue())


def run_cli(module: str, *argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m MODULE argv...` for a refusal or a `--validate` check: MODULE's
    `__main__.main(argv)` in this process (see run_main)."""
    import importlib

    main = importlib.import_module(f"{module}.__main__").main
    return run_main(main, [str(a) for a in argv], env=env, label=f"python -m {module}")
