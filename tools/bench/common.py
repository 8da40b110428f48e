"""Shared helpers of the benchmarks (`python -m tools.bench`): tables, statistics, the result
protocol, machine facts, child launches.

Result protocol of every benchmark: a function returning `BenchResult(tables, summary)`;
`tables` are printed as aligned Markdown pipe tables (readable in a terminal and pasteable into
docs/benchmarks.md), `summary` is a flat JSON-serialisable dict printed as the last stdout line.
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Table:
    """A titled table: `rows` hold already formatted cells, one list per row."""

    title: str
    headers: list[str]
    rows: list[list[str]]
    notes: list[str] = field(default_factory=list)

    def render(self) -> str:
        """The table as an aligned Markdown pipe table under a `### title` line."""
        widths = [max(len(h), *(len(r[i]) for r in self.rows)) if self.rows else len(h)
                  for i, h in enumerate(self.headers)]
        line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
        out = [f"### {self.title}", "", line(self.headers),
               "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
        out += [line(r) for r in self.rows]
        out += [""] + self.notes if self.notes else []
        return "\n".join(out)


@dataclass
class BenchResult:
    tables: list[Table]
    summary: dict


def median(values: list[float]) -> float:
    """Median of a non-empty list (mean of the two middle values for even lengths)."""
    if not values:
        raise ValueError("median of an empty list")
    return float(statistics.median(values))


def fmt(value: float | None, digits: int = 3) -> str:
    """A float with `digits` decimals, or "n/a" for None."""
    return "n/a" if value is None else f"{value:.{digits}f}"


def quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated quantile of already sorted values."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def spread(values: list[float]) -> dict[str, float]:
    """Median, quartiles (linear), min and max of `values` (non-empty)."""
    s = sorted(values)
    return {"median": median(s), "q1": quantile(s, 0.25), "q3": quantile(s, 0.75),
            "min": s[0], "max": s[-1]}


def ratio_verdict(pair_ratios: list[float], goal: float) -> str:
    """An upper-bound goal on a ratio judged against the per-round ratios' spread: "met" when
    their upper quartile is <= goal, "missed" when the lower one is above it, else "within the
    spread"."""
    s = spread(pair_ratios)
    if s["q3"] <= goal:
        return "met"
    if s["q1"] > goal:
        return "missed"
    return "within the spread"


def timed_post(client, url: str, body: dict) -> tuple[float, dict]:
    """POST `body` as JSON with `client` (an httpx.Client, or the httpx module for a one-off
    connection): (seconds from sending to the whole answer, its JSON); a non-200 raises
    naming the URL."""
    t0 = time.perf_counter()
    r = client.post(url, json=body, timeout=600)
    seconds = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"{url}: {r.status_code}: {r.text[:300]}")
    return seconds, r.json()


def emit(result: BenchResult) -> None:
    """Print the tables, then the summary as one JSON object on the last stdout line."""
    for table in result.tables:
        print(table.render(), end="\n\n")
    print(json.dumps(result.summary, sort_keys=True), flush=True)


def last_json_line(text: str) -> dict:
    """The JSON object on the last non-empty line of `text` (a benchmark's stdout)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise ValueError("no output to parse")
    return json.loads(lines[-1])


def quiet_libraries() -> None:
    """Silence library warnings and progress bars (megatron and transformers are noisy on CPU);
    they go to stderr anyway, but keep the terminal readable."""
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


# set by a launcher or by parallel.process_groups.init_distributed in this process; a child
# torchrun must not inherit them
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def subprocess_env(threads: int | None = None) -> dict[str, str]:
    """Environment for a child benchmark process: repo root on PYTHONPATH, warnings off, no
    torch.distributed launcher variables of this process, and `OMP_NUM_THREADS=threads` when
    given (several ranks on 2 cores must not oversubscribe)."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", ""))
                                        if p)
    env["PYTHONWARNINGS"] = "ignore"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (a child torchrun's master port)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_launch(cmd: list[str], env: dict[str, str], timeout_s: int, what: str,
               cwd: str | None = None) -> tuple[str, str]:
    """Run a child launch (e.g. torchrun) in its own session; return (stdout, stderr). Raises
    RuntimeError naming `what` when it times out (the whole process group is killed) or exits
    non-zero (with the last 30 lines of its stderr)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RuntimeError(f"{what} timed out after {timeout_s} s") from None
    if proc.returncode != 0:
        tail = "\n".join(err.splitlines()[-30:])
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    return out, err


@contextlib.contextmanager
def torch_threads(n: int):
    """Run the block with `n` torch intra-op threads, then restore the previous count. On a
    shared 2-core host, 2 threads stall on each other whenever another process holds a core
    (every parallel op waits for its slowest thread), which makes timings meaningless."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else platform.processor(), else "unknown CPU"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_vector_units() -> str:
    """The CPU's wide vector and matrix extensions that CPU kernels pick paths by (vLLM's
    CPU backend among them): AVX2, AVX-512 (F, BF16) and AMX, as /proc/cpuinfo lists them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                names = (("avx2", "AVX2"), ("avx512f", "AVX-512F"),
                         ("avx512_bf16", "AVX-512 BF16"), ("amx_tile", "AMX"))
                return ", ".join(label for flag, label in names if flag in flags) or "none"
    except OSError:
        pass
    return "unknown"


def machine_info() -> dict:
    """Facts about the host the numbers came from (CPU, cores, memory, load, versions, GPU)."""
    import torch

    info = {"cpu": cpu_model(), "cpu_vector_units": cpu_vector_units(),
            "cpu_cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform()}
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        info["memory_gib"] = round(pages * size / 2 ** 30, 1)
        info["load_avg_1m"] = round(os.getloadavg()[0], 2)
    except (OSError, ValueError, AttributeError):
        pass
    try:
        from importlib.metadata import version

        info["megatron_core"] = version("megatron-core")
        info["transformers"] = version("transformers")
    except Exception:  # noqa: BLE001 - a missing distribution only drops a version string
        pass
    info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return info


def machine_table(info: dict) -> Table:
    return Table("Machine", ["key", "value"], [[k, str(v)] for k, v in info.items()])


def constant_adam(lr: float, distributed: bool = True):
    """The optim.* keys a bench item's TrainEngine.build takes: AdamW (betas 0.9 / 0.95, eps
    1e-8, no weight decay), gradient clipping at 1.0, a constant `lr` without warm-up;
    `distributed`: megatron's distributed optimizer."""
    from types import SimpleNamespace

    return SimpleNamespace(lr=lr, min_lr=0.0, warmup_steps=0, weight_decay=0.0, clip_grad=1.0,
                           betas=[0.9, 0.95], eps=1e-8, schedule="constant",
                           distributed_optimizer=distributed)
