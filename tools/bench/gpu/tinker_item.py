"""The checklist item `tinker` (run only when named: `--items tinker`): `python -m tools.bench
tinker` (tools/bench/tinker_batching.py: four LoRA models' forward_backward calls through the
official SDK, concurrent (one batch) vs one after another; goal ratio <= 0.5, docs/tinker.md) once
per service backend, `--backend hf` (transformers, on the first GPU) then `--backend megatron`
(Megatron-Core on one rank, CUDA), each through prep bench-json into a file of its own
(tinker_<backend>.json), read by `read_tinker`. The item's `result` is the last command's file
(the runner removes it before the run); prep bench-json removes its OUT before it runs, so
neither file survives from an earlier call. --cpu-smoke runs both with `--quick` (the quick
model, 3 rounds).

Estimates: not measured on a GPU yet (~100 s guessed: per backend ~10 s to build the model,
~20-30 s for the server to start (megatron's build the longer), 12 rounds of 4 calls each way
of ~50 ms each: ~45 s each); the smoke 70 s measured on the 2-core CPU host (2026-11-29, load
1-3: `--cpu-smoke --items tinker` once; `python -m tools.bench tinker --quick` alone: hf 23 s,
megatron 36 s and 42 s, its server's Megatron-Core build the longer start; the megatron runs'
rounds had stalls of 2-5 s, per-round ratio quartiles 1.6-13 and 1.0-9.4, not investigated
here)."""
from __future__ import annotations

import json
from pathlib import Path

from tools.bench.gpu.numbers import fmt

ESTIMATES = (100, 70)   # seconds on a GPU (guessed), of the CPU smoke (measured)
BACKENDS = ("hf", "megatron")   # in the order the item runs them


def tinker_item(work: Path, smoke: bool, item, module):
    """The Item of `python -m tools.bench tinker` on both backends; `item` and `module` are
    tools.bench.gpu.items' Item and module (passed in: items imports this module)."""
    outs = [work / f"tinker_{b}.json" for b in BACKENDS]
    cmds = [module("tools.bench.gpu.prep", "bench-json", out, "tinker", "--backend", backend,
                   *(["--quick"] if smoke else []))
            for backend, out in zip(BACKENDS, outs)]
    return item("tinker", "tinker", cmds, 600, outs[-1], work,
                note="4 LoRA models x 4 datums; concurrent / one after another, goal <= 0.5")


def read_backend(path: Path, backend: str) -> tuple[dict, list[str]]:
    """(the numbers of one backend's summary, its problems): a file or ratio that is missing, a
    summary of another backend, concurrent batch rows other than models x datums (the calls
    were not run as one batch)."""
    if not path.exists():
        return {}, [f"tinker {backend}: no result ({path.name} not written)"]
    data = json.loads(path.read_text())
    rows = data.get("tinker_batch_rows") or {}
    numbers = {"ratio": data.get("tinker_concurrent_over_sequential"),
               "quartiles": data.get("tinker_ratio_quartiles"),
               "batch_rows": rows, "verdict": data.get("tinker_verdict"),
               "models": data.get("tinker_models"), "datums": data.get("tinker_datums"),
               "tokens": data.get("tinker_tokens")}
    problems = []
    if numbers["ratio"] is None:
        problems.append(f"tinker {backend}: no concurrent / sequential ratio")
    if data.get("tinker_backend") != backend:
        problems.append(f"tinker {backend}: the summary is of backend "
                        f"{data.get('tinker_backend')!r}")
    models, datums = numbers["models"], numbers["datums"]
    want = models * datums if models and datums else None
    if want is None or rows.get("concurrent") != want:
        problems.append(f"tinker {backend}: concurrent batch rows {rows.get('concurrent')}, "
                        f"not models x datums ({models} x {datums})")
    return numbers, problems


def read_tinker(item) -> dict:
    """{tinker: {backend: {ratio, quartiles, batch_rows, verdict, models, datums, tokens}},
    problems} from the item's files (its folder's tinker_<backend>.json); a backend whose
    numbers are missing is left out of `tinker` and listed under problems. A missed goal is a
    measurement, not a problem."""
    work, problems = {}, []
    for backend in BACKENDS:
        numbers, wrong = read_backend(Path(item.result).parent / f"tinker_{backend}.json",
                                      backend)
        if numbers:
            work[backend] = numbers
        problems += wrong
    return {"tinker": work, "problems": problems}


def tinker_digest(metrics: dict) -> str:
    """'hf 0.412 (quartiles 0.40-0.45, rows 16 vs 4, met); megatron 0.380 (...)': each
    backend's concurrent / sequential ratio, the per-round quartiles, the largest batch's rows
    concurrent vs one after another, the verdict against 0.5."""
    parts = []
    for backend, m in metrics.get("tinker", {}).items():
        lo, hi = (m.get("quartiles") or [None, None])[:2]
        rows = m.get("batch_rows") or {}
        parts.append(f"{backend} {fmt(m.get('ratio'), '.3f')} (quartiles {fmt(lo, '.2f')}-"
                     f"{fmt(hi, '.2f')}, rows {fmt(rows.get('concurrent'), '.0f')} vs "
                     f"{fmt(rows.get('sequential'), '.0f')}, {m.get('verdict')})")
    return "; ".join(parts)
