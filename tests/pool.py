"""A persistent pool of gloo rank processes for multi-rank tests.

Launching `torchrun` costs every rank an interpreter start, the import of torch, megatron-core
and transformers, and a gloo rendezvous: several seconds of the 2 CPU cores per rank, paid again
by every launch. A `RankPool` of world size N starts N rank processes once (lazily, on first
use; forked from the session's zygote, tests/pool_zygote.py, which imported PRELOAD once, so a
pool starts in a fraction of a second; RANK_POOL_FORK=0 starts an interpreter per rank), each with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...),
the CPU-host runtime installed and the default process group started exactly as in a launch
(parallel.process_groups.init_distributed), the heavy modules imported; then runs test cases in
them, one at a time, on every rank:

    pools.run(4, "tests.multirank.x:check", arg, ...)      -> [rank 0 value, rank 1 value, ...]
    pools.script(4, "tests/multirank/x.py", *argv, env={})  -> PoolRun (like CompletedProcess)
    pools.script(2, "-m", "engine.sft", *overrides)         -> the same, `python -m` style

A script case runs as under torchrun: `sys.argv`, `__name__ == "__main__"`, the case's
environment variables set for that case only; its exit code is that of `SystemExit` (the
engine's `exit_process` raises it inside the pool instead of ending the process), its stdout
and stderr are captured per rank (file descriptors 1 and 2: C code and child processes too).
`PoolRun.stdout` is rank 0's, so assertions written for a torchrun launch keep working.

Between cases every rank tears down megatron's parallel state and the model-parallel RNG
tracker (parallel.process_groups.teardown_model_parallel), destroys every process group but
the default one, and restores the environment, `sys.argv`, `sys.path`, the working directory,
signal handlers, torch's default RNG state and grad mode: each case starts as in a fresh launch
(the default process group is kept: a script's `shutdown()` does not end it).

Failures: an exception on any rank fails the case with EVERY rank's output and traceback (ranks
still running are stopped after a grace period, their stacks dumped by faulthandler), naming
the test and the failing rank(s) (`CaseFailed`). A case that runs past its timeout is killed with
its pool; the next case gets fresh processes. So does every case after a failure.
"""
from __future__ import annotations

import contextlib
import faulthandler
import gc
import importlib
import json
import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener, wait as wait_conns
from pathlib import Path

from tests.launch import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]

# What a rank imports once, before its first case (the modules every multi-rank test needs).
PRELOAD = ("megatron.core", "transformers", "models.bridge.weights", "engine.sft.training",
           "engine.training.train_engine", "engine.rl.loop")
# After a rank fails, how long the others may still take to finish the case.
FAILURE_GRACE_S = 20.0
# Signal that makes a rank dump every thread's stack into the case's stderr.
DUMP_SIGNAL = signal.SIGUSR2
# A rank whose resident memory passes this after a case is replaced (long-lived processes
# accumulate allocator fragmentation and caches).
MAX_RSS_BYTES = 3 << 30
# ... and so is a rank left with more threads than this beyond its first case's: process groups
# the case leaked. Megatron's DistributedDataParallel hooks its parameters' gradient
# accumulators (C++ autograd nodes) with closures over the DDP: a cycle Python's collector
# cannot see, so the DDP, its model and its process groups would live until the process exits.
# Each gloo group keeps threads that wake up now and then; a destroyed one whose peer is gone
# spins. So after a case that left threads, every leaked DDP is emptied first
# (engine.training.ddp_release) and collected; a rank still over the limit is replaced (a
# restart costs a few seconds; the launch log says why).
MAX_EXTRA_THREADS = 24
# Ranks kept started over all pools; the least recently used pools are closed beyond it.
MAX_RANKS = 16
# ... and before every case, idle pools are closed (least recently used first) while the
# host's available memory is below this floor plus this much per rank of the case: an idle
# rank keeps what its cases grew (up to MAX_RSS_BYTES), and a host that runs out kills a
# rank of the running case instead (seen in CI as "rank 3 process died", no traceback).
MEMORY_FLOOR_BYTES = 3 << 30
MEMORY_PER_RANK_BYTES = 1 << 30


class CaseFailed(AssertionError):
    """A pool case raised on some rank, or ran past its timeout. The message names the test,
    the case, the rank(s) and holds every rank's captured output and traceback."""


