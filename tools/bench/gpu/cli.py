"""The flags of `python -m tools.bench gpu` (the package docstring says what it runs)."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from tools.bench.gpu import __doc__ as PACKAGE_DOC
from tools.bench.gpu.items import ITEMS, ORDER, SMOKE_DEFAULT, Item, build_items
from tools.bench.gpu.output import report_markdown, saver, write_outputs
from tools.bench.gpu.plan import Step, make_plan, missing_reason, plan_text, probe
from tools.bench.gpu.environment import environment, environment_line
from tools.bench.gpu.report import read_metrics, table
from tools.bench.gpu.runner import planned_record, run_items

DEFAULT_BUDGET_S = 480.0  # 8 minutes of a 15-minute device lease, room for start and copies


def parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=PACKAGE_DOC.split("\n\n")[0],
                                epilog=PACKAGE_DOC.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", default=None,
                   help=f"comma-separated, run in this order (default: {','.join(ORDER)}; "
                        f"with --cpu-smoke: {','.join(SMOKE_DEFAULT)}; also: "
                        f"{','.join(n for n in ITEMS if n not in ORDER)})")
    p.add_argument("--out", default="/tmp/gpu_bench",
                   help="results.json, report.md and <item>.log go here (default %(default)s)")
    p.add_argument("--workdir", default="/tmp/gpu_bench_work",
                   help="models, data and run folders (default %(default)s; kept out of --out "
                        "so a device call does not send the models back)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help="total seconds; an item whose estimate does not fit the time left is "
                        "skipped, one that starts gets at most what is left (default "
                        "%(default)s; 0: no budget)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan, every command and the report's skeleton; run and "
                        "write nothing (CUDA assumed)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny sizes (hidden 64, 2 layers), fp32, on the CPU (CUDA hidden); "
                        "a manual check, minutes on a 2-core host")
    p.add_argument("--override", action="append", default=[], metavar="ITEM:ARG",
                   help="append ARG to ITEM's last command (an engine override such as "
                        "grpo:rollout.n=4, or a gpu_sft flag such as sft:--steps=4); repeatable")
    return p


def parse_overrides(specs: list[str]) -> dict[str, list[str]]:
    """['grpo:rollout.n=4', ...] -> {'grpo': ['rollout.n=4'], ...}."""
    out: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, arg = spec.partition(":")
        if not sep or not arg:
            raise ValueError(f"--override {spec!r}: expected ITEM:ARG with ITEM one of "
                             f"{', '.join(ITEMS)}")
        out.setdefault(name, []).append(arg)
    return out


def cuda_available() -> bool:
    import torch  # function-level: --dry-run and --help need no torch

    return torch.cuda.is_available()


def plan_items(items: list[Item], cuda: bool, budget_s: float) -> list[Step]:
    """The plan of `items` on this host (plan.probe) with CUDA as `cuda` says."""
    have = probe(cuda)
    return make_plan([(i.name, i.estimate_s, missing_reason(i.needs, have)) for i in items],
                     budget_s)


def print_commands(items: list[Item]) -> None:
    for item in items:
        print(f"## {item.name} (timeout {item.timeout_s:.0f} s)")
        for cmd in item.commands:
            print(shlex.join(cmd))


def main(argv: list[str] | None = None, prog: str = "python -m tools.bench gpu") -> int:
    p = parser(prog)
    args = p.parse_args(argv)
    names = args.items.split(",") if args.items else list(SMOKE_DEFAULT if args.cpu_smoke
                                                          else ORDER)
    try:
        items = build_items([n for n in names if n], Path(args.workdir), args.cpu_smoke,
                            parse_overrides(args.override))
    except ValueError as e:
        p.error(str(e))
    cuda = not args.cpu_smoke and (args.dry_run or cuda_available())
    if not cuda and not args.cpu_smoke:
        print("skipped: no CUDA (python -m tools.bench gpu --cpu-smoke runs grpo and vision "
              "at tiny sizes on the CPU)")
    steps = plan_items(items, cuda, args.budget_s)
    print(plan_text(steps, args.budget_s, "dry run: CUDA assumed" if args.dry_run else ""))
    env = environment(cuda and not args.dry_run)
    out = Path(args.out)
    header = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "environment": env, "cpu_smoke": args.cpu_smoke, "dry_run": args.dry_run,
              "budget_s": args.budget_s, "argv": sys.argv[1:] if argv is None else argv}
    skeleton = [planned_record(i, s) for i, s in zip(items, steps)]
    if args.dry_run:   # prints the plan, the commands and the report's skeleton; writes nothing
        print_commands(items)
        print(f"\n{report_markdown(header, steps, skeleton)}\n[gpu] dry run: nothing run, "
              "nothing written")
        return 0
    if not any(s.status == "planned" for s in steps):
        write_outputs(out, header, steps, skeleton)
        print(f"[gpu] nothing run; the report's skeleton: {out / 'report.md'}, "
              f"{out / 'results.json'}")
        return 0
    if args.cpu_smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the children run on the CPU
    print(f"[gpu] {environment_line(env)}", flush=True)
    start = time.monotonic()
    records = run_items(items, steps, out, args.budget_s, read_metrics,
                        save=saver(out, header, steps), say=lambda s: print(s, flush=True))
    print(f"\n{table(records)}\n\nEnvironment: {environment_line(env)}\n"
          f"Total {time.monotonic() - start:.0f} s; results in {out / 'results.json'}, "
          f"{out / 'report.md'}")
    print(json.dumps({"items": {r["item"]: r["status"] for r in records},
                      "seconds": round(time.monotonic() - start, 1),
                      "results": str(out / "results.json"), "report": str(out / "report.md")}))
    return 0 if all(r["status"] in ("ok", "skipped") for r in records) else 1
