"""Run the checklist's items one after another: subprocesses, timeouts, the budget, the logs.

Every command runs from the repository root with `PYTHONPATH` = the repository root in front
of the caller's PYTHONPATH (the carried megatron-core and hydra wheels stay reachable), in its
own session; at its item's deadline it is killed with all its descendants (torchrun workers
included). A record per item: {"item", "status" (ok | failed | timeout | skipped), "seconds",
"metrics", "error", "commands", "returncodes", "log"}. A command that exits non-zero fails its
item (the later commands of that item are not run); so does a metrics reader that raises or
lists "problems" (tools.bench.gpu.report.read_metrics). OUT/results.json is rewritten after every item.
"""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

from tools.bench.gpu.items import Item

REPO = Path(__file__).resolve().parents[3]
LOG_TAIL_LINES = 300


def child_env() -> dict[str, str]:
    """The caller's environment with the repository root first on PYTHONPATH."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def kill_tree(pid: int) -> None:
    """SIGKILL the process group `pid` and every descendant of `pid` (torchrun starts its
    workers in sessions of their own, so the group alone is not enough)."""
    descendants = []
    try:
        import psutil  # function-level: optional; without it only the process group is killed

        with contextlib.suppress(psutil.NoSuchProcess):
            descendants = psutil.Process(pid).children(recursive=True)
    except ImportError:
        pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for child in descendants:
        with contextlib.suppress(Exception):
            child.kill()


def run_command(cmd: list[str], log, timeout_s: float) -> int | None:
    """Run `cmd` with its output appended to the open file `log`; its return code, or None
    when it was killed at `timeout_s`."""
    log.write(f"$ {shlex.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait(timeout=max(timeout_s, 0.1))
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        log.write(f"\n[gpu] killed at the item's timeout ({timeout_s:.0f} s left)\n")
        return None


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of the text file at `path` ('' when it does not exist)."""
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) + "\n"


def run_item(item: Item, timeout_s: float, out_dir: Path,
             read_metrics: Callable[[Item], dict]) -> dict:
    """Run `item`'s commands under one deadline `timeout_s` from now; its record (module
    docstring). The whole output goes to WORK/<item>.full.log, its tail to OUT/<item>.log."""
    full_log = item.work / f"{item.name}.full.log"
    full_log.parent.mkdir(parents=True, exist_ok=True)
    if item.result.exists():  # a result of an earlier call must not pass for this one's
        item.result.unlink()
    start = time.monotonic()
    status, error, codes = "ok", None, []
    with open(full_log, "w") as log:
        for cmd in item.commands:
            left = timeout_s - (time.monotonic() - start)
            rc = run_command(cmd, log, left)
            codes.append(rc)
            if rc is None:
                status, error = "timeout", f"timed out after {timeout_s:.0f} s: {shlex.join(cmd)}"
                break
            if rc != 0:
                status, error = "failed", f"exit status {rc}: {shlex.join(cmd)}"
                break
    metrics = {}
    try:
        metrics = read_metrics(item)
    except (OSError, ValueError, KeyError, TypeError) as e:  # recorded, the next item runs
        if status == "ok":
            status, error = "failed", f"metrics: {type(e).__name__}: {e}"
    if status == "ok" and metrics.get("problems"):
        status, error = "failed", "; ".join(metrics["problems"])
    log_path = out_dir / f"{item.name}.log"
    log_path.write_text(tail(full_log))
    return {"item": item.name, "status": status, "seconds": round(time.monotonic() - start, 1),
            "metrics": metrics, "error": error, "commands": [shlex.join(c) for c in item.commands],
            "returncodes": codes, "log": str(log_path)}


def skipped(item: Item, reason: str) -> dict:
    return {"item": item.name, "status": "skipped", "seconds": 0.0, "metrics": {},
            "error": reason, "commands": [shlex.join(c) for c in item.commands],
            "returncodes": [], "log": None}


def run_items(items: list[Item], out_dir: Path, budget_s: float | None,
              read_metrics: Callable[[Item], dict], header: dict | None = None,
              say: Callable[[str], None] = print) -> list[dict]:
    """Run `items` in order; an item that would start with the budget spent is skipped, and
    one that starts gets min(its timeout, the budget left). Writes OUT/results.json ({**header,
    "items": records}) after each item; returns the records."""
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    records: list[dict] = []
    for item in items:
        left = None if budget_s is None else budget_s - (time.monotonic() - start)
        if left is not None and left <= 0:
            records.append(skipped(item, f"budget of {budget_s:.0f} s spent"))
        else:
            timeout = item.timeout_s if left is None else min(item.timeout_s, left)
            say(f"[gpu] {item.name}: {len(item.commands)} command(s), timeout {timeout:.0f} s")
            records.append(run_item(item, timeout, out_dir, read_metrics))
        rec = records[-1]
        say(f"[gpu] {item.name}: {rec['status']} in {rec['seconds']:.0f} s"
            + (f" ({rec['error']})" if rec["error"] else ""))
        (out_dir / "results.json").write_text(
            json.dumps({**(header or {}), "items": records}, indent=1, allow_nan=True))
    return records
