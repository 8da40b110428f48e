"""The checklist item `trl` (run only when named: `--items trl`): `python -m tools.bench trl`
(TRL 1.16's GRPO, SFT and DPO trainers against the engine's defaults on the same model, rows
and sizes, one process each; tools/bench/trl.py) through prep bench-json, read by `read_trl`.
On a GPU host with vLLM's CUDA build the GRPO workloads add TRL's vLLM colocate mode and the
engine's rollout.backend=vllm (trl.vllm_rows_possible); without it they are left out with that
note. --cpu-smoke runs `trl --quick` (the quick model, 2 steps, TRL and engine-defaults rows).

Estimates: not measured on a GPU yet (~540 s guessed: 10 runs of ~25 s start and 5 steps of
~1 s each, and 4 vLLM runs of ~60 s, vLLM's start included; above the default 480 s budget:
`--items trl --budget-s 600`); the smoke ~420 s measured on the 2-core CPU host under load
(2026-11-29: 8 launches of ~50 s)."""
from __future__ import annotations

import json
from pathlib import Path

ESTIMATES = (540, 420)   # seconds on a GPU (guessed), of the CPU smoke (measured)
WORKLOADS = ("grpo_shared", "grpo_distinct", "sft", "dpo")


def trl_item(work: Path, smoke: bool, item, module):
    """The Item of `python -m tools.bench trl`; `item` and `module` are tools.bench.gpu.items'
    Item and module (passed in: items imports this module)."""
    out = work / "trl.json"
    cmd = module("tools.bench.gpu.prep", "bench-json", out, "trl",
                 *(["--quick"] if smoke else []))
    return item("trl", "trl", [cmd], 1500, out, work,
                note="TRL's trainers vs the engine's defaults, same model, rows and sizes")


def read_trl(item) -> dict:
    """{trl: {workload: {row: speedup}}, trl_steps, trl_vllm_rows} from tools.bench trl's
    summary (trl_<workload>_<row>_speedup keys); a workload without an engine-defaults
    speedup, or a failed row ("errors"), is a problem."""
    data = json.loads(Path(item.result).read_text())
    work: dict[str, dict[str, float]] = {}
    for workload in WORKLOADS:
        prefix = f"trl_{workload}_"
        rows = {k[len(prefix):-len("_speedup")]: v for k, v in data.items()
                if k.startswith(prefix) and k.endswith("_speedup")
                and k[len(prefix):-len("_speedup")] not in ("", "prefix_off")}
        if rows:
            work[workload] = rows
    problems = [f"trl {w}: no engine-defaults speedup" for w, rows in work.items()
                if rows.get("engine") is None]
    problems += [f"trl {name}: {error}" for name, error in (data.get("errors") or {}).items()]
    return {"trl": work, "trl_steps": data.get("trl_steps"),
            "trl_vllm_rows": data.get("trl_vllm_rows"), "problems": problems}


def trl_digest(metrics: dict) -> str:
    """'grpo_shared x2.61 (engine_prefix_on x3.10, engine_prefix_off x1.20); sft x1.35; ...':
    each workload's engine-defaults speedup over TRL, then its other rows'."""
    parts = []
    for workload, rows in metrics.get("trl", {}).items():
        head = rows.get("engine")
        others = [f"{k} x{v:.2f}" for k, v in rows.items()
                  if k not in ("engine", "trl") and v is not None]
        text = f"{workload} " + ("n/a" if head is None else f"x{head:.2f}")
        parts.append(text + (f" ({', '.join(others)})" if others else ""))
    return "; ".join(parts)
