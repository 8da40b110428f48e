"""Run the checklist's items one after another: subprocesses, timeouts, the budget, the logs.

Every command runs from the repository root with `PYTHONPATH` = the repository root in front
of the caller's PYTHONPATH (the carried megatron-core and hydra wheels stay reachable), in its
own session; at its item's deadline it is killed with all its descendants (torchrun workers
included). A record per item: {"item", "kind", "estimate_s", "note", "status" (planned |
ok | failed | timeout | skipped), "seconds" (None until it ran), "metrics", "error" (why it
failed), "reason" (why it was skipped), "commands", "returncodes", "log"}. A command that exits
non-zero fails its item (the later commands of that item are not run); so does a metrics
reader that raises or lists "problems" (tools.bench.gpu.report.read_metrics). The caller's
`save` (tools.bench.gpu.output: OUT/results.json and OUT/report.md) gets the records after
every item, so a killed call keeps what finished and shows what was left.
"""
from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

from tools.bench.gpu.items import Item
from tools.bench.gpu.plan import Step, budget_reason

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


def base_record(item: Item) -> dict:
    """The fields every record of `item` has, whatever its status."""
    return {"item": item.name, "kind": item.kind, "estimate_s": item.estimate_s,
            "note": item.note or None, "commands": [shlex.join(c) for c in item.commands]}


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
    return {**base_record(item), "status": status,
            "seconds": round(time.monotonic() - start, 1), "metrics": metrics, "error": error,
            "reason": None, "returncodes": codes, "log": str(log_path)}


def planned_record(item: Item, step: Step) -> dict:
    """The skeleton record of `item` as the plan has it: planned, or skipped with a reason."""
    return {**base_record(item), "status": step.status, "seconds": None, "metrics": {},
            "error": None, "reason": step.reason, "returncodes": [], "log": None}


def skipped(item: Item, reason: str) -> dict:
    return {**base_record(item), "status": "skipped", "seconds": None, "metrics": {},
            "error": None, "reason": reason, "returncodes": [], "log": None}


def run_items(items: list[Item], steps: list[Step], out_dir: Path, budget_s: float | None,
              read_metrics: Callable[[Item], dict],
              save: Callable[[list[dict]], None] = lambda records: None,
              say: Callable[[str], None] = print) -> list[dict]:
    """Run `items` in order (`steps`: their plan, tools.bench.gpu.plan.make_plan). An item
    whose requirements are missing stays skipped; any other runs when its estimate fits the
    budget really left (plan.budget_reason; the plan's forecast is not binding), with at
    most min(its timeout, the budget left). `save(records)` gets the skeleton (planned or
    skipped) first and the records again after every item; returns the records."""
    out_dir.mkdir(parents=True, exist_ok=True)
    budget = budget_s if budget_s and budget_s > 0 else None
    start = time.monotonic()
    records = [planned_record(item, step) for item, step in zip(items, steps)]
    save(records)
    for i, (item, step) in enumerate(zip(items, steps)):
        left = None if budget is None else budget - (time.monotonic() - start)
        reason = step.reason if step.blocked else budget_reason(item.estimate_s, left)
        if reason:
            records[i] = skipped(item, reason)
        else:
            timeout = item.timeout_s if left is None else min(item.timeout_s, left)
            say(f"[gpu] {item.name}: {len(item.commands)} command(s), ~{item.estimate_s:.0f} s "
                f"expected, timeout {timeout:.0f} s")
            records[i] = run_item(item, timeout, out_dir, read_metrics)
        rec = records[i]
        detail = rec["error"] or rec["reason"]
        say(f"[gpu] {item.name}: {rec['status']}"
            + (f" in {rec['seconds']:.0f} s" if rec["seconds"] is not None else "")
            + (f" ({detail})" if detail else ""))
        save(records)
    return records
