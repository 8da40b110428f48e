"""`python -m tools.bench gpu` (tools/bench/gpu/): the GPU checklist's commands, its runner
(a failed or timed-out item is recorded and the next one runs; the budget skips items) and its
metrics, on the CPU: --dry-run, the no-CUDA skip, and one --cpu-smoke run of grpo and vision."""
from __future__ import annotations

import json
import math
import sys
import time

from tests.launch import run_python
from tools.bench import __main__ as bench
from tools.bench.common import last_json_line
from tools.bench.gpu import cli
from tools.bench.gpu.items import ITEMS, RL_KEYS, Item
from tools.bench.gpu.report import read_metrics, table
from tools.bench.gpu.runner import run_items


def test_dry_run_prints_every_items_commands(tmp_path, capsys):
    assert bench.main(["gpu", "--dry-run", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("## ")] == list(ITEMS)
    sft, head = (line for line in out.splitlines() if "tools.bench.gpu_sft" in line)
    assert "--cases dense,moe --steps 8 --warmup 3" in sft
    assert "--cases dense,unchunked --seq 16384 --gbs 1 --rows 2 --steps 3 --warmup 1" in head
    rl = [line for line in out.splitlines() if "-m engine.rl" in line]
    assert len(rl) == 2 and "model.lora.init_from=" in rl[1] and "init_from" not in rl[0]
    for line in rl:
        for part in ("model.dtype=bfloat16", "rollout.backend=hf", "rollout.check_weight_sync=true",
                     "train.max_steps=3"):
            assert part in line
    assert "--hidden 512 --layers 8 --intermediate 1536" in out
    assert "lora-adapter" in out and "--scale 0.05" in out
    assert "model.vision.freeze=false" in out and "vision-rows" in out
    assert "parallel.overlap_grad_reduce" not in out  # the vision item keeps the default
    assert str(tmp_path) in out and sys.executable in out


def test_without_cuda_it_skips(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "cuda_available", lambda: False)
    assert bench.main(["gpu", "--out", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.startswith("skipped: no CUDA")
    assert not (tmp_path / "out").exists()


def _python_item(name: str, code: str, work, timeout_s: float = 60) -> Item:
    return Item(name, "rl", [[sys.executable, "-c", code]], timeout_s,
                work / name / "metrics.jsonl", work / name, expected_steps=2)


def _write_steps(path, rows) -> str:
    """Python code that writes these metrics rows (as the engine does) to `path`."""
    text = "".join(json.dumps(r) + "\n" for r in rows)  # NaN as json writes it
    return (f"import pathlib; p = pathlib.Path({str(path)!r}); p.parent.mkdir(exist_ok=True); "
            f"p.write_text({text!r})")


def test_runner_records_failures_timeouts_and_the_budget(tmp_path):
    good = [{"step": s, **{k: 0.5 * s for k in RL_KEYS}} for s in (1, 2)]
    nan = [dict(good[0]), dict(good[1], **{"rollout/logprob_diff": float("nan")})]
    items = [_python_item("crash", "raise SystemExit(3)", tmp_path),
             _python_item("hang", "import time; time.sleep(60)", tmp_path, timeout_s=1.5),
             _python_item("nan", _write_steps(tmp_path / "nan" / "metrics.jsonl", nan), tmp_path),
             _python_item("short", _write_steps(tmp_path / "short" / "metrics.jsonl", good[:1]),
                          tmp_path),
             _python_item("good", _write_steps(tmp_path / "good" / "metrics.jsonl", good),
                          tmp_path)]
    start = time.monotonic()
    records = run_items(items, tmp_path / "out", None, read_metrics, say=lambda s: None)
    assert time.monotonic() - start < 30  # the sleeping child was killed at its timeout
    status = {r["item"]: r["status"] for r in records}
    assert status == {"crash": "failed", "hang": "timeout", "nan": "failed", "short": "failed",
                      "good": "ok"}
    by = {r["item"]: r for r in records}
    assert by["crash"]["returncodes"] == [3] and "exit status 3" in by["crash"]["error"]
    assert by["hang"]["returncodes"] == [None] and by["hang"]["seconds"] < 15
    assert "non-finite: rollout/logprob_diff" in by["nan"]["error"]
    assert "1 of 2 steps" in by["short"]["error"]
    assert by["good"]["metrics"]["steps"][1]["time/step_s"] == 1.0
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["status"] for r in saved["items"]] == [r["status"] for r in records]
    assert "| hang | timeout |" in table(records)
    # a budget spent before an item starts skips it (and every later one)
    records = run_items(items[-1:], tmp_path / "out2", 1e-9, read_metrics, say=lambda s: None)
    assert records[0]["status"] == "skipped" and "budget" in records[0]["error"]


def test_cpu_smoke_runs_grpo_and_vision_after_a_failed_item(tmp_path):
    """loss_head fails (a bad gpu_sft flag injected with --override) and is recorded; grpo and
    vision still run, at tiny sizes in fp32, and report finite numbers: the fp32 engine
    matches the trainer's log-probs (rollout/logprob_diff < 1e-5, vs ~1e-2 in bf16 on an H100)
    and the vision run's loss falls."""
    out = tmp_path / "out"
    proc = run_python("-m", "tools.bench", "gpu", "--cpu-smoke", "--items",
                      "loss_head,grpo,vision", "--override", "loss_head:--cases=no_such_case",
                      "--out", str(out), "--workdir", str(tmp_path / "work"), timeout=240)
    assert proc.returncode == 1, proc.stderr[-3000:]  # one item failed
    summary = last_json_line(proc.stdout)
    assert summary["items"] == {"loss_head": "failed", "grpo": "ok", "vision": "ok"}
    assert "| item | status | s | key numbers |" in proc.stdout
    assert "Environment: " in proc.stdout and "torch " in proc.stdout
    results = json.loads((out / "results.json").read_text())
    assert results["cpu_smoke"] is True and results["environment"]["gpu"] is None
    head, grpo, vision = results["items"]
    assert "exit status 2" in head["error"] and "no_such_case" in (out / "loss_head.log").read_text()
    steps = grpo["metrics"]["steps"]
    assert len(steps) == 2 and all(math.isfinite(s[k]) for s in steps for k in RL_KEYS)
    assert all(s["rollout/logprob_diff"] < 1e-5 for s in steps)
    assert all(s["time/step_s"] > 0 for s in steps)
    losses = [s["loss"] for s in vision["metrics"]["steps"]]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert all(r["seconds"] > 0 for r in (grpo, vision))
    assert (out / "grpo.log").read_text().count("$ ") == 3  # model, data, engine.rl