@dataclass
class RankOutcome:
    rank: int
    finished: bool = False          # the case returned on this rank (else: killed)
    exit_code: int | None = None    # script cases: as a process would exit; call cases: 0
    value: object = None            # call cases: the function's return value
    error: str | None = None        # the traceback of an uncaught exception
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0


@dataclass
class PoolRun:
    """A finished case, shaped like subprocess.CompletedProcess: `returncode` (0 when every
    rank exited 0, else the first rank's non-zero code, as torchrun's failure reports it),
    `stdout`/`stderr` of rank 0, and `ranks` (every RankOutcome)."""

    args: list[str]
    ranks: list[RankOutcome]
    returncode: int = 0
    timed_out: bool = False

    @property
    def stdout(self) -> str:
        return self.ranks[0].stdout

    @property
    def stderr(self) -> str:
        return self.ranks[0].stderr

    @property
    def values(self) -> list:
        return [r.value for r in self.ranks]

    def nodes(self, count: int) -> list[subprocess.CompletedProcess]:
        """The run as `count` torchrun "nodes" (tests.launch.run_two_nodes' shape): node k's
        ranks' output joined, its returncode the first non-zero exit among them."""
        per = len(self.ranks) // count
        out = []
        for k in range(count):
            ranks = self.ranks[k * per:(k + 1) * per]
            codes = [1 if (r.error or not r.finished) else (r.exit_code or 0) for r in ranks]
            out.append(subprocess.CompletedProcess(
                self.args, next((c for c in codes if c), 0), "".join(r.stdout for r in ranks),
                "".join(r.stderr for r in ranks)))
        return out

    def merged(self) -> subprocess.CompletedProcess:
        """Every rank's stdout and stderr each joined in rank order (as one torchrun launch
        prints them), with this run's returncode (the worker's exit code, not torchrun's)."""
        return subprocess.CompletedProcess(self.args, self.returncode,
                                           "".join(r.stdout for r in self.ranks),
                                           "".join(r.stderr for r in self.ranks))


_ZYGOTE = None


def _zygote():
    """The session's rank zygote (tests.pool_zygote), started on first use; None with
    RANK_POOL_FORK=0 (every rank then starts its own interpreter)."""
    global _ZYGOTE
    if os.environ.get("RANK_POOL_FORK", "1") == "0":
        return None
    if _ZYGOTE is None:
        from tests.pool_zygote import Zygote

        _ZYGOTE = Zygote(Path(tempfile.mkdtemp(prefix="rank_zygote_")))
    return _ZYGOTE


def _current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "(no test)").rsplit(" (", 1)[0]


def _base_env() -> dict[str, str]:
    from tests.launch import _env

    return _env()


def _log_case(args: list[str], world: int, seconds: float, rc: int,
              replaced: str | None = None) -> None:
    """With $LAUNCH_LOG set: one JSON line per pool case (as tests.launch logs launches);
    `replaced`: why the pool's ranks are replaced after the case (None: they are kept)."""
    path = os.environ.get("LAUNCH_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", ""),
                                "seconds": round(seconds, 2), "rc": rc, "pool": world,
                                "replaced": replaced,
                                "cmd": " ".join(map(str, args))[:400]}) + "\n")


