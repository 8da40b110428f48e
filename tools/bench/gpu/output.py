"""What a `python -m tools.bench gpu` call leaves in OUT: results.json and report.md.

results.json: {**header (date, environment, argv, budget_s, dry_run, cpu_smoke, plan: one
{item, estimate_s, status, reason, start_s} per item), "items": one record per item
(tools.bench.gpu.runner), "ratios": tools.bench.gpu.report.engine_peer_ratios (the engine's
tokens/s over the transformers peer's, per sft case and peer mode; {} until both ran)}.
report.md: a title, the Markdown table of tools.bench.gpu.report
(item | status | s | est. s | key numbers), the budget line and the environment line, ready to
paste into docs/benchmarks.md. Both are written when nothing can run (the skeleton: every
item skipped with its reason) and rewritten after every item of a real run; a dry run prints
the skeleton and writes nothing.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from tools.bench.gpu.plan import Step, planned_seconds
from tools.bench.gpu.environment import environment_line
from tools.bench.gpu.report import engine_peer_ratios, table


def budget_line(header: dict, steps: list[Step], records: list[dict]) -> str:
    """'Budget 480 s; planned ~439 s (6 items); ran 352 s (5 ok, 0 failed, 4 skipped).'"""
    budget = header.get("budget_s")
    ran = [r for r in records if r.get("seconds") is not None]
    count = {s: sum(r["status"] == s for r in records) for s in
             ("ok", "failed", "timeout", "skipped", "planned")}
    done = ", ".join(f"{n} {s}" for s, n in count.items() if n)
    return (f"Budget {'none' if not budget else f'{budget:.0f} s'}; planned "
            f"~{planned_seconds(steps):.0f} s ({sum(s.status == 'planned' for s in steps)} "
            f"items); ran {sum(r['seconds'] for r in ran):.0f} s ({done}).")


def report_markdown(header: dict, steps: list[Step], records: list[dict]) -> str:
    kind = "dry run, nothing ran" if header.get("dry_run") else (
        "CPU smoke" if header.get("cpu_smoke") else "GPU")
    return (f"# python -m tools.bench gpu: {header.get('date', '')} ({kind})\n\n"
            f"{table(records)}\n\n{budget_line(header, steps, records)}\n\n"
            f"Environment: {environment_line(header['environment'])}\n")


def write_outputs(out_dir: Path, header: dict, steps: list[Step], records: list[dict]) -> None:
    """OUT/results.json and OUT/report.md (module docstring)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {**header, "plan": [asdict(s) for s in steps], "items": records,
            "ratios": engine_peer_ratios(records)}
    (out_dir / "results.json").write_text(json.dumps(data, indent=1, allow_nan=True))
    (out_dir / "report.md").write_text(report_markdown(header, steps, records))


def saver(out_dir: Path, header: dict, steps: list[Step]) -> Callable[[list[dict]], None]:
    """The runner's `save`: write_outputs with these header and plan."""
    return lambda records: write_outputs(out_dir, header, steps, records)