class RankPool:
    """N rank processes of one gloo world (see the module docstring)."""

    def __init__(self, world: int, workdir: str | None = None):
        self.world = world
        self._root = Path(workdir or tempfile.mkdtemp(prefix=f"rank_pool{world}_"))
        self._root.mkdir(parents=True, exist_ok=True)
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._listener: Listener | None = None
        self._cases = 0
        self.starts = 0               # how many times processes were started (tests read it)
        self.last_used = 0.0
        self.lock = threading.RLock()  # one case at a time (callers may be threads)

    # ------------------------------------------------------------------ lifecycle
    @property
    def alive(self) -> bool:
        return bool(self._conns) and all(p.poll() is None for p in self._procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def start(self, timeout: float = 300.0, attempts: int = 3) -> None:
        """Start the N rank processes; return when every one has joined the default group
        and imported PRELOAD. A failed start (e.g. the free port taken by another process
        before rank 0 bound it) is tried again with a new port, `attempts` times in all."""
        for attempt in range(attempts):
            try:
                return self._start(timeout)
            except RuntimeError:
                if attempt == attempts - 1:
                    raise

    def _start(self, timeout: float) -> None:
        self.close()
        self.starts += 1
        key = secrets.token_bytes(16)
        sock = str(self._root / f"ctl{self.starts}.sock")
        self._listener = Listener(sock, family="AF_UNIX", authkey=key)
        port = str(free_port())
        env = _base_env()
        log_dir = self._root / f"start{self.starts}"
        log_dir.mkdir(exist_ok=True)
        zygote = _zygote()
        for rank in range(self.world):
            rank_env = {**env, **torchrun_env(rank, self.world, port),
                        "RANK_POOL_SOCKET": sock, "RANK_POOL_KEY": key.hex()}
            if zygote is not None:  # forked from a process that imported PRELOAD already
                self._procs.append(zygote.fork(rank_env, log_dir / f"rank{rank}.log"))
                continue
            log = open(log_dir / f"rank{rank}.log", "w")
            self._procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.pool"], cwd=REPO_ROOT, env=rank_env,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True))
            log.close()
        conns: dict[int, Connection] = {}
        deadline = time.monotonic() + timeout
        raw = self._listener._listener._socket
        while len(conns) < self.world:
            dead = [r for r, p in enumerate(self._procs) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join(f"--- rank {r} ---\n{_tail(log_dir / f'rank{r}.log')}"
                                 for r in range(self.world))
                self.close()
                raise RuntimeError(f"rank pool of {self.world} did not start "
                                   f"({'ranks ' + str(dead) + ' exited' if dead else 'timeout'})"
                                   f"\n{logs}")
            raw.settimeout(1.0)
            try:
                conn = self._listener.accept()
            except (socket.timeout, TimeoutError):
                continue
            conns[conn.recv()] = conn
        for conn in conns.values():  # the ranks wait for this before their first case
            conn.send("go")
        self._conns = [conns[r] for r in range(self.world)]
        self.last_used = time.monotonic()

    def close(self) -> None:
        """Stop the rank processes (politely when idle, else killed) and their children."""
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send(None)
        for p in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10 if self._conns else 0)
        self._kill()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.close()
        self._conns = []
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
            self._listener = None

    def _kill(self) -> None:
        from tests.launch import _kill_tree

        for p in self._procs:
            _kill_tree(p.pid)
        for p in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)
        self._procs = []

    # ------------------------------------------------------------------ cases
    def run_case(self, case: dict, timeout: float, check: bool) -> PoolRun:
        """Run `case` (see _Rank.run) on every rank; return the PoolRun (raise CaseFailed on
        an exception or a timeout when `check`). Callers in other threads wait their turn."""
        with self.lock:
            return self._run_case(case, timeout, check)

    def _run_case(self, case: dict, timeout: float, check: bool) -> PoolRun:
        if not self.alive:
            self.start()
        self._cases += 1
        out_dir = self._root / f"case{self._cases}"
        out_dir.mkdir()
        case = {**case, "out_dir": str(out_dir)}
        outcomes = [RankOutcome(rank) for rank in range(self.world)]
        started = time.monotonic()
        deadline = started + timeout
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        failed_at = None
        timed_out = broken = restart = False
        why = None   # why the ranks are replaced after this case (the launch log says it)
        try:
            for rank, conn in enumerate(self._conns):
                conn.send({**case, "rank_env": case["rank_env"].get(rank, {})})
            while pending:
                limit = deadline if failed_at is None else min(deadline,
                                                               failed_at + FAILURE_GRACE_S)
                ready = wait_conns(list(pending), timeout=max(0.0, limit - time.monotonic()))
                if not ready:
                    timed_out = failed_at is None
                    break
                for conn in ready:
                    rank = pending.pop(conn)
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError):
                        msg = {"error": f"rank {rank} process died ({_death(self._procs[rank])})",
                               "exit_code": None}
                        broken = True
                    o = outcomes[rank]
                    o.finished = "seconds" in msg
                    o.exit_code, o.error = msg.get("exit_code"), msg.get("error")
                    o.value, o.seconds = msg.get("value"), msg.get("seconds", 0.0)
                    restart |= msg.get("restart", False)
                    why = why or (f"rank {rank}: {msg['why']}" if msg.get("why") else None)
                    if (o.error or (o.exit_code or 0) != 0) and failed_at is None:
                        failed_at = time.monotonic()
        except BaseException:  # interrupted (pytest-timeout, Ctrl-C): the ranks are mid-case
            self._dump_and_kill(pending.values())
            raise
        if pending:
            self._dump_and_kill(pending.values())
        elif broken or restart or any(o.error for o in outcomes):
            self.close()  # the ranks may disagree about what happened: fresh ones next time
        for o in outcomes:
            o.stdout = _read(out_dir / f"rank{o.rank}.out")
            o.stderr = _read(out_dir / f"rank{o.rank}.err")
            if o.error and o.error not in o.stderr:
                o.stderr += o.error
        self.last_used = time.monotonic()
        codes = [1 if (o.error or not o.finished) else (o.exit_code or 0) for o in outcomes]
        run = PoolRun(case["args"], outcomes, next((c for c in codes if c), 0), timed_out)
        if timed_out:
            run.returncode = 124
        if why is None and (pending or broken or any(o.error for o in outcomes)):
            why = "the case failed, died or timed out"
        _log_case(case["args"], self.world, time.monotonic() - started, run.returncode, why)
        if check and (timed_out or any(o.error or not o.finished for o in outcomes)):
            raise CaseFailed(_failure_message(run, self.world, timeout))
        if run.returncode != 0:
            from tests.launch import filter_noise

            for o in outcomes:  # as tests.launch prints a failed launch's output
                print(f"--- rank {o.rank} exit code {o.exit_code} stdout ---\n"
                      f"{filter_noise(o.stdout)}\n--- rank {o.rank} stderr ---\n"
                      f"{filter_noise(o.stderr)}")
        return run

    def _dump_and_kill(self, ranks) -> None:
        """Dump the stacks of `ranks` (still inside the case) into their stderr, then kill
        the whole pool: the next case starts fresh processes."""
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError, IndexError):
                os.kill(self._procs[rank].pid, DUMP_SIGNAL)
        time.sleep(1.0)
        self._kill()
        self.close()


def _death(proc) -> str:
    """What is known of a rank process that closed its connection: its exit code (a negative
    one is the signal that ended it: -9 is SIGKILL, the kernel's OOM killer's), the host's
    available memory and its OOM-kill count now."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=2)   # the zygote reaps a forked rank and writes its code
    kills = oom_kills()
    return (f"exit code {proc.poll()}; host: {available_memory() >> 20} MiB available, "
            f"{'?' if kills is None else kills - _OOM_KILLS_AT_START} OOM kills this session")


def available_memory() -> int:
    """The host's MemAvailable in bytes (/proc/meminfo; a large number where it is missing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return 1 << 62


def oom_kills() -> int | None:
    """The kernel's count of OOM kills since boot (/proc/vmstat; None where it is missing)."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


_OOM_KILLS_AT_START = oom_kills() or 0


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _tail(path: Path, chars: int = 6000) -> str:
    return _read(path)[-chars:]


def _failure_message(run: PoolRun, world: int, timeout: float) -> str:
    from tests.launch import filter_noise

    bad = [o.rank for o in run.ranks if o.error]
    hung = [o.rank for o in run.ranks if not o.finished and not o.error]
    what = []
    if bad:
        what.append(f"raised on rank{'s' if len(bad) > 1 else ''} "
                    f"{', '.join(map(str, bad))}")
    if run.timed_out:
        what.append(f"timed out after {timeout:g} s (ranks {', '.join(map(str, hung))} "
                    "killed; the pool restarts)")
    elif hung:
        what.append(f"rank{'s' if len(hung) > 1 else ''} {', '.join(map(str, hung))} still "
                    f"running {FAILURE_GRACE_S:g} s later killed")
    lines = [f"pool case {' '.join(map(str, run.args))} (world {world}) in test "
             f"{_current_test()} {'; '.join(what)}"]
    for o in run.ranks:
        state = ("raised" if o.error else "killed (stack below)" if not o.finished
                 else f"exit code {o.exit_code}")
        lines.append(f"===== rank {o.rank}: {state} =====")
        if o.stdout.strip():
            lines.append(f"--- rank {o.rank} stdout ---\n{filter_noise(o.stdout)[-4000:]}")
        if o.stderr.strip():
            lines.append(f"--- rank {o.rank} stderr ---\n{filter_noise(o.stderr)[-8000:]}")
    return "\n".join(lines)


def torchrun_env(rank: int, world: int, port: str, nodes: int = 1) -> dict[str, str]:
    """The variables torchrun gives rank `rank` of `world` ranks over `nodes` nodes."""
    local = world // nodes
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % local),
            "LOCAL_WORLD_SIZE": str(local), "GROUP_RANK": str(rank // local),
            "GROUP_WORLD_SIZE": str(nodes), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
            "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "False",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


class Pools:
    """One RankPool per world size, started on first use (the session fixture `pools`)."""

    def __init__(self, workdir: str | None = None, max_ranks: int = MAX_RANKS):
        self._root = Path(workdir or tempfile.mkdtemp(prefix="rank_pools_"))
        self._pools: dict[int, RankPool] = {}
        self.max_ranks = max_ranks
        self._lock = threading.Lock()

    def get(self, world: int) -> RankPool:
        with self._lock:
            pool = self._pools.get(world)
            if pool is None:
                pool = self._pools[world] = RankPool(world, str(self._root / f"world{world}"))
            self._make_room(world, counted=not pool.alive)
            return pool

    def _make_room(self, world: int, counted: bool) -> None:
        """Close idle pools, least recently used first, while the live ranks plus `world`
        (when `counted`: its pool is not started) pass max_ranks, or the host's available
        memory is below what a case of `world` ranks may need (MEMORY_FLOOR_BYTES)."""
        live = sorted((p for w, p in self._pools.items() if w != world and p.alive),
                      key=lambda p: p.last_used)
        need = MEMORY_FLOOR_BYTES + world * MEMORY_PER_RANK_BYTES
        while live and (sum(p.world for p in live) + world * counted > self.max_ranks
                        or available_memory() < need):
            idle = live.pop(0)
            if idle.lock.acquire(blocking=False):  # not one running a case in another thread
                try:
                    _log_case([], idle.world, 0.0, 0, f"closed to make room for {world} ranks "
                              f"({available_memory() >> 20} MiB available)")
                    idle.close()
                finally:
                    idle.lock.release()

    def run(self, world: int, target: str, *args, env: dict | None = None,
            timeout: float = 600, **kwargs) -> list:
        """Call `target` ("package.module:function") with `args`/`kwargs` on every rank of
        the `world` pool; return the per-rank return values (raises CaseFailed)."""
        case = _case("call", [target, *map(repr, args)], target, env=env, call_args=args,
                     call_kwargs=kwargs)
        return self.get(world).run_case(case, timeout, check=True).values

    def script(self, world: int, *argv: str, env: dict | None = None, timeout: float = 600,
               check: bool = True, nodes: int = 1, rank_env: dict | None = None,
               cwd: str | None = None, own_world: bool = False) -> PoolRun:
        """Run `script args...` or `-m module args...` on every rank of the `world` pool as
        torchrun would (see the module docstring). `nodes`: the rank numbering of that many
        torchrun nodes (LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK); `rank_env`: {rank: vars}
        on top of `env`. `check`: raise CaseFailed when a rank raised or the case timed out
        (else returncode 1 / 124 as a launch would give). `own_world`: the ranks leave the
        pool's default process group for the case, which starts torch.distributed itself from
        torchrun's variables (a fresh MASTER_PORT), e.g. engine.rl's disaggregated split into
        two worlds; afterwards the pool's group is started again."""
        argv = [str(a) for a in argv]
        per_rank = {r: dict(v) for r, v in (rank_env or {}).items()}
        if nodes > 1:
            for rank in range(world):
                local = world // nodes
                per_rank.setdefault(rank, {}).update(
                    LOCAL_RANK=str(rank % local), LOCAL_WORLD_SIZE=str(local),
                    GROUP_RANK=str(rank // local), GROUP_WORLD_SIZE=str(nodes))
        if argv[0] == "-m":
            case = _case("module", argv, argv[1], argv=argv[2:], env=env,
                         rank_env=per_rank, cwd=cwd)
        else:
            script = Path(argv[0])
            script = script if script.is_absolute() else REPO_ROOT / script
            case = _case("script", argv, str(script), argv=argv[1:], env=env,
                         rank_env=per_rank, cwd=cwd)
        if own_world:
            case.update(own_world=True, port=str(free_port()), restore_port=str(free_port()))
        return self.get(world).run_case(case, timeout, check)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        if _ZYGOTE is not None:
            _ZYGOTE.close()


def _case(kind: str, label: list[str], target: str, argv=(), env=None, rank_env=None,
          cwd=None, call_args=(), call_kwargs=None) -> dict:
    """What a rank needs to run a case (`label`: how reports name it)."""
    return {"kind": kind, "args": [str(a) for a in label], "target": target,
            "argv": [str(a) for a in argv], "env": {k: str(v) for k, v in (env or {}).items()},
            "rank_env": rank_env or {}, "cwd": str(cwd or REPO_ROOT),
            "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
            "call_args": tuple(call_args), "call_kwargs": dict(call_kwargs or {})}


# ====================================================================== rank process side

class _Rank:
    """The loop of one rank process: receive a case, run it, send the outcome."""

    def __init__(self, conn: Connection):
        import torch

        self.conn = conn
        self.rank = int(os.environ["RANK"])
        self.base_env = dict(os.environ)
        self.base_path = list(sys.path)
        self.rng = torch.get_rng_state()
        from parallel import cpu_runtime

        self.fake_rng = cpu_runtime._FAKE_GENERATOR.get_state()
        self.threads = _threads()
        self.signals = {s: signal.getsignal(s) for s in
                        (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)}

    def loop(self) -> None:
        while True:
            try:
                case = self.conn.recv()
            except (EOFError, OSError):
                return
            if case is None:
                return
            self.conn.send(self.run(case))

    def run(self, case: dict) -> dict:
        import torch

        out_dir = Path(case["out_dir"])
        started = time.perf_counter()
        result: dict = {"exit_code": 0}
        os.environ.clear()
        os.environ.update({**self.base_env, **case["env"], **case["rank_env"],
                           "PYTEST_CURRENT_TEST": case["test"]})
        sys.argv = [case["target"], *case["argv"]]
        os.chdir(case["cwd"])
        torch.set_rng_state(self.rng)
        from parallel import cpu_runtime

        cpu_runtime._FAKE_GENERATOR.set_state(self.fake_rng)
        torch.set_grad_enabled(True)
        own_world = case.get("own_world")
        if own_world:   # the case starts torch.distributed itself, as a launched script does
            _leave_world(case["port"])
        with _redirected(out_dir / f"rank{self.rank}.out", out_dir / f"rank{self.rank}.err"):
            try:
                result["value"] = self._execute(case)
            except SystemExit as e:
                result["exit_code"] = _exit_code(e)
            except BaseException:  # noqa: BLE001 - reported with the rank's traceback
                result["error"] = traceback.format_exc()
                result["exit_code"] = 1
                sys.stderr.write(result["error"])
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
        try:
            result["restart"] = self._reset()
            if own_world:
                if result.get("error") or result["exit_code"]:
                    result["restart"] = True   # the other ranks may not come back: new ones
                else:
                    self.base_env["MASTER_PORT"] = _rejoin_world(case["restore_port"])
                    os.environ["MASTER_PORT"] = self.base_env["MASTER_PORT"]
        except BaseException:  # noqa: BLE001
            result["restart"] = True
            result.setdefault("error", "pool reset failed:\n" + traceback.format_exc())
        result["seconds"] = time.perf_counter() - started
        rss, extra_threads = _rss(), _threads() - self.threads
        result["why"] = ("a case thread still runs, the reset failed or an own-world case "
                         "failed" if result["restart"]
                         else f"resident memory {rss >> 20} MiB" if rss > MAX_RSS_BYTES
                         else f"{extra_threads} threads beyond its start ({_thread_names()})"
                         if extra_threads > MAX_EXTRA_THREADS else None)
        result["restart"] = result["why"] is not None
        try:
            pickle.dumps(result.get("value"))
        except Exception as e:  # noqa: BLE001
            result["value"] = None
            result["error"] = f"return value of rank {self.rank} cannot be pickled: {e!r}"
        return result

    def _execute(self, case: dict):
        import runpy

        kind, target = case["kind"], case["target"]
        if kind == "call":
            module, name = target.split(":")
            fn = getattr(importlib.import_module(module), name)
            return fn(*case["call_args"], **case["call_kwargs"])
        if kind == "script":
            sys.path.insert(0, str(Path(target).parent))
            runpy.run_path(target, run_name="__main__")
        else:
            sys.path.insert(0, case["cwd"])
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        return None

    def _reset(self) -> bool:
        """Undo what a case may have left: megatron's state, process groups, handlers.
        Returns True when this rank should be replaced (a thread of the case still runs)."""
        import threading
        from concurrent.futures import thread as executor_thread

        import torch.distributed as dist

        from parallel.process_groups import teardown_model_parallel

        stuck = False
        for thread in threading.enumerate():  # non-daemon threads finish, as at a launch's end
            if (thread is threading.current_thread() or thread.daemon
                    or getattr(thread, "_target", None) is executor_thread._worker):
                continue   # an idle ThreadPoolExecutor worker ends only at interpreter exit
            thread.join(timeout=120)
            stuck |= thread.is_alive()
        teardown_model_parallel()
        _forget_megatron_groups()
        world = dist.group.WORLD
        for pg in list(dist.distributed_c10d._world.pg_map):
            if pg is not world:
                with contextlib.suppress(Exception):
                    _ORIGINAL_DESTROY(pg)
        gc.collect()   # the case's models, optimizers and groups, as far as Python can see
        if _threads() > self.threads + MAX_EXTRA_THREADS:
            _release_leaked_ddp()   # what Python cannot see (MAX_EXTRA_THREADS): freed too
            gc.collect()
        for sig, handler in self.signals.items():
            signal.signal(sig, handler)
        os.environ.clear()
        os.environ.update(self.base_env)
        sys.path[:] = self.base_path
        os.chdir(REPO_ROOT)
        sys.argv = ["tests.pool"]
        return stuck


def _leave_world(port: str) -> None:
    """Before an `own_world` case: no process group at all (the case's script starts its own
    over MASTER_PORT=`port`), and destroy_process_group back to torch's own."""
    import torch.distributed as dist

    if dist.is_initialized():
        _ORIGINAL_DESTROY()
    dist.destroy_process_group = _ORIGINAL_DESTROY
    os.environ["MASTER_PORT"] = port


def _rejoin_world(port: str) -> str:
    """After an `own_world` case that ended well on this rank: destroy what the case left
    (every process group; the disaggregated job's split world), start the pool's default
    group again over `port` (every rank does the same), keep it from being destroyed."""
    import torch.distributed as dist

    from parallel.process_groups import init_distributed

    if dist.is_initialized():
        _ORIGINAL_DESTROY()
    split = sys.modules.get("engine.rl.disaggregated.world")
    if split is not None:   # its module-level SplitWorld would outlive the job
        split._ACTIVE = None
    os.environ["MASTER_PORT"] = port
    init_distributed()
    dist.destroy_process_group = _keep_default_group
    return port


def _forget_megatron_groups() -> None:
    """What megatron keeps after destroy_model_parallel, as a fresh process has it: no group
    in parallel_state's globals (0.16 leaves _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP and its
    gloo twin set), an empty MoE aux-loss tracker (its entries hold the groups they reduce
    over, and loss tensors whose autograd graph holds the dispatcher's groups)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    for name, value in list(vars(ps).items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(ps, name, None)
    moe_logging = sys.modules.get("megatron.core.transformer.moe.moe_logging")
    moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")
    if moe_logging is not None:   # megatron-core 0.17 on (moe_utils' dict is a copy there)
        moe_logging.destroy_moe_metrics_tracker()
    elif moe_utils is not None:
        moe_utils.get_moe_layer_wise_logging_tracker().clear()


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _release_leaked_ddp() -> None:
    """Empty every megatron DDP the case left (engine.training.ddp_release: the gradient
    accumulators' hooks close over it through C++, which Python's collector cannot see) and
    megatron's rotary cache, so that the next collection frees the models and the process
    groups they hold, and their threads end. A scan of every object (a fraction of a second),
    done only when threads were left over."""
    from megatron.core.distributed import DistributedDataParallel

    from engine.training.ddp_release import clear_megatron_caches, release_ddp

    for obj in gc.get_objects():
        if isinstance(obj, DistributedDataParallel):
            release_ddp(obj)
    clear_megatron_caches()


def _thread_names() -> str:
    """The most common native thread names of this process, with counts."""
    import collections

    names = collections.Counter()
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            names[Path(f"/proc/self/task/{task}/comm").read_text().strip()] += 1
    return ", ".join(f"{n} x{c}" for n, c in names.most_common(4))


def _threads() -> int:
    """Native threads of this process (gloo's included)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def _rss() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except Exception:  # noqa: BLE001
        return 0


@contextlib.contextmanager
def _redirected(out: Path, err: Path):
    """File descriptors 1 and 2 (and sys.stdout/stderr) into `out` and `err`."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    files = open(out, "w"), open(err, "w")
    try:
        os.dup2(files[0].fileno(), 1)
        os.dup2(files[1].fileno(), 2)
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        for f in files:
            f.close()


_ORIGINAL_DESTROY = None


def _exit_without_ending(code: int = 0):
    """engine.cli.exit_process inside the pool: a script's end, not the process's (raise
    SystemExit after what exit_process does besides os._exit: threads joined, streams
    flushed). The idle workers of concurrent.futures' thread pools are not waited for: at a real
    exit threading's exit callbacks stop them, which would shut concurrent.futures down for good
    in a rank that runs further cases; a pool still referenced (transformers' weight loading)
    keeps its idle workers alive, and joining them hung a case until its timeout."""
    import concurrent.futures.thread as futures_thread
    import threading

    gc.collect()   # executors no longer referenced let their idle workers end
    for thread in threading.enumerate():
        if (thread is not threading.current_thread() and not thread.daemon
                and getattr(thread, "_target", None) is not futures_thread._worker):
            thread.join()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    raise SystemExit(code)


def _keep_default_group(group=None):
    """torch.distributed.destroy_process_group inside the pool: the default group stays (the
    next case needs it); other groups are destroyed as usual."""
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return None
    return _ORIGINAL_DESTROY(group)


def preload() -> None:
    """Import PRELOAD (a speed-up only: a module that fails to import is forgotten, and fails
    the cases that import it)."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001
            for stale in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[stale]


def freeze_heap() -> None:
    """Move every object alive now (the imported modules: about 460,000 objects) into the
    collector's permanent generation (gc.freeze), where no collection traverses them. Each
    case's reset collects once (`_Rank._reset`) and Python collects on its own during a case:
    with the libraries' objects in the heap a full collection took 0.2-1.0 s per rank, after
    the freeze only the objects made since are traversed (microseconds when there are none).
    Called in the zygote before it forks (the ranks inherit the frozen heap, and no collection
    writes to its pages: they stay shared with the zygote) and in each rank before its first
    case. A frozen object is never freed, so only what lives as long as the process is frozen:
    the imports, the default process group. (A vLLM engine's core, built in its owner's
    process on CPU, freezes and at shutdown unfreezes the whole heap itself: after such a case
    the rank collects as before.) tests/conftest.py does the same in the pytest process."""
    gc.freeze()


def _worker_main() -> None:
    global _ORIGINAL_DESTROY

    conn_address, key = os.environ.pop("RANK_POOL_SOCKET"), os.environ.pop("RANK_POOL_KEY")
    sys.path.insert(0, str(REPO_ROOT))
    import parallel  # noqa: F401  (megatron's jit fuser off before megatron loads)
    from parallel.process_groups import init_distributed

    init_distributed()
    import torch.distributed as dist

    _ORIGINAL_DESTROY = dist.destroy_process_group
    dist.destroy_process_group = _keep_default_group
    import engine.cli

    engine.cli.exit_process = _exit_without_ending
    preload()
    from tests.vllm_forkserver import install_client

    install_client()   # vLLM's workers from the session's server when it has one
    freeze_heap()
    faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True)
    from multiprocessing.connection import Client

    conn = Client(conn_address, family="AF_UNIX", authkey=bytes.fromhex(key))
    conn.send(int(os.environ["RANK"]))
    if conn.recv() != "go":
        return
    dist.barrier()
    _Rank(conn).loop()
    os._exit(0)


if __name__ == "__main__":
    _worker_main()
